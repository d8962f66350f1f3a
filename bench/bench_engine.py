"""Time to first token of the real engine (stage 1: GPU tier only): a miss vs a GPU prefix hit.

    .venv/bin/python bench/bench_engine.py [--sizes 1024,4096,8192] [--runs 3] [--threads N]
        [--model default|DIR] [--device cpu|cuda] [--dtype auto|...] [--budget 2048]

For each prompt size: `runs` fresh prompts (a miss: every token prefilled, in chunks of
the token budget), each followed by the same prompt again (a hit: every full block but the
one holding the last token comes from the pool, the rest is recomputed). TTFT is the
engine's own (`usage.ttft_ms`: queued → first token sampled, no HTTP), medians printed
as a table, with the speeds the engine fitted from its own timings.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,4096,8192")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--cache-dir", default=None)
    a = ap.parse_args()

    import torch

    from workers.engine.core import EngineConfig, EngineCore
    from workers.engine.model import ModelSpec, load_model
    from workers.engine.sequence import SamplingParams

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    sizes = [int(s) for s in a.sizes.split(",")]
    lm = load_model(ModelSpec(model=a.model, device=a.device, dtype=a.dtype,
                              cache_dir=Path(a.cache_dir) if a.cache_dir else None))
    need = 2 * max(sizes) // 16 + 64
    core = EngineCore(lm, EngineConfig(num_blocks=need, max_num_batched_tokens=a.budget, max_num_seqs=1))
    sizes = [min(s, core.max_context - 1) for s in sizes]  # 8192 positions: an 8k prompt is 8191 + 1 output
    core.calibrate()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def ttft(rid: str, ids: list[int]) -> tuple[float, int]:
        seq = core.new_sequence(rid, ids, params)
        core.add(seq)
        while core.seqs:
            core.step()
        return seq.usage.ttft_ms, seq.usage.cached_tokens

    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"model {lm.model_id} on {lm.device} ({lm.dtype_name}), {torch.get_num_threads()} threads, "
          f"budget {a.budget} tokens/step, block 16, {a.runs} runs, load average {' '.join(load)}")
    print(f"{'prompt':>7} {'miss ms':>9} {'hit ms':>8} {'cached':>7} {'speed-up':>9} {'miss tok/s':>11}")
    n = 0
    for size in sizes:
        miss, hit, cached = [], [], 0
        for _ in range(a.runs):
            ids = [rng.randrange(3, lm.vocab_size) for _ in range(size)]
            miss.append(ttft(f"m{n}", ids)[0])
            t, cached = ttft(f"h{n}", ids)
            hit.append(t)
            n += 1
        m, h = statistics.median(miss), statistics.median(hit)
        print(f"{size:>7} {m:>9.1f} {h:>8.1f} {cached:>7} {m / h:>8.1f}x {size / m * 1e3:>11.0f}")
    sp = core.speeds()
    if sp.prefill_tokens_per_s and sp.prefill_overhead_s is not None and sp.decode_step_s is not None:
        print(f"fitted: prefill {sp.prefill_tokens_per_s:.0f} tok/s, attn {sp.prefill_attn_s_per_token2:.3g} "
              f"s/token^2, overhead {sp.prefill_overhead_s * 1e3:.2f} ms/chunk; "
              f"decode step {sp.decode_step_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
