"""docker-compose.yml validates with Debian's `docker-compose config` (profile `sim` too); every
build context, Dockerfile, file a Dockerfile copies and file the compose file mounts exists;
the gateway configs it mounts load and name the worker services on the ports their commands
open; the gateway image installs no torch, the worker image pins the CPU torch build (the index
a build argument); the engine workers' commands and the gateway config serve together here.
The compose stack's own commands (engine workers, gateway config) serve together here.

The external tools are installed by .ci/run (apt-get); where one is missing the test skips with
a warning that pytest prints in its summary.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_rig import (
    COMPOSE,
    PROMETHEUS_YML,
    ROOT,
    _compose,
    _flag,
    _free_pair,
    _get,
    _Procs,
    _ready_lines,
    _skip_loudly,
    _tool,
    _wait_until,
)

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




# ------------------------------------------------------------------------------ the compose stack's own commands


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
