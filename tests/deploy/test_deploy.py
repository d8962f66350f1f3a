"""Packaging, checked without a Docker engine or a cluster (docs/operations.md, "Deploy").

- docker-compose.yml validates with Debian's `docker-compose config` (profile `sim` too); every
  build context, Dockerfile, file a Dockerfile copies and file the compose file mounts exists;
  the gateway configs it mounts load and name the worker services on the ports their commands
  open; the gateway image installs no torch, the worker image pins the CPU torch build (the index
  a build argument); the engine workers' commands and the gateway config serve together here.
- configs/k8s validates against the Kubernetes OpenAPI schema (kubernetes-validate's bundled
  JSON schemas, strict: unknown fields fail, offline), and its pieces fit together (selectors,
  probes on /health and /ready, resource requests, shutdown timings, the headless Service the
  gateway's DNS discovery reads, the ports of its event template). The ConfigMap's gateway config
  loads as laid out in the pod, and runs here: its discovery entry, pointed at a simulated worker
  on 127.0.0.1, finds it, subscribes to its events through the `{host}` template and routes.
- configs/prometheus/prometheus.yml passes `promtool check config`; the Grafana provisioning
  names the dashboard's datasource and folder; the dashboard reads only metrics the code defines.
- A real Prometheus (Debian's package) scrapes a real gateway, a simulated fleet and a worker
  that answers 429, with the shipped scrape config (targets rewritten); after traffic with a
  repeated prefix, CPU-tier hits, prefetches, retries and shedding, EVERY PromQL expression of
  the dashboard is evaluated through Prometheus' HTTP API and must return data; what it reads
  with rate() must be a counter (`_total`) or histogram buckets, the rest gauges, by the scraped
  metadata. Each query and its result is printed (`-s` shows them).

The external tools are installed by .ci/run (apt-get); where one is missing the test skips with
a warning that pytest prints in its summary.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hangs import patience

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "kvroute.json"
GRAFANA_PROVISIONING = ROOT / "configs" / "grafana" / "provisioning"
PROMETHEUS_YML = ROOT / "configs" / "prometheus" / "prometheus.yml"
K8S = ROOT / "configs" / "k8s"
K8S_VERSION = "1.33"  # the oldest Kubernetes the manifests are checked against (schemas bundled to 1.37)
# Grafana's own variables in the dashboard's queries, and what the test evaluates them as
# ($__rate_interval is at least 4 scrape intervals; the test scrapes every second).
GRAFANA_VARS = {"$__rate_interval": "1m"}


def _skip_loudly(what: str) -> None:
    msg = f"{what}: this deploy check did NOT run (.ci/run installs it with apt-get)"
    warnings.warn(msg, UserWarning, stacklevel=2)
    print(f"\n*** SKIPPED: {msg}", file=sys.stderr)
    pytest.skip(msg)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        _skip_loudly(f"`{name}` is not installed")
        raise AssertionError("unreachable")
    return path


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _flag(command: list[str], name: str) -> str | None:
    """The value of `--name=V` or `--name V` in an argv list."""
    for i, word in enumerate(command):
        if word == name and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def _dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, expr) of every target of every panel, rows included."""
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((p["title"], t.get("legendFormat", ""), t["expr"]))

    walk(dash["panels"])
    return out


def _expand(expr: str) -> str:
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


# ------------------------------------------------------------------------------ compose


