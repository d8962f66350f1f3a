"""Benchmark: simulated requests per second of wall time, virtual clock, Mooncake trace.

Replays the Mooncake trace (`--trace FILE`, default
$LOADTEST_TRACES/mooncake_conversation_first_half.jsonl: 5,606 requests, 512-token
hash blocks) on N SimEngines (default 16 x h200-llama3.1-8b) driven by a global event
heap, exactly as a discrete-event simulator would drive them: arrivals at the trace's
timestamps (times `--speed`), each engine advanced to its own next event time. Keys
are precomputed once per trace block (each 512-token block split into engine blocks,
chained), the fast path the engine API offers (`SimRequest.keys`).

Dispatch is a stand-in for a router (this measures the engine, not a policy):
`affinity` sends a request to the worker owning its first two trace blocks (consistent
hashing without load bound) — realistic cache reuse; `rr` round-robins.

Prints wall time, simulated req/s of wall time, time split (key prep vs simulation),
cache hit share, TTFT p50/p99 and per-tier loaded tokens, at each block size given.

    .venv/bin/python bench/bench_sim_virtual.py [--workers 16] [--block-sizes 16,64] [--speed 1]
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.trace import TraceError  # noqa: E402
from loadtest.tracefiles import resolve_trace  # noqa: E402
from workers.sim import RemoteStore, SimEngine, SimRequest, load_profile  # noqa: E402

TRACE_BLOCK = 512


def load_trace(path: Path, limit: int | None) -> list[dict]:
    rows = []
    with path.open() as f:
        for line in f:
            rows.append(json.loads(line))
            if limit and len(rows) >= limit:
                break
    return rows


def trace_keys(rows: list[dict], block_size: int) -> list[list[bytes]]:
    """Chained keys per request at `block_size`; each trace block's keys computed once."""
    per = TRACE_BLOCK // block_size
    memo: dict[tuple[bytes, int], list[bytes]] = {}
    out = []
    for r in rows:
        keys: list[bytes] = []
        parent = bytes(32)
        for hid in r["hash_ids"]:
            sub = memo.get((parent, hid))
            if sub is None:
                sub = []
                p = parent
                for j in range(per):
                    p = hashlib.sha256(p + hid.to_bytes(8, "little") + j.to_bytes(2, "little")).digest()
                    sub.append(p)
                memo[(parent, hid)] = sub
            keys.extend(sub)
            parent = sub[-1]
        out.append(keys[: r["input_length"] // block_size])
    return out


def run(rows: list[dict], keys: list[list[bytes]], workers: int, profile_name: str, block_size: int,
        speed: float, policy: str, remote_groups: int) -> dict:
    prof = load_profile(profile_name)
    stores = []
    if remote_groups and prof.remote is not None:
        pb = prof.with_block_size(block_size)
        stores = [RemoteStore(f"rg{g}", pb.tier_blocks(pb.remote), block_size) for g in range(remote_groups)]
    engines = [
        SimEngine(f"w{i}", prof, block_size=block_size, max_waiting=100000,
                  remote=stores[i * len(stores) // workers] if stores else None)
        for i in range(workers)
    ]
    ttft: list[float] = []
    usages = []
    errors = 0

    def on_first(t: float, u) -> None:
        ttft.append(u.ttft_ms)

    def on_finish(t: float, u) -> None:
        usages.append(u)

    heap: list[tuple[float, int]] = []
    sched: list[float | None] = [None] * workers

    def schedule(i: int) -> None:
        t = engines[i].next_event_time()
        if t is not None and t != sched[i]:
            sched[i] = t
            heapq.heappush(heap, (t, i))

    def run_until(ta: float) -> None:
        while heap and heap[0][0] <= ta:
            t, i = heapq.heappop(heap)
            if sched[i] != t:
                continue
            sched[i] = None
            engines[i].advance(t)
            schedule(i)

    t0 = time.perf_counter()
    for n, (r, ks) in enumerate(zip(rows, keys, strict=True)):
        ta = r["timestamp"] / 1000.0 / speed
        run_until(ta)
        if policy == "rr":
            w = n % workers
        else:
            h = r["hash_ids"][:2]
            w = int.from_bytes(hashlib.blake2b(repr(h).encode(), digest_size=8).digest(), "little") % workers
        req = SimRequest(f"r{n}", r["input_length"], max(1, r["output_length"]), keys=ks,
                         on_first_token=on_first, on_finish=on_finish)
        try:
            engines[w].submit(req, ta)
        except Exception:  # noqa: BLE001 - counted, reported
            errors += 1
        schedule(w)
    run_until(float("inf"))
    wall = time.perf_counter() - t0
    end_t = max(e.now for e in engines)
    loaded = {"GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 0, "PEER": 0}
    for u in usages:
        for k, v in u.loaded_tokens.items():
            loaded[k] += v
    prompt = sum(u.prompt_tokens for u in usages)
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else [0.0] * 99
    return {
        "block_size": block_size,
        "requests": len(rows),
        "finished": len(usages),
        "errors": errors,
        "wall_s": wall,
        "req_per_s": len(rows) / wall,
        "virtual_s": end_t,
        "steps": sum(e.stats.steps for e in engines),
        "cached_share": sum(loaded.values()) / max(prompt, 1),
        "loaded_tokens": loaded,
        "ttft_p50_ms": q[49],
        "ttft_p99_ms": q[98],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL (default: $LOADTEST_TRACES/...)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--profile", default="h200-llama3.1-8b")
    ap.add_argument("--block-sizes", default="16,64")
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--policy", choices=["affinity", "rr"], default="affinity")
    ap.add_argument("--remote-groups", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    try:
        trace = resolve_trace(args.trace)
    except TraceError as e:
        raise SystemExit(f"error: {e}") from None
    rows = load_trace(trace, args.limit)
    print(f"trace: {len(rows)} requests, {sum(r['input_length'] for r in rows) / len(rows):,.0f} mean prompt tokens")
    for bs in (int(x) for x in args.block_sizes.split(",")):
        t0 = time.perf_counter()
        keys = trace_keys(rows, bs)
        prep = time.perf_counter() - t0
        res = run(rows, keys, args.workers, args.profile, bs, args.speed, args.policy, args.remote_groups)
        nblk = sum(len(k) for k in keys)
        print(
            f"block {bs:>3}: {res['requests']} req ({nblk / len(rows):,.0f} blocks/req) on {args.workers} workers, "
            f"{res['virtual_s']:,.0f} s virtual | sim {res['wall_s']:.2f} s wall = {res['req_per_s']:,.0f} req/s "
            f"| key prep {prep:.2f} s | steps {res['steps']:,} | finished {res['finished']} errors {res['errors']}"
        )
        lt = res["loaded_tokens"]
        print(
            f"           cached {res['cached_share']:.1%} of prompt tokens "
            f"(GPU {lt['GPU']:,} CPU {lt['CPU']:,} DISK {lt['DISK']:,} REMOTE {lt['REMOTE']:,}) | "
            f"TTFT p50 {res['ttft_p50_ms']:.1f} ms p99 {res['ttft_p99_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
