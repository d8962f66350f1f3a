"""Two gateway replicas behind a round-robin balancer versus one: do they herd?

    .venv/bin/python bench/bench_replicas.py [--workers 4] [--bursts 8] [--burst-size 48] [--groups 4]
        [--prefix-tokens 3000] [--gap-s 2.0] [--rounds 2] [--json FILE]

Each replica keeps its own index and in-flight counts; what another replica just sent
reaches it only through the workers' `/load` (polled every `pool.load_poll_interval_s`)
and KV events. The risk is herding: two replicas picking the same worker for a burst,
each blind to the other's dispatches. This measures it on a simulated fleet
(`sim-cluster`, H200 Llama-3.1-8B profile, virtual GPUs on real time) with a bursty
shared-prefix workload: every `gap_s`, `burst_size` streaming requests at once, each a
prefix of one of `groups` hot groups plus its own question.

Configurations, interleaved over `rounds` (fresh prefixes per run; a gateway process per
replica, started for the run and stopped after it):
- `one`: one replica behind the balancer;
- `two`: two replicas behind the balancer, which hands each new TCP connection to the
  next replica in turn (the client opens a connection per request, so per request).
Measured per run: TTFT at the client (p50, p95, mean), per burst the requests each
worker got (max / mean over workers; median over bursts), and each worker's queue
(waiting + running, from `/load` every 20 ms): max / mean over workers, its mean and p90
over the samples in which the fleet held at least one request per worker. Printed: one
row per run, then medians per configuration and the ratios.
Everything on 127.0.0.1, bounded (count, HTTP timeouts), every process stopped at exit.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from loadtest.harden.procs import Procs  # noqa: E402

PROFILE = "h200-llama3.1-8b"
# (name, gateway processes, routing.replicas each is told): two-blind counts only its own dispatches
CONFIGS = (("one", 1, 1), ("two", 2, 2), ("two-blind", 2, 1))
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
VOCAB = ("alpha beta gamma delta epsilon kv cache route block prefix token worker queue tier load "
         "north south east west river stone cloud light").split()


# ---------------------------------------------------------------------- processes


def gateway_config(urls: list[str], replicas: int = 1) -> dict[str, Any]:
    return {
        "models": [{"id": MODEL, "served_names": ["llama-3.1-8b"],
                    "tokenizer": str(ROOT / "configs/assets/tiny-tokenizer"), "profile": PROFILE}],
        "workers": [{"id": f"s{i}", "url": u} for i, u in enumerate(urls)],
        "routing": {"policy": "kv_cost", "replicas": replicas},
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.5},
        "observability": {"log_level": "WARNING", "request_log": False},
        "shutdown": {"grace_s": 0.0, "drain_timeout_s": 5.0},
    }


# ---------------------------------------------------------------------- the balancer


class RoundRobin:
    """An L4 balancer: each accepted connection is piped to the next backend in turn."""

    def __init__(self, backends: list[int]) -> None:
        self.next = itertools.cycle(backends)
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", next(self.next))
        except OSError:
            cw.close()
            return
        await asyncio.gather(_pipe(cr, uw), _pipe(ur, cw), return_exceptions=True)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()


# ---------------------------------------------------------------------- one run


@dataclass
class RunResult:
    config: str
    ttft_ms: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    burst_ratio: list[float] = field(default_factory=list)  # per burst: max/mean requests per worker
    queue_p90_ratio: float = 0.0
    queue_mean_ratio: float = 0.0
    per_worker: dict[str, int] = field(default_factory=dict)

    def fail(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def row(self) -> dict[str, Any]:
        t = sorted(self.ttft_ms)
        q = statistics.quantiles(t, n=100) if len(t) > 1 else [t[0]] * 99 if t else [0.0] * 99
        return {"config": self.config, "requests": len(t), "errors": self.errors, "error_kinds": self.error_kinds,
                "ttft_p50_ms": round(statistics.median(t), 1) if t else None,
                "ttft_p95_ms": round(q[94], 1), "ttft_mean_ms": round(statistics.fmean(t), 1) if t else None,
                "burst_max_over_mean": round(statistics.median(self.burst_ratio), 3) if self.burst_ratio else None,
                "queue_mean_max_over_mean": round(self.queue_mean_ratio, 3),
                "queue_p90_max_over_mean": round(self.queue_p90_ratio, 3), "per_worker": self.per_worker}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


async def one_request(url: str, prompt: str, res: RunResult, burst: dict[str, int]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
    t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=60)) as s, \
                s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.fail(f"{r.status} {(await r.read())[:120]!r}")
                return
            wid = r.headers.get("x-kvroute-worker", "?")
            first = None
            async for _ in r.content.iter_any():
                if first is None:
                    first = time.monotonic()
            if first is None:
                res.fail("empty stream")
                return
            res.ttft_ms.append((first - t0) * 1000)
            burst[wid] = burst.get(wid, 0) + 1
            res.per_worker[wid] = res.per_worker.get(wid, 0) + 1
    except (aiohttp.ClientError, TimeoutError) as e:
        res.fail(type(e).__name__)


async def sample_queues(urls: list[str], stop_at: list[bool], out: list[list[int]]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while not stop_at[0]:
            row = []
            for u in urls:
                try:
                    async with s.get(u + "/load") as r:
                        d = await r.json()
                    row.append(int(d.get("waiting_requests", 0)) + int(d.get("running_requests", 0)))
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    row.append(0)
            out.append(row)
            await asyncio.sleep(0.02)


async def run_once(config: str, replicas: int, urls: list[str], a: argparse.Namespace, seed: int,
                   procs: Procs, count_replicas: int = 1) -> RunResult:
    gws = [procs.gateway(gateway_config(urls, count_replicas), name=f"gw-{config}-{seed}-{i}")
           for i in range(replicas)]
    rr = RoundRobin([g.port for g in gws])
    try:
        await rr.start()
        base = f"http://127.0.0.1:{rr.port}"
        rng = random.Random(seed)
        prefixes = [words(rng, a.prefix_tokens) for _ in range(a.groups)]
        res = RunResult(config)
        samples: list[list[int]] = []
        done = [False]
        sampler = asyncio.get_running_loop().create_task(sample_queues(urls, done, samples))
        for b in range(a.bursts):
            burst: dict[str, int] = {}
            prompts = [prefixes[rng.randrange(a.groups)] + f" question {b}-{i}: " + words(rng, 20)
                       for i in range(a.burst_size)]
            t_burst = time.monotonic()
            await asyncio.gather(*(one_request(base, p, res, burst) for p in prompts))
            counts = [burst.get(f"s{i}", 0) for i in range(len(urls))]
            if sum(counts):
                res.burst_ratio.append(max(counts) / statistics.fmean(counts))
            await asyncio.sleep(max(0.0, a.gap_s - (time.monotonic() - t_burst)))
        done[0] = True
        await sampler
        # Samples with at least one request per worker on average: an idle fleet's ratio says nothing.
        ratios = sorted(max(r) / statistics.fmean(r) for r in samples if statistics.fmean(r) >= 1.0)
        res.queue_p90_ratio = ratios[int(0.9 * (len(ratios) - 1))] if ratios else 0.0
        res.queue_mean_ratio = statistics.fmean(ratios) if ratios else 0.0
        return res
    finally:
        await rr.close()
        for g in gws:
            procs.stop(g.proc)


def median_of(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] is not None]
    return float(statistics.median(vals)) if vals else float("nan")


async def main_async(a: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-replicas-") as d:
        tmp = Path(d)
        procs = Procs(tmp)
        try:
            urls = [w.url for w in procs.sim_cluster(a.workers, PROFILE, timeout=120).workers]
            seed = 1000
            for rnd in range(a.rounds):
                order = CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]
                for config, n, counted in order:
                    seed += 1
                    r = (await run_once(config, n, urls, a, seed, procs, counted)).row()
                    r["round"] = rnd
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        finally:
            procs.close()
    keys = ("ttft_p50_ms", "ttft_p95_ms", "ttft_mean_ms", "burst_max_over_mean", "queue_mean_max_over_mean",
            "queue_p90_max_over_mean")
    names = [c for c, _, _ in CONFIGS]
    med = {c: {k: median_of([r for r in rows if r["config"] == c], k) for k in keys} for c in names}
    print("\nmedians over rounds:")
    print(f"{'config':10}" + "".join(f"{k:>26}" for k in keys))
    for c in names:
        print(f"{c:10}" + "".join(f"{med[c][k]:>26.3f}" for k in keys))
    ratio = {c: {k: med[c][k] / med["one"][k] if med["one"][k] else float("nan") for k in keys} for c in names[1:]}
    for c in names[1:]:
        print(f"{c + '/one':10}" + "".join(f"{ratio[c][k]:>26.3f}" for k in keys))
    errors = sum(r["errors"] for r in rows)
    print(f"errors: {errors}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "medians": med, "ratios": ratio, "args": vars(a)},
                                           indent=1))
    return 1 if errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--bursts", type=int, default=8)
    ap.add_argument("--burst-size", type=int, default=48)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="words per shared prefix (~1 token each)")
    ap.add_argument("--gap-s", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not (1 <= a.bursts <= 100 and 1 <= a.burst_size <= 512 and 1 <= a.rounds <= 10):
        ap.error("bounded: --bursts 1..100, --burst-size 1..512, --rounds 1..10")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return asyncio.run(main_async(a))


if __name__ == "__main__":
    sys.exit(main())
