"""Simulated H200 workers in a child process (`python -m workers.cli sim-cluster`) and the gateway
in-process in front of them: `start_cluster` / `stop_cluster`, the module-scoped `cluster`
fixture (three workers), `_cfg` (a config naming them), `gateway`, and small wait/text helpers."""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from hangs import patience

from router.config import Config, build_config
from router.server import running_gateway

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "h200-llama3.1-8b"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KEY_A, KEY_B = "sk-tenant-a-0001", "sk-tenant-b-0002"


def start_cluster(n: int, profile: str, extra: list[str] | None = None) -> tuple[subprocess.Popen[str], list[str]]:
    cmd = [sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", str(n), "--profile", profile,
           "--base-port", "0", *(extra or [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    urls: list[str] = []
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        words = line.split()
        if words == ["ready"]:
            return proc, urls
        if words and words[0] == "worker":
            urls += [w[4:] for w in words if w.startswith("url=")]
    proc.kill()
    raise RuntimeError(f"sim-cluster did not start: {proc.stdout.read()}")


def stop_cluster(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[str]]:
    proc, urls = start_cluster(3, PROFILE)
    try:
        yield urls
    finally:
        stop_cluster(proc)


def _cfg(urls: list[str], **over: Any) -> Config:
    data: dict[str, Any] = {
        "models": [{"id": MODEL, "served_names": ["llama-3.1-8b"], "tokenizer": "configs/assets/tiny-tokenizer",
                    "profile": PROFILE}],
        "workers": [{"id": f"s{i}", "url": u} for i, u in enumerate(urls)],
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.2},
    }
    data.update(over)
    return build_config(data, ROOT, environ={})


@asynccontextmanager
async def gateway(cfg: Config) -> AsyncIterator[tuple[Any, str]]:
    async with running_gateway(cfg, ready_timeout=10.0) as (gw, url):
        await _wait(lambda: all(w.state.value == "healthy" for w in gw.pool.workers.values()), 10.0)
        assert all(w.state.value == "healthy" for w in gw.pool.workers.values()), [
            w.reason for w in gw.pool.workers.values()
        ]
        yield gw, url


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = "alpha beta gamma delta kv cache route block prefix token worker queue tier load".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


async def _wait(pred: Any, timeout: float = 3.0) -> bool:
    t = time.monotonic() + patience(timeout)
    while time.monotonic() < t:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return bool(pred())
