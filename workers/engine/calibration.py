"""Measuring this engine for the simulated engine's profile (configs/profiles/tiny-cpu.yaml).

    .venv/bin/python -m workers.engine.calibration [--threads 1] [--reps 5]

prints the `compute`, `cpu` and `disk` numbers of the profile, fitted to the sim's formulas
(workers/sim/profile.py) from this engine's own timings on the machine it runs on:

- prefill: chunks of `n` new tokens after `c` cached ones, timed as the engine runs them
  (`ModelRunner.prefill` on free pool blocks, as `EngineCore.calibrate` does), the minimum
  of `reps` runs per point (the least disturbed by other work on a shared machine), fitted
  by non-negative least squares to `overhead + n/tps + attn·n·(c + n/2)`;
- decode: batched steps of `b` sequences holding `ctx` tokens in all, fitted to
  `base + per_seq·b + per_ctx·ctx`;
- CPU and DISK loads: a request whose prefix of `k` blocks sits in that tier only, its
  `usage.load_ms` (admission -> blocks landed, the whole path: link thread, reads and checks,
  copies into the pool), the median of `reps`, fitted to `latency + bytes / read_Bps`. DISK
  reads are warm (the segments were just written: page cache), as a worker's hot blocks are.

The printed compute values are the fitted minimums times `--typical` (default 1.1): the
minimum is the engine undisturbed, a shared machine usually runs a little slower, and the
profile should describe the usual, so that the check's +-25% brackets what a run sees
(loads are medians already and printed as fitted).
tests/sim/test_sim_profiles.py measures a few of these points again and checks the profile
predicts them within 25%.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .core import EngineCore
from .engineconfig import EngineConfig
from .model import LoadedModel
from .sequence import SamplingParams
from .store.disk import DiskConfig
from .tiers import TierConfig

PREFILL_POINTS = ((128, 0), (512, 0), (1024, 0), (2048, 0), (512, 1536), (1024, 1024), (2048, 2048), (256, 3840))
DECODE_POINTS = ((1, 512), (1, 4096), (8, 4096), (16, 16384))  # (sequences, context tokens in all)
LOAD_BLOCKS = (64, 128, 255)


@dataclass(frozen=True, slots=True)
class Link:
    read_Bps: float
    latency_s: float

    def cost_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.read_Bps


def bench_core(lm: LoadedModel, tmp: Path, *, tokens: int = 4096 + 64, budget: int = 2048) -> EngineCore:
    """An engine with CPU and DISK tiers, room for `tokens` on the device and in each tier."""
    bb = lm.kv.token_bytes * 16
    blocks = 2 * tokens // 16 + 64
    tiers = TierConfig(cpu_bytes=blocks * bb, disk=DiskConfig(tmp / "disk", max(4 * blocks * bb, 128 << 20),
                                                             admit_after=1))
    return EngineCore(lm, EngineConfig(num_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=16,
                                       tiers=tiers))


def time_prefill(core: EngineCore, points: tuple[tuple[int, int], ...], reps: int) -> dict[tuple[int, int], float]:
    """Seconds of a prefill chunk of `n` tokens after `c`, per (n, c), on free pool blocks: the
    minimum of `reps` runs taken round-robin over the points (a burst of other work on the
    machine then spoils one run of several points, not every run of one)."""
    bs = core.bs
    top = max(n + c for n, c in points)
    tokens = [(7 * i) % core.lm.vocab_size for i in range(top + 1)]
    seq = core.new_sequence("calibration", tokens, SamplingParams(max_tokens=1))
    seq.block_table = list(range(-(-(top + 1) // bs)))
    best = dict.fromkeys(points, float("inf"))
    for _ in range(reps):
        for n, c in points:
            seq.num_computed = c
            best[n, c] = min(best[n, c], core.runner.prefill(seq, n).seconds)
    return best


def time_chunked_prefill(core: EngineCore, tokens: int, reps: int) -> float:
    """Seconds to prefill a `tokens`-token prompt in chunks of the token budget (a miss's work)."""
    budget = core.cfg.max_num_batched_tokens
    chunks = tuple((min(budget, tokens - c), c) for c in range(0, tokens, budget))
    return sum(time_prefill(core, chunks, reps).values())


def time_decode(core: EngineCore, points: tuple[tuple[int, int], ...], reps: int) -> dict[tuple[int, int], float]:
    """Seconds of a batched decode step of `b` sequences holding `ctx` tokens in all, per
    (b, ctx), round-robin minimum as `time_prefill`."""
    bs = core.bs
    batches = {}
    for b, ctx in points:
        per = ctx // b
        seqs = []
        nxt = 0
        for i in range(b):
            seq = core.new_sequence(f"d{i}", [(3 * j + i) % core.lm.vocab_size for j in range(per + 1)],
                                    SamplingParams(max_tokens=1))
            need = -(-(per + 1) // bs)
            seq.block_table = list(range(nxt, nxt + need))
            nxt += need
            seq.num_computed = per
            seqs.append(seq)
        batches[b, ctx] = seqs
    best = dict.fromkeys(points, float("inf"))
    for _ in range(reps):
        for pt, seqs in batches.items():
            best[pt] = min(best[pt], core.runner.decode(seqs).seconds)
    return best


def time_load(core: EngineCore, tier: str, blocks: int, reps: int, *, seed: int = 0) -> float:
    """Seconds a request waits for its `blocks`-block prefix from `tier` (CPU or DISK) to land:
    the median of `reps` (loads are quick to repeat; their time is spread more by the machine
    than spoiled by it: DISK reads of the same blocks take 14 to 24 ms here from run to run)."""
    return statistics.median(load_samples(core, tier, blocks, reps, seed=seed))


def load_samples(core: EngineCore, tier: str, blocks: int, reps: int, *, seed: int = 0) -> list[float]:
    """`reps` timings (s) of a request's load of `blocks` blocks from `tier`, each after the
    blocks were put back there."""
    assert core.tiers is not None
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(3, core.lm.vocab_size, blocks * core.bs + 1)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    out = []
    for r in range(reps + 1):
        place(core, tier)
        seq = core.new_sequence(f"load-{tier}-{blocks}-{seed}-{r}-{time.monotonic_ns()}", ids, params)
        with core.lock:
            core.add(seq)
        while core.seqs:
            core.step()
        got = seq.usage.loaded_tokens[tier]
        if r == 0:  # the first one may compute the prompt (a miss): its blocks then go down
            continue
        if got != blocks * core.bs:
            raise RuntimeError(f"expected {blocks} blocks from {tier}, got {seq.usage.loaded_tokens}")
        out.append(seq.usage.load_ms / 1e3)
    return out


def place(core: EngineCore, tier: str) -> None:
    """Everything cached on the device down to CPU (and for DISK, on below CPU)."""
    assert core.tiers is not None
    with core.lock:
        core.blocks.evict_cached()
    core.tiers.drain()
    if tier == "DISK":
        core.tiers.demote_all()


def fit_prefill(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(tokens_per_s, attn_s_per_token2, overhead_s): the non-negative fit of the smallest
    relative errors (a profile is checked point by point in %, small chunks included)."""
    over, per_token, attn = _nnls_relative([[1.0, n, n * (c + n / 2)] for n, c, _ in samples],
                                           [s for _, _, s in samples])
    return 1.0 / per_token, attn, over


def fit_decode(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(base_s, per_seq_s, per_ctx_token_s), the non-negative fit of the smallest relative errors."""
    base, per_seq, per_ctx = _nnls_relative([[1.0, b, ctx] for b, ctx, _ in samples], [s for _, _, s in samples],
                                            keep=0)
    return base, per_seq, per_ctx


def _nnls_relative(rows: list[list[float]], times: list[float], keep: int = 1) -> tuple[float, float, float]:
    """min sum((x.row / t - 1)^2) over x >= 0 with x[keep] > 0: the best of the term subsets
    that keep that one, as `PrefillFit` does for its absolute fit."""
    a = np.array(rows) / np.array(times)[:, None]
    y = np.ones(len(times))
    best, best_cost = None, np.inf
    others = [i for i in range(3) if i != keep]
    for idx in ([keep], sorted([keep, others[0]]), sorted([keep, others[1]]), [0, 1, 2]):
        sub = np.linalg.lstsq(a[:, idx], y, rcond=None)[0]
        if (sub < 0).any():
            continue
        x = np.zeros(3)
        x[idx] = sub
        cost = float(((a @ x - y) ** 2).sum())
        if cost < best_cost:
            best, best_cost = x, cost
    assert best is not None and best[keep] > 0
    return float(best[0]), float(best[1]), float(best[2])


def fit_link(samples: list[tuple[int, float]]) -> Link:
    """`latency + bytes / bw` through (bytes, seconds) points, smallest relative errors, both >= 0."""
    lat, per_byte, _ = _nnls_relative([[1.0, b, 0.0] for b, _ in samples], [t for _, t in samples])
    return Link(1.0 / per_byte, lat)


def main() -> None:
    import torch

    from .model import ModelSpec, load_model

    ap = argparse.ArgumentParser(prog="python -m workers.engine.calibration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--typical", type=float, default=1.1,
                    help="times in the printed profile = measured minimum x this (default 1.1: the typical "
                         "speed on a shared machine, not the undisturbed best)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(ModelSpec(cache_dir=Path(a.cache_dir) if a.cache_dir else None))
    with tempfile.TemporaryDirectory() as tmp:
        core = bench_core(lm, Path(tmp), tokens=16384 + 64)
        try:
            time_prefill(core, ((512, 0),), 2)  # warm-up
            pre = [(n, c, t) for (n, c), t in time_prefill(core, PREFILL_POINTS, a.reps).items()]
            dec = [(b, ctx, t) for (b, ctx), t in time_decode(core, DECODE_POINTS, a.reps).items()]
            bb = core.pool.block_bytes
            loads = {t: [(k * bb, time_load(core, t, k, a.reps, seed=k)) for k in LOAD_BLOCKS] for t in ("CPU", "DISK")}
        finally:
            core.close()
    tps, attn, over = fit_prefill(pre)
    base, per_seq, per_ctx = fit_decode(dec)
    links = {t: fit_link(v) for t, v in loads.items()}
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"# measured {time.strftime('%Y-%m-%d')} by workers/engine/calibration.py, {a.threads} torch thread(s), "
          f"min of {a.reps}, load average {load}")
    for n, c, s in pre:
        model = over + n / tps + attn * n * (c + n / 2)
        print(f"#   prefill n={n:5d} c={c:5d}: {s * 1e3:8.1f} ms, fit {model * 1e3:8.1f} ms ({model / s - 1:+.0%})")
    for b, ctx, s in dec:
        model = base + per_seq * b + per_ctx * ctx
        print(f"#   decode b={b:3d} ctx={ctx:6d}: {s * 1e3:7.2f} ms, fit {model * 1e3:7.2f} ms ({model / s - 1:+.0%})")
    for t, v in loads.items():
        for nbytes, s in v:
            fit = links[t].cost_s(nbytes)
            print(f"#   {t} load of {nbytes // bb} blocks: {s * 1e3:7.2f} ms, fit {fit * 1e3:7.2f} ms")
    k = a.typical
    print(f"# profile values: compute = measured minimums x {k}; links = medians")
    print("compute:")
    print(f"  prefill_tokens_per_s: {tps / k:.1f}")
    print(f"  prefill_attn_s_per_token2: {attn * k:.4g}")
    print(f"  prefill_overhead_s: {over * k:.5f}")
    print(f"  decode_base_s: {base * k:.5f}")
    print(f"  decode_per_seq_s: {per_seq * k:.6f}")
    print(f"  decode_per_ctx_token_s: {per_ctx * k:.4g}")
    for t, link in links.items():
        print(f"{t.lower()}:\n  read_Bps: {link.read_Bps:.4g}\n  latency_s: {link.latency_s:.4g}")


if __name__ == "__main__":
    main()
