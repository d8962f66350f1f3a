"""Upstream HTTP client for the proxy path: aiohttp (in use) against httpx, in one run.

What the gateway does per request, with each client: one pooled keep-alive POST of a
token-id completion body to a worker, then the SSE stream read in network-sized
pieces to the end. The worker is a real simulated worker (`sim-cluster`, one worker, a
fast profile) in its own process, so this process's CPU is the client's. Rounds
alternate the clients; the table gives medians of CPU µs per request and of latency.

    .venv/bin/python bench/bench_upstream_client.py [--requests 2000] [--concurrency 32] [--rounds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.ports import free_port  # noqa: E402

Client = Callable[[bytes], Awaitable[int]]


def start_worker(port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", "1", "--profile", "h200-llama3.1-8b",
           "--base-port", str(port), "--max-waiting", "100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise SystemExit("the simulated worker did not start")


def aiohttp_client(url: str, conc: int) -> tuple[Client, Callable[[], Awaitable[None]]]:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc * 2), auto_decompress=False)
    headers = {"content-type": "application/json", "accept": "text/event-stream"}

    async def call(body: bytes) -> int:
        async with session.post(url, data=body, headers=headers) as r:
            n = 0
            while data := await r.content.readany():
                n += len(data)
            return n

    return call, session.close


def httpx_client(url: str, conc: int) -> tuple[Client, Callable[[], Awaitable[None]]]:
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=conc * 2, max_keepalive_connections=conc * 2),
                               timeout=60.0)
    headers = {"content-type": "application/json", "accept": "text/event-stream"}

    async def call(body: bytes) -> int:
        async with client.stream("POST", url, content=body, headers=headers) as r:
            n = 0
            async for data in r.aiter_raw():
                n += len(data)
            return n

    return call, client.aclose


async def run_round(make: Callable[[str, int], tuple[Client, Callable[[], Awaitable[None]]]], url: str,
                    requests: int, conc: int, max_tokens: int) -> tuple[float, float]:
    """(CPU µs per request of this process, median latency ms)."""
    call, close = make(url, conc)
    body = msgspec.json.encode({"prompt": list(range(1, 257)), "max_tokens": max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}, "ignore_eos": True})
    lat: list[float] = []
    sem = asyncio.Semaphore(conc)

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            assert await call(body) > 0
            lat.append(time.perf_counter() - t)

    await asyncio.gather(*(one() for _ in range(min(100, requests))))  # warm the pool
    lat.clear()
    cpu0 = time.process_time()
    await asyncio.gather(*(one() for _ in range(requests)))
    cpu = time.process_time() - cpu0
    await close()
    return cpu / requests * 1e6, statistics.median(lat) * 1e3


async def main_async(a: argparse.Namespace, url: str) -> None:
    clients = {"aiohttp": aiohttp_client, "httpx": httpx_client}
    for max_tokens in a.max_tokens:
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in clients}
        for r in range(a.rounds):
            for name in (list(clients) if r % 2 == 0 else list(reversed(clients))):
                res[name].append(await run_round(clients[name], url, a.requests, a.concurrency, max_tokens))
        print(f"\nmax_tokens {max_tokens}: {a.requests} streamed requests x {a.rounds} rounds, "
              f"concurrency {a.concurrency}")
        print(f"{'client':8} {'CPU us/req (median)':>20} {'range':>16} {'latency ms p50 (median)':>24}")
        for name, rows in res.items():
            cpus = [c for c, _ in rows]
            print(f"{name:8} {statistics.median(cpus):20.0f} {min(cpus):7.0f}-{max(cpus):<8.0f} "
                  f"{statistics.median([lt for _, lt in rows]):24.2f}")
        ratio = statistics.median(c for c, _ in res["httpx"]) / statistics.median(c for c, _ in res["aiohttp"])
        print(f"httpx / aiohttp CPU per request: {ratio:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[8, 128])
    a = ap.parse_args()
    port = free_port()
    proc = start_worker(port)
    try:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(main_async(a, f"http://127.0.0.1:{port}/v1/completions"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    os._exit(0)


if __name__ == "__main__":
    main()