def test_compose_file_validates_with_docker_compose() -> None:
    exe = _tool("docker-compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    for extra, expected in (([], {"gateway", "worker-0", "worker-1", "valkey", "prometheus", "grafana"}),
                            (["--profile", "sim"], {"sim-workers", "gateway-sim"})):
        r = subprocess.run([exe, "-f", str(COMPOSE), "--project-directory", str(ROOT), *extra, "config"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        rendered = yaml.safe_load(r.stdout)
        assert expected <= set(rendered["services"]), (expected, set(rendered["services"]))
    raw = _compose()["services"]
    assert all(raw[s].get("profiles") == ["sim"] for s in ("sim-workers", "gateway-sim"))
    assert not any(raw[s].get("profiles") for s in ("gateway", "worker-0", "worker-1", "valkey", "prometheus",
                                                    "grafana"))


def _dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        buf = f"{buf} {s[:-1]}" if s.endswith("\\") else f"{buf} {s}"
        if not s.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def _dockerignored(context: Path) -> list[str]:
    f = context / ".dockerignore"
    if not f.is_file():
        return []
    return [x.strip().rstrip("/") for x in f.read_text().splitlines() if x.strip() and not x.startswith("#")]


def test_compose_build_contexts_dockerfiles_and_mounts_exist() -> None:
    data = _compose()
    named = set(data.get("volumes") or {})
    dockerfiles = set()
    for name, svc in data["services"].items():
        build = svc.get("build")
        if build is not None:
            ctx = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert ctx.is_dir(), f"{name}: build context {ctx} is missing"
            df = ctx / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile")
            assert df.is_file(), f"{name}: {df} is missing"
            dockerfiles.add((ctx, df))
        for v in svc.get("volumes", []):
            src = v.split(":")[0] if isinstance(v, str) else v["source"]
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"{name}: mounted {src} does not exist"
            else:
                assert src in named, f"{name}: volume {src} is not declared"
    assert {df.name for _, df in dockerfiles} == {"Dockerfile.gateway", "Dockerfile.worker"}
    for ctx, df in dockerfiles:
        ignored = _dockerignored(ctx)
        for ins, args in _dockerfile_instructions(df):
            if ins != "COPY":
                continue
            *srcs, _dest = [a for a in args.split() if not a.startswith("--")]
            for src in srcs:
                assert (ctx / src).exists(), f"{df.name}: COPY {src} is not in the build context"
                assert src.rstrip("/") not in ignored, f"{df.name}: COPY {src}, but .dockerignore drops it"
    # what the containers are told to run from the image's tree is in that tree
    ignored = _dockerignored(ROOT)
    for name, svc in data["services"].items():
        for word in svc.get("command") or []:
            for path in re.findall(r"/app/(\S+)", str(word)):
                mounted = any(isinstance(v, str) and v.split(":")[1] == f"/app/{path}" for v in svc.get("volumes", []))
                assert mounted or (ROOT / path).exists(), f"{name}: /app/{path} is neither mounted nor in the image"
                assert mounted or not any(path.startswith(i) for i in ignored), f"{name}: /app/{path} is ignored"


def test_gateway_image_has_no_torch_and_worker_image_pins_the_cpu_build() -> None:
    gateway = _dockerfile_instructions(ROOT / "deploy" / "Dockerfile.gateway")
    runs = " ".join(a for i, a in gateway if i == "RUN")
    assert "pip install -e ." in runs and "torch" not in runs and "[worker]" not in runs and "[" not in runs
    worker = _dockerfile_instructions(ROOT / "deploy" / "Dockerfile.worker")
    worker_runs = [a for i, a in worker if i == "RUN"]
    torch_pin = next(a for a in worker_runs if "torch==" in a)
    # the torch index is a build argument (a CUDA image: another index), the CPU build by default
    args = dict(a.split("=", 1) for i, a in worker if i == "ARG" and "=" in a)
    index = re.search(r"--index-url\s+\"?\$\{?(\w+)\}?\"?", torch_pin)
    assert index is not None, torch_pin
    assert args.get(index.group(1)) == "https://download.pytorch.org/whl/cpu", args
    names = [i for i, _ in worker]  # declared inside the stage (after FROM), before the torch step
    assert names.index("FROM") < names.index("ARG") < worker.index(("RUN", torch_pin))
    version = re.search(r"torch==([\w.]+)", torch_pin)
    assert version is not None
    # the extra the next step installs pins the same torch, so nothing else is fetched for it
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch=={version.group(1)}"' in pyproject, "deploy/Dockerfile.worker and the `worker` extra disagree"
    assert any("pip install -e '.[worker]'" in a for a in worker_runs)
    assert worker_runs.index(torch_pin) < next(i for i, a in enumerate(worker_runs) if "[worker]" in a)


def _gateway_services(data: dict[str, Any]) -> dict[str, Path]:
    """Gateway service -> the repository file mounted as its --config."""
    out = {}
    for name, svc in data["services"].items():
        cmd = svc.get("command") or []
        if cmd[:2] == ["kvroute", "serve"]:
            target = _flag(cmd, "--config")
            src = next(v.split(":")[0] for v in svc["volumes"] if v.split(":")[1] == target)
            out[name] = ROOT / src
    return out


def test_compose_gateway_configs_name_the_worker_services_and_their_ports() -> None:
    from router.config import load_config

    data = _compose()
    services = data["services"]
    gateways = _gateway_services(data)
    assert set(gateways) == {"gateway", "gateway-sim"}
    for gname, path in gateways.items():
        cfg = load_config(path, environ={})
        assert cfg.listen.host == "0.0.0.0" and cfg.admin_token is None
        published = services[gname]["ports"]
        assert published == [f"127.0.0.1:{8000 if gname == 'gateway' else 8001}:{cfg.listen.port}"]
        assert cfg.workers, gname
        for w in cfg.workers:
            u = urllib.parse.urlsplit(w.url)
            assert u.hostname in services, f"{gname}: worker {w.id} at {w.url} is not a compose service"
            svc = services[u.hostname]
            cmd = [str(x) for x in svc["command"]]
            assert _flag(cmd, "--host") == "0.0.0.0", f"{u.hostname} must listen beyond its loopback"
            assert w.events is not None, f"{gname}: {w.id} needs its event endpoints by name (/info says 0.0.0.0)"
            ev = urllib.parse.urlsplit(w.events.endpoint.replace("tcp://", "http://"))
            rp = urllib.parse.urlsplit((w.events.replay_endpoint or "").replace("tcp://", "http://"))
            assert ev.hostname == rp.hostname == u.hostname
            if "engine" in cmd:
                assert _flag(cmd, "--worker-id") == w.id
                assert int(_flag(cmd, "--port") or 0) == u.port
                assert int(_flag(cmd, "--events-port") or 0) == ev.port and rp.port == ev.port + 1
                assert _flag(cmd, "--remote-url") == "redis://valkey:6379/0" and "valkey" in services
                assert _flag(cmd, "--model") == "default" and cfg.models[0].id == "kvroute/tiny-llama"
            else:
                assert "sim-cluster" in cmd
                i = int(w.id.removeprefix("sim"))
                assert int(_flag(cmd, "--base-port") or 0) + i == u.port
                base = int(_flag(cmd, "--events-base-port") or 0)
                assert (ev.port, rp.port) == (base + 2 * i, base + 2 * i + 1)
                assert int(_flag(cmd, "--workers") or 0) == len(cfg.workers)
                assert cfg.models[0].profile is not None and (_flag(cmd, "--profile") or "?") in cfg.models[0].profile
    # Prometheus scrapes every gateway and worker port the compose file opens
    prom = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    want = {"gateway:8000", "gateway-sim:8000", "worker-0:9000", "worker-1:9000", "sim-workers:9000",
            "sim-workers:9001"}
    assert targets == want, targets ^ want


def test_prometheus_config_passes_promtool() -> None:
    promtool = _tool("promtool")
    r = subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_provisioning_names_the_dashboards_datasource_and_folder() -> None:
    ds = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yaml").read_text())["datasources"]
    uids = {d["uid"] for d in ds}
    assert [d["url"] for d in ds] == ["http://prometheus:9090"]
    provider = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "kvroute.yaml").read_text())["providers"][0]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in _compose()["services"]["grafana"]["volumes"]}
    assert mounts[provider["options"]["path"]] == "./configs/grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./configs/grafana/provisioning"
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 7 and all(p.get("targets") for p in panels)
    for p in panels:
        assert p["datasource"]["uid"] in uids
        assert all(t["datasource"]["uid"] in uids and t["expr"].strip() for t in p["targets"])
    titles = " | ".join(p["title"] for p in panels).lower()
    for topic in ("ttft", "prediction error", "hit rate per tier", "prefetch", "shed", "retries", "queues",
                  "index size", "ingest lag"):
        assert topic in titles, f"no panel about {topic!r}"


