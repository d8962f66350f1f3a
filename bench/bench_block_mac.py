"""Cost of the keyed MAC on blocks leaving a worker (workers/engine/store/mac.py) next to
the crc32 every record already carries, per block, for the tiny model's blocks and an
8B-class model's.

    .venv/bin/python bench/bench_block_mac.py [--runs 7] [--calls 50]

Block sizes: the bundled tiny Llama (16 tokens x 4 layers x K/V x 2 heads x 64 dims x
fp32 = 64 KiB) and Llama-3-8B in bf16 (16 tokens x 128 KiB = 2 MiB). Measured: zlib.crc32
of the payload (what `record.encode` computes, once per record), `BlockMac.tag` (the
writer's cost) and `BlockMac.verify` (the reader's), plus keyed BLAKE2b, the stdlib
alternative, for comparison. Each run times `--calls` calls on random bytes; the figure is
the median over runs of the per-call median, single-threaded, same process, same data.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.engine.store.mac import BlockMac  # noqa: E402

SIZES = {"tiny 64 KiB": 64 << 10, "8B bf16 2 MiB": 2 << 20}


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    return statistics.median(lat) * 1e6


def measure(mac: BlockMac, size: int, runs: int, calls: int) -> dict[str, float]:
    """Median over `runs` of the per-call median of each function, on one random block."""
    scope, key, meta = b"REMOTE\0kvroute-0123456789abcdef01234567:g0:", os.urandom(32), os.urandom(120)
    bkey = os.urandom(32)
    payload = os.urandom(size)
    tag = mac.tag(scope, key, meta, payload)
    fns: dict[str, Callable[[], object]] = {
        "crc": lambda: zlib.crc32(payload, zlib.crc32(meta)),
        "tag": lambda: mac.tag(scope, key, meta, payload),
        "verify": lambda: mac.verify(scope, key, meta, payload, tag),
        "blake2b": lambda: hashlib.blake2b(payload, key=bkey, digest_size=32).digest(),
    }
    got: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():  # interleaved: a noisy neighbour hits every column alike
            got[k].append(per_call_us(fn, calls))
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    mac = BlockMac(os.urandom(32).hex())
    print(f"{'block':<15} {'crc32 us':>9} {'MAC tag us':>11} {'verify us':>10} {'blake2b us':>11} "
          f"{'tag/crc':>8} {'MAC GB/s':>9}")
    for name, size in SIZES.items():
        med = measure(mac, size, a.runs, a.calls)
        print(f"{name:<15} {med['crc']:>9.1f} {med['tag']:>11.1f} {med['verify']:>10.1f} {med['blake2b']:>11.1f} "
              f"{med['tag'] / med['crc']:>7.2f}x {size / med['tag'] / 1e3:>9.2f}")

if __name__ == "__main__":
    main()
