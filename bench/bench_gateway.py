"""Gateway overhead: added latency, req/s and CPU per routed request, vs calling the worker directly.

Same run, same simulated worker (`python -m workers.cli sim-cluster`, one H200 Llama-3.1-8B
worker), same requests: every request goes once straight to the worker and once through
the gateway (`kvroute serve`, its own process), interleaved so drift hits both alike.
Prompts are fresh random token ids (no prefix-cache hits on either path, so both do the
same work on the worker); the gateway additionally tokenizes nothing (ids in), keys,
looks up, scores every worker, proxies the SSE stream and re-encodes each chunk.

Printed:
- sequential TTFT and E2E, direct vs gateway: median / p99 and the added median;
- closed-loop throughput at a fixed concurrency, direct vs gateway (req/s);
- the gateway process's CPU time per routed request (µs), from /proc (user + system),
  for completions with token ids and for chat (tokenization included), sequential and
  under concurrency; plus a trivial endpoint back to back vs with idle gaps, which shows
  what waking an idle process costs on the host (it dominates the sequential figure:
  a routed request wakes the gateway ~8 times — request, upstream headers, each chunk).
Decision time alone is bench/bench_decision.py (the planner's).

    .venv/bin/python bench/bench_gateway.py [--requests 300] [--concurrency 16] [--seconds 8]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.ports import free_port  # noqa: E402

PROFILE = "h200-llama3.1-8b"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_worker() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", "1", "--profile", PROFILE,
                             "--base-port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    assert proc.stdout is not None
    for line in proc.stdout:
        w = line.split()
        if w and w[0] == "worker":
            url = next(x[4:] for x in w if x.startswith("url="))
        if w == ["ready"]:
            break
    if url is None:
        raise SystemExit("sim worker did not start")
    return proc, url


def _start_gateway(worker_url: str, tmp: Path) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"id": MODEL, "tokenizer": str(ROOT / "configs/assets/tiny-tokenizer"), "profile": PROFILE}],
        "workers": [{"id": "w0", "url": worker_url}],
        "observability": {"log_level": "WARNING"},
    }
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


async def _wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"{url} not ready")


async def _one(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    ttft = None
    async with s.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - t0
    return (ttft or 0.0), time.perf_counter() - t0


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 8000) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main_async(a: argparse.Namespace, gw_pid: int, gw_url: str, w_url: str) -> None:
    rng = random.Random(0)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        def body(p: list[int]) -> dict:
            return {"model": MODEL, "prompt": p, "max_tokens": a.max_tokens, "stream": True}

        for _ in range(30):  # warm both paths
            await _one(s, w_url + "/v1/completions", body(_prompt(rng, a.prompt_tokens)))
            await _one(s, gw_url + "/v1/completions", body(_prompt(rng, a.prompt_tokens)))
        # the gateway's background work (load polls, health checks) costs CPU with no
        # request at all: measured first, subtracted from the per-request figures
        c0, t0 = _cpu_s(gw_pid), time.monotonic()
        await asyncio.sleep(a.idle_seconds)
        idle = (_cpu_s(gw_pid) - c0) / (time.monotonic() - t0)
        print(f"gateway idle CPU (load polls every 0.1 s, health checks): {idle * 100:.1f}% of a core "
              "(subtracted below)")

        def per_req(cpu0: float, t0: float, n: int) -> float:
            return ((_cpu_s(gw_pid) - cpu0) - idle * (time.monotonic() - t0)) / max(1, n)

        res: dict[str, list[tuple[float, float]]] = {"direct": [], "gateway": []}
        cpu0, tc = _cpu_s(gw_pid), time.monotonic()
        for i in range(a.requests):
            p1, p2 = _prompt(rng, a.prompt_tokens), _prompt(rng, a.prompt_tokens)
            first, second = (("direct", p1), ("gateway", p2)) if i % 2 == 0 else (("gateway", p1), ("direct", p2))
            for name, p in (first, second):
                u = (w_url if name == "direct" else gw_url) + "/v1/completions"
                res[name].append(await _one(s, u, body(p)))
        cpu_seq = per_req(cpu0, tc, a.requests)
        print(f"\n== sequential, {a.requests} requests each, {a.prompt_tokens}-token id prompts, "
              f"max_tokens={a.max_tokens}")
        print(f"{'path':10s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'E2E p50':>10s} {'E2E p99':>10s}   (ms)")
        for name, xs in res.items():
            t = [x[0] * 1000 for x in xs]
            e = [x[1] * 1000 for x in xs]
            print(f"{name:10s} {statistics.median(t):10.2f} {_pct(t, .99):10.2f} "
                  f"{statistics.median(e):10.2f} {_pct(e, .99):10.2f}")
        dt = statistics.median(x[0] for x in res["gateway"]) - statistics.median(x[0] for x in res["direct"])
        de = statistics.median(x[1] for x in res["gateway"]) - statistics.median(x[1] for x in res["direct"])
        print(f"added by the gateway: TTFT {dt * 1000:+.2f} ms, E2E {de * 1000:+.2f} ms (medians)")
        print(f"gateway CPU per routed request (sequential, token ids, SSE relay of {a.max_tokens} tokens): "
              f"{cpu_seq * 1e6:.0f} µs")

        # chat: tokenization + template on the gateway (the worker sees token ids either way)
        cpu0, tc = _cpu_s(gw_pid), time.monotonic()
        words = "route the request to the worker that holds the prefix blocks".split()
        for _ in range(a.requests):
            msgs = [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": " ".join(rng.choice(words) for _ in range(a.prompt_tokens // 2))}]
            await _one(s, gw_url + "/v1/chat/completions",
                       {"model": MODEL, "messages": msgs, "max_tokens": a.max_tokens, "stream": True})
        cpu_chat = per_req(cpu0, tc, a.requests)
        print(f"gateway CPU per routed request (sequential, chat, tokenized here): {cpu_chat * 1e6:.0f} µs")

        # How much of the sequential figure is the host waking an idle process: the
        # same trivial endpoint back to back, then with idle gaps between requests.
        for label, gap in (("back to back", 0.0), ("with 20 ms idle gaps", 0.02)):
            cpu0, tc = _cpu_s(gw_pid), time.monotonic()
            for _ in range(200):
                async with s.get(gw_url + "/health") as r:
                    await r.read()
                if gap:
                    await asyncio.sleep(gap)
            print(f"  baseline: GET /health {label}: {per_req(cpu0, tc, 200) * 1e6:.0f} µs CPU per request")

        print(f"\n== closed loop, concurrency {a.concurrency}, {a.seconds:.0f} s per path")
        for name, base in (("direct", w_url), ("gateway", gw_url)):
            done = 0
            stop = time.monotonic() + a.seconds
            cpu0, tc = _cpu_s(gw_pid), time.monotonic()

            async def loop(base: str, stop: float) -> None:
                nonlocal done
                while time.monotonic() < stop:
                    await _one(s, base + "/v1/completions", body(_prompt(rng, a.prompt_tokens)))
                    done += 1

            t0 = time.monotonic()
            await asyncio.gather(*(loop(base, stop) for _ in range(a.concurrency)))
            el = time.monotonic() - t0
            extra = ""
            if name == "gateway":
                extra = f", gateway CPU {per_req(cpu0, tc, done) * 1e6:.0f} µs/request"
            print(f"{name:10s} {done / el:8.1f} req/s{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    a = ap.parse_args()
    wproc, w_url = _start_worker()
    with tempfile.TemporaryDirectory() as td:
        gproc, gw_url = _start_gateway(w_url, Path(td))
        try:
            asyncio.run(_wait_ready(gw_url))
            try:
                import uvloop

                uvloop.install()
            except ImportError:
                pass
            asyncio.run(main_async(a, gproc.pid, gw_url, w_url))
        finally:
            gproc.terminate()
            wproc.terminate()
            gproc.wait(10)
            wproc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
