"""Prefix index: ingest rate, lookup latency at 10M blocks x 64 workers, memory per entry.

    .venv/bin/python bench/bench_index.py [--blocks 10000000] [--workers 64] [--queries 3000] [--only ingest]

Machines shared with other jobs make wall-clock numbers noisy, so the ingest rate
is given per CPU-second of this thread (what "per core" means) next to the wall
clock, and lookups show both wall-clock and CPU-time percentiles; /proc/loadavg is
printed first.

1. Ingest, one core, decode + apply (msgspec decode of the payload included), batches
   of 16 `BlockStored` events of 32 blocks x 16 tokens (target >= 1M block entries/s):
   fresh chains from one of our workers (hashes are our digests) and from a vLLM
   worker (its own hashes: engine-hash map kept), and a tiered mix (every chain
   stored in GPU, copied to CPU, dropped from GPU, copied to DISK, dropped from CPU).
   "our worker" is measured twice: verified (keys recomputed from the tokens, the
   default) and trusted (`add_worker(trusted_digests=True)` with the lazy decoder:
   digests applied as published, 1 in 32 chain roots recomputed), on the same batches.
2. Lookup of an 8k-token prompt (512 blocks of 16) against `--workers` workers in
   8 remote groups and `--blocks` indexed blocks (target p99 <= 1 ms): realistic
   prompts (a dozen holders with GPU/CPU/DISK/REMOTE cuts) and a worst case (every
   worker holds the whole prompt with its own three tier cuts).
3. Memory: RSS growth of that index per block and per (block, worker) entry, plus a
   tracemalloc count on a smaller index (and, after 1., per block ingested verified
   vs trusted: trusted blocks keep no full key).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvindex.events import BlockRemoved, BlockStored, EventDecoder, EventEncoder  # noqa: E402
from kvindex.index import PrefixIndex  # noqa: E402
from kvindex.keys import BlockHasher, Namespace, digests64  # noqa: E402
from kvindex.tiers import Tier  # noqa: E402

NS = Namespace("meta-llama/Llama-3.1-8B-Instruct", kv_dtype="bfloat16", block_size=16)
HASHER = BlockHasher.for_namespace(NS)
BS = 16
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


# ------------------------------------------------------------------------------- ingest


def chain_events(rng: random.Random, n_events: int, blocks: int, vllm: bool) -> list[tuple[BlockStored, list[int]]]:
    """Fresh chains: half the events continue an earlier chain, half start one."""
    out: list[tuple[BlockStored, list[int]]] = []
    tips: list[tuple[int, bytes, int]] = []  # (engine hash, full key, digest) of chain ends
    for _ in range(n_events):
        tokens = [rng.randrange(128_256) for _ in range(blocks * BS)]
        if tips and rng.random() < 0.5:
            peh, pkey, _ = tips[rng.randrange(len(tips))]
            keys = HASHER.keys(tokens, parent=pkey)
            parent: int | None = peh
        else:
            keys = HASHER.keys(tokens)
            parent = None
        ds = digests64(keys)
        hashes = [rng.getrandbits(64) for _ in ds] if vllm else ds
        out.append((BlockStored(hashes, parent, tokens, BS, None, "GPU", None), ds))
        tips.append((hashes[-1], keys[-1], ds[-1]))
        if len(tips) > 64:
            tips.pop(0)
    return out


def tiered_mix(stored: list[tuple[BlockStored, list[int]]]) -> list[object]:
    """Each chain: GPU store; later CPU copy, GPU drop, DISK copy, CPU drop."""
    evs: list[object] = []
    lag = 8
    for i in range(len(stored) + 4 * lag):
        if i < len(stored):
            evs.append(stored[i][0])
        for step, (medium, drop) in enumerate((("CPU", None), (None, "GPU"), ("DISK", None), (None, "CPU")), 1):
            j = i - step * lag
            if 0 <= j < len(stored):
                ev = stored[j][0]
                if medium:
                    evs.append(BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, BS, None, medium, None))
                else:
                    evs.append(BlockRemoved(ev.block_hashes, drop))
    return evs


def bench_ingest(name: str, events: list[object], reps: int, trusted: bool = False) -> None:
    enc = EventEncoder()
    batches = [events[i : i + 16] for i in range(0, len(events), 16)]
    payloads = [enc.encode(time.time(), b) for b in batches]  # type: ignore[arg-type]
    stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
    cpu_rates, wall_rates, dec_share = [], [], []
    for _ in range(reps):
        idx = PrefixIndex(BS, max_workers=64)
        idx.add_worker("w", NS.digest, BS, trusted_digests=trusted)
        dec = EventDecoder(lazy=trusted)
        t_dec = 0.0
        c0, t0 = time.thread_time(), time.perf_counter()
        for p in payloads:
            t1 = time.thread_time()
            batch = dec.decode(p)
            t_dec += time.thread_time() - t1
            st = idx.apply("w", batch)
            assert not st.orphans and not st.bad_events and not st.digest_mismatches, st
        assert idx.trusts_digests("w") is trusted
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        cpu_rates.append((stored + removed) / cpu)
        wall_rates.append((stored + removed) / wall)
        dec_share.append(t_dec / cpu)
    print(
        f"  {name:<28} {statistics.median(cpu_rates) / 1e6:5.2f} M block events per CPU-second"
        f" (best {max(cpu_rates) / 1e6:.2f}; wall clock {statistics.median(wall_rates) / 1e6:.2f})"
        f"  [{stored:,} stored + {removed:,} removed, {reps} runs, decode {statistics.median(dec_share):.0%}]"
    )


def ingest_memory(events: list[object]) -> None:
    """tracemalloc bytes per indexed block after ingesting `events`, verified vs trusted
    (trusted blocks keep no full key)."""
    enc = EventEncoder()
    payloads = [enc.encode(0.0, events[i : i + 16]) for i in range(0, len(events), 16)]  # type: ignore[arg-type]
    blocks = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    out = []
    for trusted in (False, True):
        gc.collect()
        tracemalloc.start()
        idx = PrefixIndex(BS, max_workers=64)
        idx.add_worker("w", NS.digest, BS, trusted_digests=trusted)
        dec = EventDecoder(lazy=trusted)
        for p in payloads:
            idx.apply("w", dec.decode(p))
        cur, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out.append(f"{'trusted' if trusted else 'verified'} {cur / len(idx):.0f} B")
        del idx
    print(f"  memory per block after that ingest (tracemalloc, {blocks:,} blocks): {', '.join(out)}")


# ------------------------------------------------------------------------------- lookup


def build_index(n_blocks: int, n_workers: int, rng: random.Random) -> tuple[PrefixIndex, list[str]]:
    idx = PrefixIndex(BS, max_workers=max(64, n_workers))
    wids = [f"w{i:02d}" for i in range(n_workers)]
    for i, w in enumerate(wids):
        idx.add_worker(w, NS.digest, BS, remote_group=f"rg{i % 8}")
    fill_random(idx, wids, n_blocks, rng)
    return idx, wids


def fill_random(idx: PrefixIndex, wids: list[str], n_blocks: int, rng: random.Random) -> None:
    """`n_blocks` unrelated blocks in 512-block chunks, each on a random worker's GPU and,
    for half, a fifth and a tenth of them, also in CPU, DISK and REMOTE."""
    done = 0
    while done < n_blocks:
        n = min(512, n_blocks - done)
        raw = os.urandom(32 * n)
        keys = [raw[i : i + 32] for i in range(0, 32 * n, 32)]
        idx.store_keys(rng.choice(wids), keys, Tier.GPU)
        r = rng.random()
        if r < 0.5:
            idx.store_keys(rng.choice(wids), keys, Tier.CPU)
        if r < 0.2:
            idx.store_keys(rng.choice(wids), keys, Tier.DISK)
        if r < 0.1:
            idx.store_keys(rng.choice(wids), keys, Tier.REMOTE)
        done += n


def place_prompt(idx: PrefixIndex, wids: list[str], keys: list[bytes], holders: list[str], rng: random.Random) -> None:
    n = len(keys)
    for w in holders:
        cut = sorted(rng.randrange(1, n + 1) for _ in range(3))
        idx.store_keys(w, keys[: cut[0]], Tier.GPU)
        idx.store_keys(w, keys[cut[0] : cut[1]], Tier.CPU)
        idx.store_keys(w, keys[cut[1] : cut[2]], Tier.DISK)
    idx.store_keys(wids[rng.randrange(len(wids))], keys[: rng.randrange(1, n + 1)], Tier.REMOTE)


def bench_lookup(idx: PrefixIndex, prompts: list[list[int]], queries: int, label: str) -> None:
    for d in prompts[:20]:
        idx.match(d)
    ts, cs, sizes = [], [], []
    for q in range(queries):
        d = prompts[q % len(prompts)]
        c0, t0 = time.thread_time(), time.perf_counter()
        m = idx.match(d)
        ts.append(time.perf_counter() - t0)
        cs.append(time.thread_time() - c0)
        sizes.append(len(m))
    print(
        f"  {label:<44} wall p50 {statistics.median(ts) * 1e3:.3f} p99 {pct(ts, 0.99) * 1e3:.3f} ms;"
        f" CPU p50 {statistics.median(cs) * 1e3:.3f} p99 {pct(cs, 0.99) * 1e3:.3f} ms"
        f"  ({statistics.mean(sizes):.1f} workers matched)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10_000_000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--queries", type=int, default=3000)
    ap.add_argument("--ingest-events", type=int, default=1600)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", choices=["ingest"], default=None, help="stop after the ingest measurements")
    a = ap.parse_args()
    rng = random.Random(0)
    with open("/proc/loadavg") as f:
        print(f"load average: {f.read().strip()}  (2 idle cores would show < 1)")

    print("1. ingest, one core, decode + apply; BlockStored of 32 blocks x 16 tokens, 16 events per batch")
    ours = chain_events(rng, a.ingest_events, 32, vllm=False)
    theirs = chain_events(rng, a.ingest_events, 32, vllm=True)
    bench_ingest("fresh chains, our worker", [e for e, _ in ours], a.reps)
    bench_ingest("  ... trusted digests", [e for e, _ in ours], a.reps, trusted=True)
    bench_ingest("fresh chains, vLLM worker", [e for e, _ in theirs], a.reps)
    bench_ingest("tiered mix, our worker", tiered_mix(ours), a.reps)
    bench_ingest("  ... trusted digests", tiered_mix(ours), a.reps, trusted=True)
    bench_ingest("tiered mix, vLLM worker", tiered_mix(theirs), a.reps)
    ingest_memory([e for e, _ in ours])
    if a.only == "ingest":
        return

    print(f"2. lookup: 8k-token prompt (512 blocks), {a.workers} workers in 8 remote groups, {a.blocks:,} blocks")
    gc.collect()
    r0 = rss()
    t0 = time.perf_counter()
    idx, wids = build_index(a.blocks, a.workers, rng)
    build_s = time.perf_counter() - t0
    prompts, worst = [], []
    for _ in range(64):
        tokens = [rng.randrange(128_256) for _ in range(8192)]
        keys = HASHER.keys(tokens)
        place_prompt(idx, wids, keys, rng.sample(wids, rng.randrange(4, 17)), rng)
        prompts.append(digests64(keys))
    for _ in range(4):
        tokens = [rng.randrange(128_256) for _ in range(8192)]
        keys = HASHER.keys(tokens)
        place_prompt(idx, wids, keys, wids, rng)
        worst.append(digests64(keys))
    gc.collect()
    grown = rss() - r0
    blocks, entries = len(idx), idx.entries()
    print(f"  built in {build_s:.1f} s through store_keys ({blocks / build_s / 1e6:.2f} M blocks/s);"
          f" digest maps GC-tracked: {any(map(gc.is_tracked, idx._blocks.bitmaps))}")  # fmt: skip
    bench_lookup(idx, prompts, a.queries, "realistic prompts (4-16 holders, tier cuts)")
    bench_lookup(idx, worst, max(500, a.queries // 6), f"worst case (all {a.workers} hold it, own cuts)")
    miss = [digests64(HASHER.keys([rng.randrange(128_256) for _ in range(8192)]))]
    bench_lookup(idx, miss, 1000, "a prompt nobody holds")

    print("3. memory")
    print(
        f"  RSS growth {grown / 2**30:.2f} GiB for {blocks:,} blocks and {entries:,} (block, worker/group, tier)"
        f" entries: {grown / blocks:.0f} B per block, {grown / entries:.0f} B per entry"
    )
    del idx
    gc.collect()
    n_small = 500_000
    tracemalloc.start()
    small, _ = build_index(n_small, a.workers, random.Random(1))
    cur, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"  tracemalloc, {len(small):,} blocks / {small.entries():,} entries: {cur / len(small):.0f} B per block, "
        f"{cur / small.entries():.0f} B per entry"
    )


if __name__ == "__main__":
    main()
