"""Routing decision time: block keys + index lookup + scoring, per policy.

Setup (realistic index state): 64 workers (block 16, Llama-3-8B bf16 block bytes); a
2k-token system prompt on every worker's GPU; 16 conversations of 8k tokens (512
blocks) each held by 3–6 workers at different lengths, split over GPU / CPU / DISK,
two of them also in a shared REMOTE group; 40k unrelated blocks of background
traffic; loads, report ages, in-flight counts and in-flight KV loads random; half the
workers can pull from peers. Each decision routes one of the conversations' next 8k-token prompt
(tokenization excluded: token ids are given).

Prints p50 / p99 in microseconds of the whole decision per policy (wall clock, and
thread CPU time, which a busy shared machine does not inflate) and of each phase
(keys, lookup, score), all measured in this run. Target: kv_cost p99 <= 1000 µs.
`kv_cost(all)` is kv_cost with its `all_estimates` attribute set (no pruning: what
/admin/route/explain pays), shown for comparison.

    .venv/bin/python bench/bench_decision.py [--iters N] [--workers W]

`--background-blocks N` adds N more unrelated blocks (random keys, each on a random
worker's GPU, half also on a CPU tier, some on DISK / REMOTE, as bench/bench_index.py
fills its index) before measuring: `--background-blocks 10000000` is the decision
against a 10M-block index (memory: ~4 GB).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_index import fill_random  # noqa: E402  (the same directory: a sibling script)

from kvindex.events import BlockStored  # noqa: E402
from kvindex.index import PrefixIndex  # noqa: E402
from kvindex.keys import BlockHasher, Namespace, digests64  # noqa: E402
from kvindex.tiers import Tier  # noqa: E402
from router.planner import POLICY_NAMES, CostParams, Link, Policy, RouteRequest, WorkerView, make_policy  # noqa: E402
from router.planner.kv_cost import KVCostPolicy  # noqa: E402

B = 16
PROMPT = 8192
BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * B  # Llama-3-8B bf16


def cost() -> CostParams:
    return CostParams(
        block_size=B,
        block_bytes=BLOCK_BYTES,
        prefill_tokens_per_s=40_000.0,
        prefill_attn_s_per_token2=1e-10,
        prefill_overhead_s=0.004,
        decode_step_s=0.008,
        links={
            Tier.CPU: Link(50e9, 1e-5),
            Tier.DISK: Link(6e9, 1e-4),
            Tier.REMOTE: Link(2e9, 1e-3),
            Tier.PEER: Link(25e9, 2e-4),
        },
    )


def store(index: PrefixIndex, wid: str, hasher: BlockHasher, tokens: list[int], lo: int, hi: int, medium: str) -> None:
    """Publish blocks [lo, hi) of `tokens` as our workers do (digest64 block hashes)."""
    if hi <= lo:
        return
    keys = hasher.keys(tokens[: hi * B])
    ds = digests64(keys)
    parent = ds[lo - 1] if lo else None
    ev = BlockStored(ds[lo:hi], parent, tokens[lo * B : hi * B], B, medium=medium)
    index.apply(wid, [ev])


def build(n_workers: int, rng: random.Random):
    ns = Namespace("meta-llama/Llama-3.1-8B-Instruct", block_size=B)
    hasher = BlockHasher.for_namespace(ns)
    index = PrefixIndex(B, max_workers=max(256, n_workers))
    ids = [f"w{i:02d}" for i in range(n_workers)]
    for i, wid in enumerate(ids):
        index.add_worker(wid, ns.digest, remote_group="rg0" if i < 8 else None)
    system = [rng.randrange(100_000) for _ in range(2048)]
    for wid in ids:
        store(index, wid, hasher, system, 0, 128, "GPU")
    convs = []
    for _ in range(16):
        toks = system + [rng.randrange(100_000) for _ in range(PROMPT - len(system) + B * 8)]
        convs.append(toks)
        for wid in rng.sample(ids, rng.randrange(3, 7)):
            n = rng.randrange(129, 512)
            a = rng.randrange(128, n + 1)
            b = rng.randrange(a, n + 1)
            store(index, wid, hasher, toks, 128, a, "GPU")
            store(index, wid, hasher, toks, a, b, "CPU")
            store(index, wid, hasher, toks, b, n, "DISK")
        if rng.random() < 0.2:
            store(index, ids[0], hasher, toks, 128, 400, "REMOTE")
    for wid in ids:  # background: unrelated prefixes
        for _ in range(10):
            toks = [rng.randrange(100_000) for _ in range(64 * B)]
            store(index, wid, hasher, toks, 0, 64, rng.choice(["GPU", "CPU", "DISK"]))
    views = []
    for i, wid in enumerate(ids):
        w = WorkerView(
            wid,
            cost(),
            waiting_requests=rng.randrange(0, 6),
            waiting_prefill_tokens=rng.randrange(0, 40_000),
            running_requests=rng.randrange(0, 30),
            est_queue_s=rng.uniform(0.0, 0.8),
            gpu_free_blocks=rng.randrange(0, 20_000),
            gpu_capacity_blocks=20_000,
            report_age_s=rng.uniform(0.0, 0.2),
            inflight_requests=rng.randrange(0, 8),
            inflight_prefill_tokens=rng.randrange(0, 20_000),
            max_waiting=256,
            supports_peer_pull=i % 2 == 0,
            # requests still loading KV (kv_cost's interference term): none on half
            inflight_loads=tuple(
                (rng.uniform(-0.05, 1.5), rng.uniform(0.0, 0.1)) for _ in range(rng.choice([0, 0, 1, 3]))
            ),
        )
        views.append(w)
    return ns, hasher, index, convs, views


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _policy(name: str, every: bool) -> Policy:
    """A policy with its defaults; `every`: no pruning, as explain sets on its copy."""
    policy = make_policy(name)
    if every and isinstance(policy, KVCostPolicy):
        policy.all_estimates = True
    return policy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--background-blocks", type=int, default=0, help="more unrelated indexed blocks (10M: 10000000)")
    args = ap.parse_args(argv)
    rng = random.Random(42)
    ns, hasher, index, convs, views = build(args.workers, rng)
    if args.background_blocks:
        t_fill = time.perf_counter()
        fill_random(index, [v.worker_id for v in views], args.background_blocks, rng)
        print(f"added {args.background_blocks:,} background blocks in {time.perf_counter() - t_fill:.0f} s")
    print(f"index: {len(index)} blocks, {index.entries()} entries, {args.workers} workers")
    prompts = [c[:PROMPT] for c in convs]
    sample = index.match(digests64(hasher.keys_for(prompts[0], ns)))
    common = sum(1 for m in sample.values() if m.blocks == 128)
    longer = {w: " ".join(f"{t.name}:{n}" for t, n in m.runs) for w, m in sample.items() if m.blocks != 128}
    print(f"one request's matches: {common} workers hold the 128-block system prompt; longer: {longer}")
    runs = [(name, name, False) for name in POLICY_NAMES]
    runs.insert(POLICY_NAMES.index("kv_cost") + 1, ("kv_cost(all)", "kv_cost", True))
    policies = {label: _policy(name, every) for label, name, every in runs}
    # samples[label][phase] per round; rounds interleave the policies so that noise from
    # other processes on the machine hits them alike
    samples = {label: [] for label, _, _ in runs}
    evaluated: dict[str, list[int]] = {label: [] for label, _, _ in runs}
    per_round = max(1, args.iters // args.rounds)
    for _ in range(args.rounds):
        for label, policy in policies.items():
            tot, tk, tl, ts, cpu = [], [], [], [], []
            for i in range(per_round + 20):
                toks = prompts[i % len(prompts)]
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                digests = digests64(hasher.keys_for(toks, ns))
                t1 = time.perf_counter_ns()
                matches = index.match(digests)
                t2 = time.perf_counter_ns()
                d = policy.choose(RouteRequest(len(toks), digests, matches), views)
                t3 = time.perf_counter_ns()
                c1 = time.thread_time_ns()
                if d.worker_id is None:
                    raise SystemExit(f"{label} shed a request in the benchmark: {d.reason}")
                if i >= 20:  # warm-up
                    evaluated[label].append(len(d.estimates))
                    tot.append((t3 - t0) / 1e3)
                    tk.append((t1 - t0) / 1e3)
                    tl.append((t2 - t1) / 1e3)
                    ts.append((t3 - t2) / 1e3)
                    cpu.append((c1 - c0) / 1e3)
            samples[label].append((tot, tk, tl, ts, cpu))
    print(
        f"\n{'policy':<20}{'p50 µs':>9}{'p99 µs':>9}{'p99 best':>10}{'cpu p50':>9}{'cpu p99':>9}"
        f"{'keys p50':>10}{'lookup p50':>12}{'score p50':>11}{'score p99':>11}"
    )
    cpu99 = {}
    best_p99 = {}
    for label, rounds in samples.items():
        tot = [x for r in rounds for x in r[0]]
        tk = [x for r in rounds for x in r[1]]
        tl = [x for r in rounds for x in r[2]]
        ts = [x for r in rounds for x in r[3]]
        cpu = [x for r in rounds for x in r[4]]
        best_p99[label] = min(pct(r[0], 0.99) for r in rounds)
        cpu99[label] = pct(cpu, 0.99)
        print(
            f"{label:<20}{statistics.median(tot):>9.0f}{pct(tot, 0.99):>9.0f}{best_p99[label]:>10.0f}"
            f"{statistics.median(cpu):>9.0f}{cpu99[label]:>9.0f}"
            f"{statistics.median(tk):>10.0f}{statistics.median(tl):>12.0f}{statistics.median(ts):>11.0f}"
            f"{pct(ts, 0.99):>11.0f}"
        )
    print(
        f"\nfull estimates per decision: kv_cost {statistics.mean(evaluated['kv_cost']):.1f} of {args.workers}"
        f" (pruned by lower bound), kv_cost(all) {statistics.mean(evaluated['kv_cost(all)']):.0f}"
    )
    allp = pct([x for r in samples["kv_cost"] for x in r[0]], 0.99)
    print(
        f"kv_cost decision p99 = {allp:.0f} µs over all samples, {best_p99['kv_cost']:.0f} µs in the best of"
        f" {args.rounds} rounds (target <= 1000 µs: {'PASS' if allp <= 1000 else 'MISS'} / "
        f"{'PASS' if best_p99['kv_cost'] <= 1000 else 'MISS'}); p99 best = least disturbed by other processes"
    )
    print(
        f"kv_cost decision CPU-time p99 = {cpu99['kv_cost']:.0f} µs (thread CPU time: excludes time the OS gave"
        f" other processes; target <= 1000 µs: {'PASS' if cpu99['kv_cost'] <= 1000 else 'MISS'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
