"""Routing policies over HTTP: p50/p99 TTFT of the same shared-prefix workload, policy by policy.

For each policy: a fresh simulated fleet (`python -m workers.cli sim-cluster`, cold caches),
the gateway (`kvroute serve`, its own process) with that policy, and the same open-loop
workload replayed over HTTP (Poisson arrivals, fixed seed): `--docs` shared documents of
`--doc-tokens` tokens (think long system prompts / RAG contexts / agent histories), each
request = one document (Zipf-popular) + a fresh question of `--question-tokens` tokens.

The fleet runs the H200 Llama-3.1-8B profile with the GPU KV pool cut down
(`--gpu-blocks` per worker) so that the documents do not all fit on every worker — the
regime where routing matters: a policy that spreads each document over every worker
keeps evicting to CPU; one that keeps documents apart keeps them on GPU. TTFT is
measured by the client (send → first streamed token).

    .venv/bin/python bench/bench_policies_http.py [--workers 4] [--rate 45] [--seconds 30]
        [--policies round_robin,least_loaded,cache_aware,kv_cost]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
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

BASE_PROFILE = "h200-llama3.1-8b"


def _profile(tmp: Path, gpu_blocks: int) -> tuple[Path, str]:
    d = yaml.safe_load((ROOT / "configs/profiles" / f"{BASE_PROFILE}.yaml").read_text())
    g = d["geometry"]
    block_bytes = 2 * g["layers"] * g["kv_heads"] * g["head_dim"] * g["dtype_bytes"] * d["block_size"]
    d["memory"] = {"device_bytes": float(gpu_blocks * block_bytes) + 1e6, "memory_utilization": 1.0,
                   "weights_bytes": 1e6, "reserved_bytes": 0.0}
    d["name"] = "bench-small-gpu"
    p = tmp / "profile.yaml"
    p.write_text(yaml.safe_dump(d))
    return p, d["model"]


def _start_fleet(n: int, profile: Path) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", str(n), "--profile",
                             str(profile), "--base-port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    urls = []
    assert proc.stdout is not None
    for line in proc.stdout:
        w = line.split()
        if w and w[0] == "worker":
            urls.append(next(x[4:] for x in w if x.startswith("url=")))
        if w == ["ready"]:
            return proc, urls
    raise SystemExit("sim-cluster did not start")


def _start_gateway(
    tmp: Path, policy: str, urls: list[str], profile: Path, model: str
) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"id": model, "tokenizer": str(ROOT / "configs/assets/tiny-tokenizer"), "profile": str(profile)}],
        "workers": [{"id": f"w{i}", "url": u} for i, u in enumerate(urls)],
        "routing": {"policy": policy},
        "observability": {"log_level": "WARNING"},
        "pool": {"load_poll_interval_s": 0.05},
    }
    path = tmp / f"gw-{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


async def _ready(url: str, n: int) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(url + "/admin/workers") as r:
                    if r.status == 200 and sum(w["state"] == "healthy" for w in (await r.json())["workers"]) == n:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("gateway not ready")


def workload(a: argparse.Namespace) -> list[tuple[float, list[int]]]:
    rng = random.Random(a.seed)
    docs = [[rng.randrange(3, 8000) for _ in range(a.doc_tokens)] for _ in range(a.docs)]
    weights = [1.0 / (i + 1) ** a.zipf for i in range(a.docs)]
    t = 0.0
    out = []
    while t < a.seconds:
        t += rng.expovariate(a.rate)
        d = rng.choices(range(a.docs), weights)[0]
        out.append((t, docs[d] + [rng.randrange(3, 8000) for _ in range(a.question_tokens)]))
    return out


async def replay(
    url: str, model: str, reqs: list[tuple[float, list[int]]], max_tokens: int
) -> tuple[list[float], dict[str, int]]:
    ttfts: list[float] = []
    tokens: dict[str, int] = {}  # prompt tokens by where they came from (usage.kv)
    errors = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        t0 = time.perf_counter()

        async def one(at: float, prompt: list[int]) -> None:
            nonlocal errors
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            start = time.perf_counter()
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            try:
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        errors += 1
                        return
                    first = True
                    async for line in r.content:
                        if not line.startswith(b"data: {"):
                            continue
                        if first:
                            ttfts.append(time.perf_counter() - start)
                            first = False
                        if b'"usage"' in line:
                            kv = json.loads(line[6:]).get("usage", {}).get("kv") or {}
                            for tier, n in (kv.get("loaded_tokens") or {}).items():
                                tokens[tier] = tokens.get(tier, 0) + n
                            tokens["recomputed"] = tokens.get("recomputed", 0) + kv.get("recomputed_tokens", 0)
                            tokens["prefetched"] = tokens.get("prefetched", 0) + kv.get("prefetched_tokens", 0)
            except aiohttp.ClientError:
                errors += 1

        await asyncio.gather(*(one(at, p) for at, p in reqs))
    if errors:
        print(f"  ({errors} requests failed)")
    return ttfts, tokens


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--policies", default="round_robin,least_loaded,prefix_hash,cache_aware,dynamo,kv_cost")
    ap.add_argument("--rate", type=float, default=45.0, help="requests per second (Poisson)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--gpu-blocks", type=int, default=1400, help="GPU KV blocks per worker (16 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    reqs = workload(a)
    print(f"{len(reqs)} requests over {a.seconds:.0f} s ({a.rate}/s), {a.docs} docs x {a.doc_tokens} tokens "
          f"+ {a.question_tokens}-token questions, {a.workers} workers with {a.gpu_blocks} GPU blocks each")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    rows = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        profile, model = _profile(tmp, a.gpu_blocks)
        for policy in a.policies.split(","):
            fleet, urls = _start_fleet(a.workers, profile)
            gw, url = _start_gateway(tmp, policy, urls, profile, model)
            try:
                asyncio.run(_ready(url, a.workers))
                ttfts, tokens = asyncio.run(replay(url, model, reqs, a.max_tokens))
            finally:
                gw.terminate()
                fleet.terminate()
                gw.wait(10)
                fleet.wait(10)
            row = (policy, len(ttfts), _pct(ttfts, 0.5) * 1000, _pct(ttfts, 0.99) * 1000, _pct(ttfts, 0.9) * 1000,
                   sum(ttfts) / max(1, len(ttfts)) * 1000)
            rows.append(row)
            total = sum(v for k, v in tokens.items() if k != "prefetched") or 1
            mix = " ".join(f"{k}={100 * v / total:.0f}%" for k, v in sorted(tokens.items()) if v and k != "prefetched")
            print(f"  {policy:14s} done: p50 {row[2]:8.1f} ms  p99 {row[3]:8.1f} ms   prompt tokens: {mix}"
                  f" (prefetched {tokens.get('prefetched', 0)})", flush=True)
    print(f"\n{'policy':14s} {'n':>5s} {'TTFT p50 ms':>12s} {'TTFT p90 ms':>12s} {'TTFT p99 ms':>12s} {'mean ms':>9s}")
    for p, n, p50, p99, p90, mean in rows:
        print(f"{p:14s} {n:5d} {p50:12.1f} {p90:12.1f} {p99:12.1f} {mean:9.1f}")
    by = {r[0]: r for r in rows}
    if "kv_cost" in by:
        k = by["kv_cost"]
        others = [r for r in rows if r[0] != "kv_cost"]
        wins = all(k[2] < r[2] and k[3] < r[3] for r in others)
        print(f"\nkv_cost beats every other policy on p50 and p99: {'YES' if wins else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