def _defined_metric_names() -> set[str]:
    """Metric names the gateway and workers define: string literals `kvroute_...`, plus the
    worker collector's `kvroute_worker_{name}` families (workers/metrics.py)."""
    names: set[str] = set()
    for pkg in ("router", "workers"):
        for f in (ROOT / pkg).rglob("*.py"):
            names.update(re.findall(r"[\"'](kvroute_[a-z0-9_]+)[\"']", f.read_text()))
    collector = (ROOT / "workers" / "metrics.py").read_text()
    names.update("kvroute_worker_" + n for n in re.findall(r"[\"']([a-z_]+)[\"']", collector))
    return names


def test_dashboard_reads_only_metrics_the_code_defines() -> None:
    defined = _defined_metric_names()
    used = set()
    for _title, _legend, expr in _dashboard_queries():
        _expand(expr)
        used.update(re.findall(r"\bkvroute_[a-z0-9_]+", expr))
    assert used
    for name in sorted(used):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert base in defined, f"the dashboard reads {name}, which no code defines"


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


# ------------------------------------------------------------------------------ Prometheus + dashboard

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIM_PROFILE = "h200-llama3.1-8b"


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_until(pred: Any, timeout: float, what: str, proc: subprocess.Popen[Any] | None = None,
                log: Path | None = None) -> None:
    deadline = time.monotonic() + patience(timeout)
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"{what} not reached in {timeout:.0f}s\n{tail}")


