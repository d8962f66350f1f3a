"""DISK and REMOTE block stores: throughput and per-call latency for 64 KiB and 2 MiB blocks.

    .venv/bin/python bench/bench_store.py [--mib 256] [--remote-mib 64] [--dir DIR]

DISK (workers/engine/store/disk.py): `put` (into the page cache, fsync at close), `get`
warm (page cache), the start-up scan of a reopened store, and `get` cold (every segment
fsynced and dropped from the page cache with posix_fadvise DONTNEED first; if the kernel
ignores the hint, cold reads as warm). REMOTE (remote.py): `put`/`get` against a
redis-server this script starts on a free 127.0.0.1 port, skipped if there is none.
Medians are per call; MB/s is total payload bytes over total time. Single-threaded.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.engine.store.disk import DiskConfig, DiskStore  # noqa: E402

SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}


def timed(calls: list[Callable[[], object]]) -> tuple[float, float]:
    """(median ms per call, total s)."""
    lat = []
    t_all = time.perf_counter()
    for call in calls:
        t0 = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3, time.perf_counter() - t_all


def line(tier: str, size: str, what: str, n: int, nbytes: int, med_ms: float, total_s: float) -> None:
    print(f"{tier:6} {size:6} {what:10} n={n:5}  median {med_ms:8.3f} ms  {nbytes / total_s / 1e6:9.0f} MB/s")


def blocks(n: int, size: int, seed: int) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    body = os.urandom(size)
    return [(rng.randbytes(32), body) for _ in range(n)]


def drop_page_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_disk(root: Path, label: str, size: int, total: int) -> None:
    n = max(16, total // size)
    data = blocks(n, size, seed=size)
    cfg = DiskConfig(path=root / label, capacity_bytes=4 * total + (256 << 20), admit_after=1)
    store = DiskStore(cfg)
    med, secs = timed([lambda k=k, p=p: store.put(k, b"m" * 64, p) for k, p in data])
    line("DISK", label, "put", n, n * size, med, secs)
    order = [k for k, _ in data]
    random.Random(1).shuffle(order)
    med, secs = timed([lambda k=k: store.get(k) for k in order])
    line("DISK", label, "get warm", n, n * size, med, secs)
    assert store.stats.hits == n, store.stats
    store.close()
    drop_page_cache(sorted((root / label).glob("seg-*.kv")))
    t0 = time.perf_counter()
    store = DiskStore(cfg)
    scan_s = time.perf_counter() - t0
    print(f"DISK   {label:6} reopen     {len(store)} blocks indexed in {scan_s * 1e3:.1f} ms (cold scan)")
    drop_page_cache(sorted((root / label).glob("seg-*.kv")))
    med, secs = timed([lambda k=k: store.get(k) for k in order])
    line("DISK", label, "get cold", n, n * size, med, secs)
    assert store.stats.hits == n, store.stats
    store.close()


@contextmanager
def redis_server(workdir: Path) -> Iterator[int | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        for _ in range(500):
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.01)
        yield port
    finally:
        proc.kill()
        proc.wait()


def bench_remote(port: int, label: str, size: int, total: int) -> None:
    from workers.engine.store.remote import RedisConfig, RedisStore

    n = max(16, total // size)
    data = blocks(n, size, seed=size + 1)
    store: Any = RedisStore(RedisConfig(port=port, group=f"bench-{label}", timeout_s=2.0))
    med, secs = timed([lambda k=k, p=p: store.put(k, b"m" * 64, p) for k, p in data])
    line("REMOTE", label, "put", n, n * size, med, secs)
    order = [k for k, _ in data]
    random.Random(1).shuffle(order)
    med, secs = timed([lambda k=k: store.get(k) for k in order])
    line("REMOTE", label, "get", n, n * size, med, secs)
    assert store.stats.hits == n, store.stats
    store.discard(order)
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="bytes written per DISK case")
    ap.add_argument("--remote-mib", type=int, default=64, help="bytes written per REMOTE case")
    ap.add_argument("--dir", type=Path, default=None, help="where the segment files go (default: a temp dir)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        for label, size in SIZES.items():
            bench_disk(root, label, size, a.mib << 20)
        with redis_server(root) as port:
            if port is None:
                print("REMOTE skipped: no redis-server on PATH (apt-get install -y redis-server)")
                return
            for label, size in SIZES.items():
                bench_remote(port, label, size, a.remote_mib << 20)


if __name__ == "__main__":
    main()
