"""What the packaging tests (tests/deploy/) share: the repository's deploy files, external tools
(skipped loudly when missing), the compose file, the dashboard's queries, child processes
(`_Procs`, stopped in reverse order) and waits on them."""
from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
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


def _ids(seed: int, n: int) -> list[int]:
    """`n` token ids of the tiny tokenizer's vocabulary (8192), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(1, 8192) for _ in range(n)]