class _Procs:
    """Child processes started by the test, stopped with SIGTERM in reverse order, each given a
    second to exit before the next is signalled (a gateway is gone, its connections to the workers
    closed, before they stop), then all of them up to 10 s more before SIGKILL."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, cmd: list[str], log: Path, **kw: Any) -> subprocess.Popen[Any]:
        f = open(log, "w")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, **kw)
        f.close()
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(1)
        deadline = time.monotonic() + 10
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture
def procs() -> Iterator[_Procs]:
    ps = _Procs()
    try:
        yield ps
    finally:
        ps.stop()


def _ready_lines(log: Path, proc: subprocess.Popen[Any], timeout: float = 60.0) -> list[str]:
    _wait_until(lambda: "ready\n" in log.read_text() or "ready url=" in log.read_text(), timeout,
                f"{proc.args!r} ready", proc, log)
    return log.read_text().splitlines()


def _small_gpu_profile(tmp: Path) -> Path:
    """The 8B H200 profile with room for ~95 GPU blocks: a few long prompts push older ones to CPU."""
    d = yaml.safe_load((ROOT / "configs" / "profiles" / f"{SIM_PROFILE}.yaml").read_text())
    d["memory"] = {"device_bytes": 1.0e9, "memory_utilization": 1.0, "weights_bytes": 0.8e9, "reserved_bytes": 0.0}
    p = tmp / "small-gpu.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _prometheus_config(gateway: str, workers: dict[str, str]) -> dict[str, Any]:
    """The shipped scrape config with the compose targets replaced by the test's processes."""
    prom: dict[str, Any] = yaml.safe_load(PROMETHEUS_YML.read_text())
    prom["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    jobs["kvroute-gateway"]["static_configs"] = [{"targets": [gateway]}]
    jobs["kvroute-workers"]["static_configs"] = [{"targets": [addr], "labels": {"worker": wid}}
                                                 for wid, addr in workers.items()]
    prom["scrape_configs"] = [jobs["kvroute-gateway"], jobs["kvroute-workers"]]
    return prom


def _ids(seed: int, n: int) -> list[int]:
    """`n` token ids of the tiny tokenizer's vocabulary (8192), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(1, 8192) for _ in range(n)]


async def _traffic(url: str, worker_urls: list[str], phase: str) -> dict[str, int]:
    """Requests through the gateway (and straight to the workers, to push blocks to CPU)."""
    import aiohttp

    statuses: dict[str, int] = {}

    async def complete(s: aiohttp.ClientSession, prompt: list[int], max_tokens: int = 4, stream: bool = False,
                       base: str | None = None) -> None:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        async with s.post((base or url) + "/v1/completions", json=body) as r:
            text = await r.read()
            assert r.status in (200, 429), (r.status, text[:300])
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1

    salt = 1000 * len(phase) + int(time.time() * 1000) % 100_000  # fresh prompts every phase
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        if phase == "warm":
            await complete(s, _ids(salt, 16 * 4))
            return statuses
        # a long shared prefix, asked again and again with different tails: GPU hits on its holder
        prefix = _ids(1, 16 * 60)
        for k in range(6):
            await complete(s, prefix + _ids(salt + k, 8))
        # fresh prompts: the cost model prices the idle 429-answering worker low -> retries
        for k in range(6):
            await complete(s, _ids(salt + 100 + k, 16 * 6))
        # push the prefix out of every worker's GPU (straight to the workers), then ask for it again:
        # matched on CPU, prefetched toward GPU while the request waits
        for k, base in enumerate(worker_urls):
            for j in range(3):
                await complete(s, _ids(salt + 200 + 3 * k + j, 16 * 60), max_tokens=1, base=base)
        await _until_indexed_on_cpu(s, url, prefix)
        for k in range(3):
            await complete(s, prefix + _ids(salt + 300 + k, 8))
        # a burst beyond every worker's in-flight cap: shed with 429
        await asyncio.gather(*(complete(s, _ids(salt + 400 + k, 48), max_tokens=48, stream=True) for k in range(24)))
    return statuses


async def _until_indexed_on_cpu(s: Any, url: str, prefix: list[int], timeout: float = 15.0) -> None:
    """Until the gateway's index places `prefix` on some worker's CPU tier (the offload events of
    the requests just sent straight to the workers have been ingested): /admin/route/explain."""
    body = {"model": MODEL, "prompt": prefix, "max_tokens": 1}
    deadline = time.monotonic() + timeout
    while True:
        async with s.post(url + "/admin/route/explain", json=body) as r:
            assert r.status == 200, await r.text()
            matches = (await r.json())["matches"]
        if any(tier == "CPU" for m in matches.values() for tier, _n in m["runs"]):
            return
        assert time.monotonic() < deadline, f"the prefix never showed on a CPU tier in the index: {matches}"
        await asyncio.sleep(0.05)


def _wait_scrapes(prom: str, n: int, proc: subprocess.Popen[Any], log: Path) -> None:
    """Until Prometheus has scraped every target `n` more times (the timestamps of its `up` samples)."""
    for _ in range(n):
        mark = time.time()

        def scraped(mark: float = mark) -> bool:
            qs = urllib.parse.urlencode({"query": "min(timestamp(up))"})
            result = json.loads(_get(f"{prom}/api/v1/query?{qs}")[1])["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) > mark

        _wait_until(scraped, 15, "a scrape of every target", proc, log)


def _prom_query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    qs = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"})
    status, body = _get(f"{prom}/api/v1/query_range?{qs}", timeout=30)
    data = json.loads(body)
    assert status == 200 and data["status"] == "success", f"{expr}: {body[:500]!r}"
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


def _peak(series: dict[str, Any]) -> float:
    vals = [float(v) for _, v in series["values"]]
    return max((v for v in vals if math.isfinite(v)), default=0.0)


# (panel, legend) -> the series (label values joined by ",") the test's traffic makes non-zero
NONZERO = {
    ("TTFT (gateway)", "p50"): "",
    ("TTFT prediction error", "p95 |error|"): "",
    ("Hit rate per tier (workers)", "{{tier}}"): "GPU",
    ("Hit rate per tier (gateway index)", "index {{tier}}"): "GPU",
    ("Prefetches", "sent"): "",
    ("Shed by reason", "{{reason}}"): "worker_caps",
    ("Retries and upstream errors", "retry {{reason}}"): "before_first_byte",
    ("Index size", "blocks {{model}}"): MODEL,
    ("KV events ingested", "events {{worker}}"): "w0",
}


def _summary(result: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """Finite points in all, and `labels: last value (max)` per series."""
    finite = 0
    lines = []
    for series in result:
        vals = [float(v) for _, v in series["values"]]
        ok = [v for v in vals if math.isfinite(v)]
        finite += len(ok)
        labels = ",".join(f"{k}={v}" for k, v in sorted(series["metric"].items())) or "{}"
        last = f"{ok[-1]:.4g}" if ok else "NaN"
        peak = f"{max(ok):.4g}" if ok else "NaN"
        lines.append(f"{labels}: last {last}, max {peak}")
    return finite, lines


@pytest.mark.slow
def test_prometheus_scrapes_the_stack_and_every_dashboard_query_returns_data(tmp_path: Path,
                                                                              procs: _Procs) -> None:
    from kvindex.keys import Namespace
    from loadtest.ports import free_port
    from router.config import build_config

    prometheus = _tool("prometheus")
    profile = _small_gpu_profile(tmp_path)
    py = sys.executable

    # the simulated fleet (2 workers) and a worker whose every completion is a 429
    sim_log = tmp_path / "sim.log"
    sim = procs.start([py, "-m", "workers.cli", "sim-cluster", "--workers", "2", "--profile", str(profile),
                       "--base-port", "0", "--host", "127.0.0.1",
                       "--tokenizer", str(ROOT / "configs" / "assets" / "tiny-tokenizer")], sim_log)
    lines = _ready_lines(sim_log, sim)
    workers = {}
    for line in lines:
        words = line.split()
        if words and words[0] == "worker":
            workers[words[1]] = next(w[4:] for w in words if w.startswith("url="))
    assert len(workers) == 2, lines
    model = {"id": MODEL, "served_names": ["llama-3.1-8b"], "tokenizer": str(ROOT / "configs/assets/tiny-tokenizer"),
             "profile": str(profile)}
    m = build_config({"models": [model]}, ROOT, environ={}).models[0]
    ns = m.namespace
    digest = Namespace(m.id, ns.revision, ns.tokenizer_revision, ns.kv_dtype, ns.parallel, ns.block_size).digest
    faulty_log = tmp_path / "faulty.log"
    faulty = procs.start([py, "-m", "loadtest.harden.faulty", "--mode", "s429", "--digest", digest.hex(),
                          "--model", MODEL, "--served", "llama-3.1-8b", "--worker-id", "busy"], faulty_log)
    faulty_url = _ready_lines(faulty_log, faulty, 30)[0].split("url=")[1].strip()

    # the gateway, as `kvroute serve` runs it
    port = free_port()
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [model],
        "workers": [{"id": wid, "url": u} for wid, u in workers.items()] + [{"id": "busy", "url": faulty_url}],
        "routing": {"policy": "kv_cost", "retries": 1},
        "limits": {"worker_max_inflight": 3},
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.2},
        "shutdown": {"grace_s": 0, "drain_timeout_s": 5},
    }
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(cfg))
    gw_log = tmp_path / "gateway.log"
    gw = procs.start([py, "-m", "kvroute.cli", "serve", "--config", str(tmp_path / "gateway.yaml")], gw_log,
                     env={**{k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}})
    url = f"http://127.0.0.1:{port}"
    _wait_until(lambda: _get(url + "/ready", 1)[0] == 200, 60, "gateway /ready", gw, gw_log)

    # Prometheus on the shipped scrape config
    prom_port = free_port()
    prom_cfg = _prometheus_config(f"127.0.0.1:{port}", {wid: u.removeprefix("http://") for wid, u in workers.items()})
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
    prom_log = tmp_path / "prometheus.log"
    prom_proc = procs.start([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            prom_log)
    prom = f"http://127.0.0.1:{prom_port}"
    _wait_until(lambda: _get(prom + "/-/ready", 1)[0] == 200, 60, "prometheus /-/ready", prom_proc, prom_log)

    def targets_up() -> bool:
        active = json.loads(_get(prom + "/api/v1/targets")[1])["data"]["activeTargets"]
        return len(active) == 3 and all(t["health"] == "up" for t in active)

    _wait_until(targets_up, 30, "every target up", prom_proc, prom_log)
    start = time.time()
    worker_urls = list(workers.values())
    asyncio.run(_traffic(url, worker_urls, "warm"))
    _wait_scrapes(prom, 2, prom_proc, prom_log)  # the series exist in two scrapes before the traffic counts
    statuses = asyncio.run(_traffic(url, worker_urls, "main"))
    _wait_scrapes(prom, 1, prom_proc, prom_log)
    statuses2 = asyncio.run(_traffic(url, worker_urls, "main"))  # twice: counters born in the first rise again
    _wait_scrapes(prom, 2, prom_proc, prom_log)
    end = time.time()
    print(f"\ntraffic answered: {statuses} then {statuses2}")
    assert statuses.get("200") and statuses.get("429"), statuses

    missing, peaks = [], {}
    print(f"\n{len(_dashboard_queries())} dashboard queries over [{end - start:.0f} s], step 1 s, "
          f"{', '.join(f'{k} = {v}' for k, v in GRAFANA_VARS.items())}:")
    for title, legend, expr in _dashboard_queries():
        result = _prom_query_range(prom, _expand(expr), start, end)
        finite, lines = _summary(result)
        print(f"\n[{title}] {legend}\n  {expr}")
        for line in lines or ["(no series)"]:
            print(f"    {line}")
        if not finite:
            missing.append(f"{title} / {legend}: {expr}")
        peaks[(title, legend)] = {",".join(f"{v}" for _, v in sorted(r["metric"].items())): _peak(r) for r in result}
    assert not missing, "queries without data:\n" + "\n".join(missing)
    # counters are counters: what the dashboard rates is a counter (or a histogram's buckets), the
    # rest are gauges, as the scraped `# TYPE` lines say (Prometheus' metadata API)
    metadata = json.loads(_get(f"{prom}/api/v1/metadata")[1])["data"]
    for _title, _legend, expr in _dashboard_queries():
        rated = set(re.findall(r"rate\((kvroute_[a-z0-9_]+)", expr))
        for name in set(re.findall(r"\bkvroute_[a-z0-9_]+", expr)):
            family = re.sub(r"_(total|bucket)$", "", name)
            meta = metadata.get(name) or metadata.get(family)
            assert meta, f"{name}: no metadata in Prometheus"
            kind = meta[0]["type"]
            if name in rated:
                want = "histogram" if name.endswith("_bucket") else "counter"
                assert kind == want and (name.endswith(("_total", "_bucket"))), f"rate({name}): a {kind}"
            else:
                assert kind == "gauge", f"{name} is read as a gauge, but it is a {kind}"
    # and what this traffic must have made non-zero
    for key, series in NONZERO.items():
        assert peaks[key].get(series, 0) > 0, f"{key} {series!r}: {peaks[key]}"


# ------------------------------------------------------------------------------ the compose stack's own commands


def _free_pair(taken: set[int] | None = None) -> int:
    """A port P with P and P + 1 free a moment ago (an engine's --events-port and its replay port),
    neither in `taken` (ports already handed to another process of the test), which gets both."""
    import socket

    from loadtest.ports import free_port

    taken = set() if taken is None else taken
    for _ in range(100):
        p = free_port()
        if {p, p + 1} & taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        taken.update((p, p + 1))
        return p
    raise AssertionError("no two consecutive free ports")


def _local(command: list[str], tmp: Path, redis_port: int, taken: set[int]) -> tuple[list[str], int, int]:
    """A compose worker's command for the local machine: loopback, free ports (none in `taken`), the
    test's folders (the weights' cache shared) and Redis."""
    from loadtest.ports import free_port

    port = free_port()
    while port in taken:
        port = free_port()
    taken.add(port)
    events = _free_pair(taken)
    subs = {"--host": "127.0.0.1", "--port": str(port), "--events-port": str(events), "--threads": "1",
            "--cache-dir": str(tmp.parent / "cache"), "--disk-dir": str(tmp / "disk"),
            "--remote-url": f"redis://127.0.0.1:{redis_port}/0"}
    out = []
    for word in command:
        name = word.split("=", 1)[0]
        out.append(f"{name}={subs[name]}" if name in subs and "=" in word else word)
    assert out[0] == "python"
    return [sys.executable, *out[1:]], port, events


@pytest.mark.slow
def test_compose_worker_commands_and_gateway_config_serve_together(tmp_path: Path, procs: _Procs) -> None:
    """docker-compose.yml's two engine commands and configs/compose/gateway.yaml, run here: the
    gateway accepts both workers (same namespace digest as the tiny Llama's), serves through them,
    and a repeated prompt is served from cache."""
    import openai

    from loadtest.ports import free_port
    from workers.engine.testing import RedisServer

    if importlib.util.find_spec("torch") is None:  # found, not imported: the workers import it
        pytest.skip("the worker extra (torch) is not installed")
    if shutil.which("redis-server") is None:
        _skip_loudly("`redis-server` is not installed (the workers' REMOTE tier)")
    redis = RedisServer(tmp_path / "redis").start()
    try:
        services = _compose()["services"]
        cfg = yaml.safe_load((ROOT / "configs" / "compose" / "gateway.yaml").read_text())
        base = ROOT / "configs" / "compose"
        for m in cfg["models"]:  # the file's relative paths, from the tmp copy
            m["tokenizer"] = str((base / m["tokenizer"]).resolve())
            m["profile"] = str((base / m["profile"]).resolve())
        started, taken = [], {redis.port}
        # The fleet secret, as docs/deploy.md asks the operator to set it: without one the
        # workers run their REMOTE tier OFF (its blocks carry a MAC keyed with it).
        worker_env = {**os.environ, "KVROUTE_PEER_TOKEN": secrets.token_hex(16)}
        for w in cfg["workers"]:
            cmd, port, events = _local([str(x) for x in services[w["id"]]["command"]], tmp_path / w["id"], redis.port,
                                       taken)
            log = tmp_path / f"{w['id']}.log"
            if started:  # the first one generates the weights (~10 s of CPU) into the shared cache
                _wait_until(lambda: any((tmp_path / "cache").glob("tiny-llama-*")), 120, "the tiny Llama's weights",
                            *started[0][::-1])
            started.append((log, procs.start(cmd, log, env=worker_env)))
            w["url"] = f"http://127.0.0.1:{port}"
            w["events"] = {"endpoint": f"tcp://127.0.0.1:{events}", "replay_endpoint": f"tcp://127.0.0.1:{events + 1}"}
        for log, proc in started:
            _ready_lines(log, proc, 180)
        port = free_port()
        cfg["listen"] = {"host": "127.0.0.1", "port": port}
        cfg["shutdown"] = {"grace_s": 0, "drain_timeout_s": 5}
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(cfg))
        gw_log = tmp_path / "gateway.log"
        gw = procs.start([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(tmp_path / "gateway.yaml")],
                         gw_log, env={k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")})
        url = f"http://127.0.0.1:{port}"
        _wait_until(lambda: _get(url + "/ready", 1)[0] == 200, 120, "gateway /ready", gw, gw_log)
        states: dict[str, str] = {}

        def both_healthy() -> bool:  # /ready needs one healthy worker per model; the other may follow
            states.update((w["id"], w["state"]) for w in json.loads(_get(url + "/admin/workers")[1])["workers"])
            return set(states.values()) == {"healthy"}

        _wait_until(both_healthy, 30, "both workers healthy", gw, gw_log)
        assert set(states) == {"worker-0", "worker-1"}, states
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for w in cfg["workers"]:  # each engine's first forward pass is slow: not in the gateway's calibration
            direct = openai.OpenAI(base_url=w["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
            direct.completions.create(model="tiny", prompt=w["id"] * 40, max_tokens=2)
        msgs: list[Any] = [{"role": "system", "content": "You answer in one word. " * 40},
                           {"role": "user", "content": "Hi"}]
        first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
        assert first.usage is not None and first.usage.prompt_tokens > 128
        explain = urllib.request.Request(url + "/admin/route/explain", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "tiny", "messages": msgs, "max_tokens": 4}).encode())
        holders: set[str] = set()

        def indexed() -> bool:  # the last request's KV events (from the endpoints the config names) and its end
            with urllib.request.urlopen(explain, timeout=5) as r:
                d = json.loads(r.read())
            holders.clear()
            holders.update(wid for wid, m in d["matches"].items() if m["blocks"] >= 8)
            return bool(holders) and all(w["load"] == 0 for w in d["workers"])

        # The repeat is served from cache. Where it goes is the policy's choice (the gateway's calibration
        # may price the holder higher, on a busy machine): a second repeat finds both workers holding it.
        cached = []
        for _ in range(2):
            _wait_until(indexed, 10, "the prompt's blocks in the gateway's index, both workers idle", gw, gw_log)
            again = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
            assert again.usage is not None and again.usage.prompt_tokens_details is not None
            cached.append(again.usage.prompt_tokens_details.cached_tokens or 0)
            if cached[-1] >= 128:
                break
        assert cached[-1] >= 128, (cached, holders)
        metrics = _get(url + "/metrics")[1].decode()
        assert "kvroute_worker_refused_total{" not in metrics
        worker_metrics = _get(cfg["workers"][0]["url"] + "/metrics")[1].decode()
        for tier in ("CPU", "DISK", "REMOTE"):  # the tiers the compose command asks for
            assert f'kvroute_worker_blocks_used{{tier="{tier}"}}' in worker_metrics, tier
    finally:
        redis.stop()
