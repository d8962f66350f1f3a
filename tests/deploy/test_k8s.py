"""configs/k8s validates against the Kubernetes OpenAPI schema (kubernetes-validate's bundled
JSON schemas, strict: unknown fields fail, offline), and its pieces fit together (selectors,
probes on /health and /ready, resource requests, shutdown timings, the headless Service the
gateway's DNS discovery reads, the ports of its event template). The ConfigMap's gateway config
loads as laid out in the pod, and runs here: its discovery entry, pointed at a simulated worker
on 127.0.0.1, finds it, subscribes to its events through the `{host}` template and routes.

The external tools are installed by .ci/run (apt-get); where one is missing the test skips with
a warning that pytest prints in its summary.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_rig import K8S, K8S_VERSION, ROOT, _flag, _free_pair, _get, _ids, _Procs, _ready_lines, _wait_until

# ------------------------------------------------------------------------------ kubernetes


def _k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out.append((f.name, doc))
    return out


def test_k8s_manifests_validate_against_the_kubernetes_openapi_schema() -> None:
    import kubernetes_validate as kv  # the dev extra: installed wherever the tests run
    docs = _k8s_docs()
    kinds = {d["kind"] for _, d in docs}
    assert {"Deployment", "Service", "ConfigMap"} <= kinds
    for fname, doc in docs:
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            raise AssertionError(f"{fname}: {doc['kind']}/{doc['metadata']['name']} at "
                                 f"{'.'.join(map(str, e.path))}: {e.message}") from None
        except kv.SchemaNotFoundError as e:
            raise AssertionError(f"{fname}: {e.message}") from None
    # the validator is strict: a misspelt field and a wrong type fail
    dep = copy.deepcopy(next(d for _, d in docs if d["kind"] == "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)
    dep = copy.deepcopy(next(d for _, d in docs if d["kind"] == "Deployment"))
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)


def _probe_path(container: dict[str, Any], probe: str) -> str | None:
    p = container.get(probe)
    return None if p is None or "httpGet" not in p else p["httpGet"]["path"]


def _k8s_gateway_config_file(tmp: Path) -> tuple[Path, dict[str, Any]]:
    """The gateway Deployment's config file, laid out as in the pod: the ConfigMap's file in
    `configs/<mount folder>/` beside the image's `configs/assets` and `configs/profiles` (here
    links to the repository's). Returns the file and the gateway Deployment's container."""
    docs = [d for _, d in _k8s_docs()]
    gw = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-gateway")
    pod = gw["spec"]["template"]["spec"]
    c = pod["containers"][0]
    config_path = Path(_flag(c["command"], "--config") or "")
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == vol["configMap"]["name"])
    assert config_path.parts[:3] == ("/", "app", "configs"), config_path  # the image's tree is /app
    image_configs = tmp / "app" / "configs"
    folder = tmp / config_path.relative_to("/").parent
    folder.mkdir(parents=True)
    for name in ("assets", "profiles"):
        (image_configs / name).symlink_to(ROOT / "configs" / name, target_is_directory=True)
    f = folder / config_path.name
    f.write_text(cm["data"][config_path.name])
    return f, c


def test_k8s_manifests_fit_together(tmp_path: Path) -> None:
    from router.config import load_config

    docs = [d for _, d in _k8s_docs()]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert {"kvroute-gateway", "kvroute-worker", "kvroute-valkey"} == set(deployments)
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        for c in pod["spec"]["containers"]:
            req = c.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(req), f"{name}/{c['name']}: no resource requests"
            assert c.get("livenessProbe") and c.get("readinessProbe"), f"{name}/{c['name']}: no probes"
    for name, svc in services.items():
        sel = svc["spec"]["selector"]
        pods = [d["spec"]["template"] for d in deployments.values()
                if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, f"Service {name} selects {len(pods)} Deployments' pods"
        for port in svc["spec"]["ports"]:
            names = {p["name"] for c in pods[0]["spec"]["containers"] for p in c.get("ports", [])}
            assert port["targetPort"] in names, f"Service {name}: port {port['targetPort']} not on its pods"

    # the gateway: probes on /health and /ready, its config is the ConfigMap's and loads
    cfg_file, c = _k8s_gateway_config_file(tmp_path)
    assert _probe_path(c, "livenessProbe") == "/health" and _probe_path(c, "readinessProbe") == "/ready"
    assert _probe_path(c, "startupProbe") == "/health"
    cfg = load_config(cfg_file, environ={})
    assert cfg.listen.host == "0.0.0.0" and cfg.admin_token is None
    assert {p["containerPort"] for p in c["ports"]} == {cfg.listen.port}
    assert services["kvroute-gateway"]["spec"]["ports"][0]["port"] == cfg.listen.port
    assert cfg.models[0].id == "kvroute/tiny-llama" and cfg.models[0].tokenizer.is_dir()
    gw_pod = deployments["kvroute-gateway"]["spec"]["template"]["spec"]
    assert gw_pod["terminationGracePeriodSeconds"] > cfg.shutdown.grace_s + cfg.shutdown.drain_timeout_s
    ready = c["readinessProbe"]  # out of the Service before the listener closes
    assert ready["periodSeconds"] * ready["failureThreshold"] < cfg.shutdown.grace_s

    # workers: no static list, one DNS name, the headless Service over the worker pods
    assert not cfg.workers and len(cfg.discovery) == 1
    d = cfg.discovery[0]
    headless = [n for n, s in services.items() if s["spec"].get("clusterIP") == "None"]
    assert headless == ["kvroute-workers"] and d.name.split(".")[0] == "kvroute-workers"
    assert not d.srv and d.kind == "kvroute" and d.model == "kvroute/tiny-llama"
    worker = deployments["kvroute-worker"]["spec"]["template"]["spec"]
    assert "hostname" not in worker and "subdomain" not in worker  # interchangeable pods
    wc = worker["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in wc["ports"]}
    svc_ports = {p["name"]: p["port"] for p in services["kvroute-workers"]["spec"]["ports"]}
    assert svc_ports == ports  # SRV records and the A-record ports agree
    assert d.port == ports["http"]
    # each pod's KV events at its own address: the {host} template on the ports it binds
    assert d.events is not None
    assert d.events.endpoint == f"tcp://{{host}}:{ports['events']}"
    assert d.events.replay_endpoint == f"tcp://{{host}}:{ports['replay']}"
    cmd = wc["command"]
    assert int(_flag(cmd, "--port") or 0) == ports["http"] and _flag(cmd, "--host") == "0.0.0.0"
    assert int(_flag(cmd, "--events-port") or 0) == ports["events"] and ports["replay"] == ports["events"] + 1
    assert _flag(cmd, "--model") == "default"
    # every pod its own worker id: the pod name, from the downward API
    assert _flag(cmd, "--worker-id") == "$(POD_NAME)"
    env = {e["name"]: e for e in wc["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    remote = urllib.parse.urlsplit(_flag(cmd, "--remote-url") or "")
    assert remote.hostname in services, "the REMOTE tier's host is no Service"
    assert remote.port == services[remote.hostname or ""]["spec"]["ports"][0]["port"]
    assert _probe_path(wc, "livenessProbe") == "/health" and _probe_path(wc, "readinessProbe") == "/health"
    assert deployments["kvroute-worker"]["spec"]["replicas"] >= 2
    assert deployments["kvroute-gateway"]["spec"]["replicas"] >= 2  # no single gateway pod


@pytest.mark.slow
def test_k8s_gateway_config_finds_a_worker_through_dns(tmp_path: Path, procs: _Procs) -> None:
    """The ConfigMap's gateway config, run here against a simulated tiny-Llama worker (the model
    it names): its discovery entry resolves 127.0.0.1 on the worker's port instead of the
    headless Service's name, the event ports are the worker's. The gateway finds the worker,
    names it from the entry, subscribes to its KV events through the `{host}` template, becomes
    ready and routes to it."""
    from loadtest.ports import free_port

    cfg_file, _ = _k8s_gateway_config_file(tmp_path)
    cfg = yaml.safe_load(cfg_file.read_text())
    entry = cfg["discovery"][0]
    http = free_port()
    events = _free_pair({http})
    sim_log = tmp_path / "sim.log"
    sim = procs.start([sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", "1", "--profile", "tiny-cpu",
                       "--base-port", str(http), "--events-base-port", str(events), "--host", "127.0.0.1",
                       "--tokenizer", str(ROOT / "configs" / "assets" / "tiny-tokenizer")], sim_log)
    entry["name"], entry["port"] = "127.0.0.1", http
    for key, port in (("endpoint", events), ("replay_endpoint", events + 1)):
        entry["events"][key] = re.sub(r":\d+$", f":{port}", entry["events"][key])
        assert entry["events"][key] == f"tcp://{{host}}:{port}"
    port = free_port()
    cfg["listen"] = {"host": "127.0.0.1", "port": port}
    cfg["shutdown"] = {"grace_s": 0, "drain_timeout_s": 5}
    test_cfg = cfg_file.with_name("gateway-test.yaml")  # beside it: the same relative paths
    test_cfg.write_text(yaml.safe_dump(cfg))
    _ready_lines(sim_log, sim)
    gw_log = tmp_path / "gateway.log"
    gw = procs.start([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(test_cfg)], gw_log,
                     env={k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")})
    url = f"http://127.0.0.1:{port}"
    _wait_until(lambda: _get(url + "/ready", 1)[0] == 200, 60, "gateway /ready", gw, gw_log)
    (w,) = json.loads(_get(url + "/admin/workers")[1])["workers"]
    assert w["id"] == f"{entry['id_prefix']}-127.0.0.1-{http}" and w["state"] == "healthy", w
    assert w["url"] == f"http://127.0.0.1:{http}"
    assert w["events"]["endpoint"] == f"tcp://127.0.0.1:{events}", w["events"]
    assert w["events"]["replay_endpoint"] == f"tcp://127.0.0.1:{events + 1}", w["events"]
    body = json.dumps({"model": "tiny", "prompt": _ids(7, 16 * 4), "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    # the worker's KV events reached the index through the templated endpoint

    def indexed() -> bool:
        stats = json.loads(_get(url + "/admin/index")[1])
        return bool(stats["kvroute/tiny-llama"]["blocks"] >= 4 and stats["_ingest"][w["id"]]["events"] > 0)

    _wait_until(indexed, 10, "the request's blocks in the gateway's index", gw, gw_log)
