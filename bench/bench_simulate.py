"""Offline-simulator speed: simulated requests per second of wall time.

    .venv/bin/python bench/bench_simulate.py [--trace FILE] [--limit N] [--workers 8]
        [--block-sizes 16,64] [--policies round_robin,kv_cost,kv_cost_true_state] [--repeat 3]

For each block size and policy, the Mooncake trace (default: the first half in
$LOADTEST_TRACES, 5,606 requests) runs `--repeat` times on a cold fleet; prints the
median wall time, requests/s, and what the time goes into (simulated events, KV events
applied to the index, load polls), plus the one-off key computation per block size.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.blockkeys import (
    KeyCache,  # noqa: E402
    TraceKeyer,  # noqa: E402
)
from loadtest.fleet import FleetSpec  # noqa: E402
from loadtest.simulate import SimSettings, Simulation  # noqa: E402
from loadtest.summary import summarize  # noqa: E402
from loadtest.tokens import TokenSynth  # noqa: E402
from loadtest.trace import TraceError  # noqa: E402
from loadtest.tracefiles import resolve_trace  # noqa: E402
from loadtest.traces import load_trace  # noqa: E402
from workers.sim import load_profile  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=None, help="trace file (default: $LOADTEST_TRACES/mooncake_...jsonl)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--profile", default="h200-llama3.1-8b")
    ap.add_argument("--block-sizes", default="64,16")
    ap.add_argument("--policies", default="round_robin,kv_cost,kv_cost_true_state")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    try:
        trace = load_trace(resolve_trace(a.trace))
    except TraceError as e:
        raise SystemExit(f"error: {e}") from None
    if a.limit:
        trace = trace.window(limit=a.limit)
    synth = TokenSynth.for_trace(trace)
    print(f"trace {trace.name}: {len(trace)} requests, {a.workers} x {a.profile}")
    print(f"{'block':>5} {'policy':<12} {'wall s (median)':>16} {'req/s wall':>11} {'sim events':>11} "
          f"{'KV events':>10} {'polls':>8} {'TTFT p50 ms':>12} {'p99 ms':>9}")
    for bs in [int(x) for x in a.block_sizes.split(",")]:
        ns = load_profile(a.profile).with_block_size(bs).namespace()
        kc = KeyCache(TraceKeyer(synth, ns))
        t0 = time.perf_counter()
        for r in trace.requests:
            kc.get(r)
        keys_s = time.perf_counter() - t0
        print(f"{bs:>5} {'(keys)':<12} {keys_s:>16.2f} {len(trace) / keys_s:>11.0f}   "
              f"one-off: {kc.keyer.hashed_blocks} blocks hashed")
        for pol in a.policies.split(","):
            walls = []
            run = None
            for _ in range(a.repeat):
                st = SimSettings(fleet=FleetSpec(workers=a.workers, profile=a.profile, block_size=bs))
                t0 = time.perf_counter()
                run = Simulation(trace, pol, st, synth=synth, keys=kc).run()
                walls.append(time.perf_counter() - t0)
            assert run is not None
            w = statistics.median(walls)
            s = summarize(run)
            st_ = run.meta.stats
            print(f"{bs:>5} {pol:<12} {w:>16.2f} {len(trace) / w:>11.0f} {st_['sim_events']:>11} "
                  f"{st_.get('events_applied', 0):>10} {st_['polls']:>8} {s.ttft['p50'] * 1000:>12.1f} "
                  f"{s.ttft['p99'] * 1000:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
