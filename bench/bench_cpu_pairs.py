"""Gateway CPU per request of a change against its base, in alternating pairs of runs.

On a shared 2-core host CPU figures move by ±20% between runs, more than most single changes to
the gateway; what a change buys shows only when its runs alternate with the base's under
the same load. Each run starts the simulated fleet and `kvroute serve` (`kv_cost`) from
one tree (the base: `git archive` of `--base` into a temporary folder, with this tree's
venv; the change: this working tree), warms it, drives bench_router_cpu.py's load
(streaming chat, `--max-tokens` at `--rate` for `--seconds`) and stops it. Prints each
pair's CPU µs per request, kernel share and errors, and the ratios' median.

    .venv/bin/python bench/bench_cpu_pairs.py --base HEAD~1 [--pairs 3] [--max-tokens 512 --rate 20 --seconds 10]
    .venv/bin/python bench/bench_cpu_pairs.py --base HEAD --max-tokens 8 --rate 300 --seconds 15
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_router_cpu as rc  # noqa: E402


def _base_tree(rev: str, into: Path) -> Path:
    """`rev`'s files under `into`, using this tree's venv (the interpreter is this one)."""
    tree = into / "base"
    tree.mkdir()
    tar = into / "base.tar"
    with open(tar, "wb") as f:
        subprocess.run(["git", "archive", rev], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(tar) as t:
        t.extractall(tree, filter="data")
    return tree


def _run(tree: Path, tmp: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """One run from `tree`: fleet and gateway started, warmed, loaded, stopped."""
    procs = rc.Procs()
    try:
        workers = rc._start_fleet(procs, 4, cwd=tree)
        t = rc._kvroute(procs, tmp, "kv_cost", workers, cwd=tree)
        if not asyncio.run(rc._ready(t, 90.0)):
            raise SystemExit(f"the gateway from {tree} did not start; its log: {t.log}")
        rc._drive(t, workers, {**spec, "seed": 999, "rate": min(spec["rate"], 50.0), "seconds": 2.0})
        return rc._drive(t, workers, spec)
    finally:
        procs.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree with")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of load per run")
    a = ap.parse_args()
    spec = {"systems": 8, "system_words": 200, "user_words": 40, "request_timeout_s": 120.0,
            "max_tokens": a.max_tokens, "rate": a.rate, "seconds": a.seconds}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-cpu-pairs-") as td:
        tmp = Path(td)
        base = _base_tree(a.base, tmp)
        print(f"base {a.base} against the working tree: max_tokens {a.max_tokens}, {a.rate:g} req/s for "
              f"{a.seconds:g} s, {a.pairs} pairs", flush=True)
        for i in range(a.pairs):
            got = {}
            for side, tree in (("base", base), ("change", ROOT)):
                r = _run(tree, tmp, {**spec, "seed": i})
                got[side] = r["cpu_us"]
                print(f"  pair {i + 1} {side:6s}: {r['cpu_us']:8,.0f} µs/req  kernel {100 * r['sys_share']:3.0f}%  "
                      f"TTFT p50 {r['p50'] * 1000:5.1f} ms  errors {sum(r['errors'].values())}", flush=True)
            ratios.append(got["change"] / got["base"])
        print(f"change / base, per pair: {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
