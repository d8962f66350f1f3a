"""Benchmark: HTTP-mode CPU cost per request of a simulated fleet under a Mooncake replay.

Starts `python -m workers.cli sim-cluster` (default 16 x h200-llama3.1-8b) as a child
process, replays a slice of the Mooncake trace (`--trace FILE`, default
$LOADTEST_TRACES/mooncake_conversation_first_half.jsonl)
against it open-loop at the trace's timestamps (times `--speed`): streaming
/v1/completions with token-id prompts (each 512-token trace block becomes a fixed
pseudo-random token block, so prefix sharing is exact), `max_tokens` = output length,
`stream_options.include_usage`. Requests go to the worker owning their first two trace
blocks (affinity, so caches hit as they would behind a cache-aware router).

Prints: cluster process CPU seconds / requests (the number asked for), CPU per
generated token, the cluster's CPU utilisation (cpu_s / wall_s, in cores), the
client's own CPU, and TTFT p50/p99 as the client saw it vs as the workers reported it
(usage.kv.ttft_ms) — the gap is the HTTP + event-loop overhead on simulated time.

    .venv/bin/python bench/bench_sim_http.py [--workers 16] [--limit 600] [--speed 4]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.trace import TraceError  # noqa: E402
from loadtest.tracefiles import resolve_trace  # noqa: E402


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tck  # utime + stime


def block_tokens(hid: int, memo: dict[int, list[int]]) -> list[int]:
    b = memo.get(hid)
    if b is None:
        b = np.random.default_rng(hid).integers(0, 128000, 512).tolist()
        memo[hid] = b
    return b


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else xs[0]


async def replay(urls: list[str], rows: list[dict], speed: float) -> dict:
    memo: dict[int, list[int]] = {}
    bodies = []
    for r in rows:
        toks: list[int] = []
        for h in r["hash_ids"]:
            toks.extend(block_tokens(h, memo))
        bodies.append(json.dumps({"prompt": toks[: r["input_length"]], "max_tokens": max(1, r["output_length"]),
                                  "stream": True, "stream_options": {"include_usage": True}}).encode())
    client_ttft: list[float] = []
    server_ttft: list[float] = []
    gaps: list[float] = []
    tokens = [0]
    errors: list[str] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one(i: int, r: dict) -> None:
            key = hashlib.blake2b(repr(r["hash_ids"][:2]).encode(), digest_size=8).digest()
            url = urls[int.from_bytes(key, "little") % len(urls)] + "/v1/completions"
            t0 = time.perf_counter()
            first = None
            srv = None
            try:
                async with http.post(url, data=bodies[i], headers={"content-type": "application/json"}) as resp:
                    if resp.status != 200:
                        errors.append(f"{resp.status} {await resp.text()}")
                        return
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        if first is None:
                            first = time.perf_counter() - t0
                        if b'"usage"' in line:
                            u = json.loads(line[6:])["usage"]
                            srv = u["kv"]["ttft_ms"] / 1000
                            server_ttft.append(srv)
                            tokens[0] += u["completion_tokens"]
            except (TimeoutError, aiohttp.ClientError) as e:
                errors.append(repr(e))
                return
            if first is not None:
                client_ttft.append(first)
                if srv is not None:
                    gaps.append(first - srv)

        start = time.perf_counter()
        tasks = []
        for i, r in enumerate(rows):
            at = r["timestamp"] / 1000.0 / speed
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i, r)))
        await asyncio.gather(*tasks)
    return {"client_ttft": client_ttft, "server_ttft": server_ttft, "gaps": gaps, "tokens": tokens[0], "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--profile", default="h200-llama3.1-8b")
    ap.add_argument("--limit", type=int, default=600)
    ap.add_argument("--speed", type=float, default=4.0)
    ap.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL (default: $LOADTEST_TRACES/...)")
    args = ap.parse_args()
    try:
        trace = resolve_trace(args.trace)
    except TraceError as e:
        raise SystemExit(f"error: {e}") from None
    rows = []
    with trace.open() as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= args.limit:
                break
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", str(args.workers), "--profile",
         args.profile, "--base-port", "0", "--max-waiting", "100000"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        urls = []
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "ready":
                break
            urls.append(dict(x.split("=", 1) for x in line.split()[2:])["url"])
        idle0 = proc_cpu_s(proc.pid)
        time.sleep(2.0)
        idle_rate = (proc_cpu_s(proc.pid) - idle0) / 2.0
        cpu0 = proc_cpu_s(proc.pid)
        me0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        res = asyncio.run(replay(urls, rows, args.speed))
        wall = time.perf_counter() - t0
        cpu = proc_cpu_s(proc.pid) - cpu0
        me1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    n = len(res["client_ttft"])
    me = (me1.ru_utime - me0.ru_utime) + (me1.ru_stime - me0.ru_stime)
    span = rows[-1]["timestamp"] / 1000.0 / args.speed
    print(f"{args.workers} workers ({args.profile}), {len(rows)} Mooncake requests over {span:.0f} s "
          f"(speed x{args.speed:g}), wall {wall:.1f} s, {n} ok, {len(res['errors'])} errors")
    print(f"cluster CPU: {cpu:.2f} s = {cpu / max(n, 1) * 1000:.2f} ms per request, "
          f"{cpu / max(res['tokens'], 1) * 1e6:.1f} us per generated token ({res['tokens']:,} tokens); "
          f"utilisation {cpu / wall:.1%} of one core (idle baseline {idle_rate:.1%})")
    print(f"client CPU: {me:.2f} s ({me / max(n, 1) * 1000:.2f} ms per request)")
    print(f"TTFT client p50 {pct(res['client_ttft'], 50) * 1000:.1f} ms "
          f"p99 {pct(res['client_ttft'], 99) * 1000:.1f} ms | "
          f"worker-reported p50 {pct(res['server_ttft'], 50) * 1000:.1f} ms "
          f"p99 {pct(res['server_ttft'], 99) * 1000:.1f} ms")
    print(f"per-request gap (client TTFT - worker TTFT: body upload, parsing, keying, loop and SSE delivery): "
          f"p50 {pct(res['gaps'], 50) * 1000:.1f} ms p99 {pct(res['gaps'], 99) * 1000:.1f} ms")
    if res["errors"]:
        print("first errors:", res["errors"][:3])


if __name__ == "__main__":
    main()
