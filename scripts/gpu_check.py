"""One short check of the real engine's CUDA path, for a machine with a GPU.

    .venv/bin/python scripts/gpu_check.py [--bench-sizes 1024,4096,8192] [--runs 3] [--no-bench]

1. The tier correctness tests on CUDA (tests/engine/test_engine_tiers.py, its `cuda` cases): a
   prefix from GPU, CPU (pinned host memory, D2H on the offload stream), DISK, REMOTE (if
   redis-server is on PATH) and a peer gives the greedy tokens of a full recompute and
   last logits within 1e-3 (fp32); every fault case; prefetch. Each case also runs on CPU
   there; only the CUDA ones are selected here.
2. A tiny TTFT bench on CUDA (bench/bench_engine.py --device cuda, the model's half
   precision): a miss vs a hit from each tier, medians; no RSS section (a GPU pool is not
   in RSS).

Prints both outputs and a one-line verdict; exits non-zero if the tests failed. Takes a few
minutes (most of it the CPU side of the tests' reference forwards and the 8k misses).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-sizes", default="1024,4096,8192")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-bench", action="store_true")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available on this machine; nothing to check")
        return 2
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}",
          flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    tests = subprocess.call(
        [sys.executable, "-m", "pytest", "tests/engine/test_engine_tiers.py", "-k", "cuda", "-q", "-rs",
         "-o", "addopts=", "-p", "no:cacheprovider"], cwd=ROOT, env=env)
    print(f"gpu_check: CUDA tier tests {'passed' if tests == 0 else 'FAILED'} ({time.monotonic() - t0:.0f} s)",
          flush=True)
    bench = 0
    if not a.no_bench:
        t0 = time.monotonic()
        bench = subprocess.call(
            [sys.executable, "bench/bench_engine.py", "--device", "cuda", "--sizes", a.bench_sizes,
             "--runs", str(a.runs), "--threads", "4", "--no-rss"], cwd=ROOT, env=env)
        print(f"gpu_check: CUDA bench {'done' if bench == 0 else 'FAILED'} ({time.monotonic() - t0:.0f} s)",
              flush=True)
    print(f"gpu_check: {'OK' if tests == 0 and bench == 0 else 'FAILED'}")
    return 0 if tests == 0 and bench == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
