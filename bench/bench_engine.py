"""Time to first token of the real engine: a miss vs a prefix hit from each tier.

    .venv/bin/python bench/bench_engine.py [--sizes 1024,4096,8192] [--runs 3] [--threads 1]
        [--model default|DIR] [--device cpu|cuda] [--dtype auto|...] [--budget 2048]
        [--no-remote] [--no-peer] [--no-prefetch] [--no-rss] [--json FILE]

For each prompt size, `runs` fresh prompts. Each is a miss on engine M (every token
prefilled, in chunks of the token budget), then a hit on M from GPU (the same prompt
again), from CPU (its blocks evicted to the CPU tier first) and from DISK (pushed on below
CPU), then a REMOTE hit on engine R, a second engine of the same remote group that never
saw the prompt (M wrote the blocks to Redis as they left its GPU), then a PEER hit on
engine P, which pulls the blocks from a worker process W that computed the prompt (a
`/kv/prefetch` with `source_peer` issued as the request arrives: the request waits for
that pull). A hit reuses every full block but the one holding the last token. TTFT is the
engine's own (`usage.ttft_ms`: arrival -> first token sampled, loads included, no HTTP);
medians of the same run, with the targets at 8k (CPU >= 10x, DISK >= 4x, REMOTE >= 3x
faster than the miss) marked.

Prefetch: a request R with an 8k prefix on DISK (then REMOTE) queued behind a long request
L (a 4k-token miss; one sequence at a time), without and with a `/kv/prefetch` of R's
blocks issued when R arrives: the share of R's load time the prefetch hid behind L.

RSS: the worker process W (GPU pool and CPU tier of configured sizes) after start, and
after traffic filled both: RSS minus the two sizes is the overhead (weights, torch, Python,
activations, page cache of mapped files).

Needs redis-server on PATH for REMOTE (else skipped, said so).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK = 16
TOKEN = "bench-peer-token"
_CHILDREN: list[subprocess.Popen[Any]] = []  # processes this bench started
TARGETS = {"CPU": 10.0, "DISK": 4.0, "REMOTE": 3.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,4096,8192")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a 2-core machine)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--no-remote", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here too")
    a = ap.parse_args()

    import torch

    from workers.engine.core import EngineCore
    from workers.engine.engineconfig import EngineConfig
    from workers.engine.model import ModelSpec, load_model
    from workers.engine.sequence import SamplingParams
    from workers.engine.store.disk import DiskConfig
    from workers.engine.testing import RedisServer, redis_binary
    from workers.engine.tiers import TierConfig

    torch.set_num_threads(a.threads)
    sizes = [int(s) for s in a.sizes.split(",")]
    cache_dir = Path(a.cache_dir) if a.cache_dir else None
    lm = load_model(ModelSpec(model=a.model, device=a.device, dtype=a.dtype, cache_dir=cache_dir))
    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    bb = lm.kv.token_bytes * BLOCK
    need = 2 * max(sizes) // BLOCK + 64
    redis = None
    if not a.no_remote:
        if redis_binary() is None:
            print("REMOTE skipped: no redis-server on PATH")
        else:
            redis = RedisServer(tmp / "redis").start()
            assert redis.proc is not None
            _CHILDREN.append(redis.proc)
    remote_cfg = None
    if redis is not None:
        from workers.engine.store.remote import RedisConfig

        remote_cfg = RedisConfig(port=redis.port, group="bench", timeout_s=2.0)

    def core(**tiers: Any) -> EngineCore:
        tiers.setdefault("peer_token", TOKEN)  # the fleet secret: REMOTE blocks carry a MAC keyed with it
        cfg = TierConfig(cpu_bytes=need * bb, **tiers)
        return EngineCore(lm, EngineConfig(num_blocks=need, max_num_batched_tokens=a.budget, max_num_seqs=1,
                                           tiers=cfg))

    m = core(disk=DiskConfig(tmp / "disk", max(4 * need * bb, 256 << 20), admit_after=1), remote=remote_cfg)
    r = core(remote=remote_cfg) if remote_cfg is not None else None
    p = core(peer_token=TOKEN) if not a.no_peer else None
    sizes = [min(s, m.max_context - 1) for s in sizes]  # 8192 positions: an 8k prompt is 8191 + 1 output
    for c in (m, r, p):
        if c is not None:
            c.calibrate()  # the load-or-recompute cut uses each engine's prefill fit
    worker = None
    rss: dict[str, float] = {}
    if p is not None or not a.no_rss:
        worker = Worker(tmp, a, need, bb)
        rss["start"] = worker.rss()

    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    n = [0]

    def ttft(c: EngineCore, ids: list[int], prefetch: str | None = None, peer: str | None = None) -> Any:
        n[0] += 1
        rid = f"r{n[0]}"
        seq = c.new_sequence(rid, ids, params)
        if prefetch is not None:
            assert c.tiers is not None
            with c.lock:
                c.tiers.prefetch(rid, seq.keys[: seq.cacheable_blocks], 600.0,
                                 peer_url=peer, peer_held=set(seq.keys) if peer else None)
        with c.lock:
            c.add(seq)
        while c.seqs:
            c.step()
        return seq.usage

    def flush(c: EngineCore, below_cpu: bool) -> None:
        assert c.tiers is not None
        with c.lock:
            c.blocks.evict_cached()
        c.tiers.drain()
        if below_cpu:
            c.tiers.demote_all()

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"model {lm.model_id} on {lm.device} ({lm.dtype_name}), {torch.get_num_threads()} threads, "
          f"budget {a.budget} tokens/step, block {BLOCK} ({bb} B), {a.runs} runs, load average {load}")
    tiers = ["GPU", "CPU", "DISK"] + (["REMOTE"] if r is not None else []) + (["PEER"] if p is not None else [])
    results: dict[int, dict[str, Any]] = {}
    for size in sizes:
        t: dict[str, list[float]] = {k: [] for k in ["miss", *tiers]}
        loads: dict[str, list[float]] = {k: [] for k in tiers}
        for _ in range(a.runs):
            ids = [rng.randrange(3, lm.vocab_size) for _ in range(size)]
            if p is not None and worker is not None:
                worker.compute(ids)  # W holds it before anything is timed here (other process, same cores)
            t["miss"].append(ttft(m, ids).ttft_ms)
            for tier in tiers:
                if tier == "CPU":
                    flush(m, False)
                elif tier == "DISK":
                    flush(m, True)
                c = {"REMOTE": r, "PEER": p}.get(tier, m)
                assert c is not None
                u = ttft(c, ids, prefetch="peer" if tier == "PEER" else None,
                         peer=worker.url if tier == "PEER" and worker is not None else None)
                got = u.loaded_tokens[tier]
                if got != (size - 1) // BLOCK * BLOCK:
                    print(f"  warning: {tier} hit at {size} loaded {got} tokens from {tier}: {u.loaded_tokens}")
                t[tier].append(u.ttft_ms)
                loads[tier].append(u.load_ms)
            for c in (r, p):
                if c is not None:
                    with c.lock:
                        c.purge(None, True)
        med = {k: statistics.median(v) for k, v in t.items()}
        results[size] = {"ttft_ms": med, "load_ms": {k: statistics.median(v) for k, v in loads.items()}}
    print_table(results, tiers)

    if not a.no_prefetch:
        results_pf = {}
        for tier, c in (("DISK", m), ("REMOTE", r)):
            if c is not None:
                results_pf[tier] = hidden_by_prefetch(c, m, lm, rng, sizes[-1], tier, ttft, flush, a.runs)
        for tier, res in results_pf.items():
            ok = "met" if res["hidden"] >= 0.8 else "NOT met"
            print(f"prefetch, {tier} prefix of {res['tokens']} tokens behind a {res['long']}-token miss "
                  f"({res['queue_ms']:.0f} ms queued; medians of {res['runs']}): load {res['load_without_ms']:.1f} ms "
                  f"without, {res['load_with_ms']:.1f} ms with prefetch: {100 * res['hidden']:.0f}% hidden "
                  f"(target >= 80%: {ok}); R's TTFT {res['ttft_without_ms']:.0f} -> {res['ttft_with_ms']:.0f} ms, "
                  f"prefill {res['prefill_without_ms']:.1f} -> {res['prefill_with_ms']:.1f} ms; "
                  f"L's TTFT {res['long_ttft_without_ms']:.0f} / {res['long_ttft_with_ms']:.0f} ms")
        for v in results_pf.values():
            v.pop("long", None)
        rss_pf = results_pf
    else:
        rss_pf = {}

    sp = m.speeds()
    links = m.load_report().tiers
    for c in (r, p):
        if c is not None:
            links.update({k: v for k, v in c.load_report().tiers.items() if k in ("REMOTE", "PEER")})
    if sp.prefill_tokens_per_s and sp.prefill_overhead_s is not None and sp.decode_step_s is not None:
        print(f"fitted: prefill {sp.prefill_tokens_per_s:.0f} tok/s, attn {sp.prefill_attn_s_per_token2:.3g} "
              f"s/token^2, overhead {sp.prefill_overhead_s * 1e3:.2f} ms/chunk; "
              f"decode step {sp.decode_step_s * 1e3:.2f} ms")
    print("links (measured, EWMA): " + ", ".join(f"{k} {v.read_Bps / 1e9:.2f} GB/s + {v.latency_s * 1e3:.3f} ms"
                                                 for k, v in links.items()))

    if worker is not None:
        if not a.no_rss:
            rss.update(worker.fill_and_measure(lm.vocab_size, rng))
            print(f"worker RSS: {rss['start'] / 2**20:.0f} MiB after start, {rss['full'] / 2**20:.0f} MiB with GPU "
                  f"pool ({rss['gpu_bytes'] / 2**20:.0f} MiB) and CPU tier ({rss['cpu_bytes'] / 2**20:.0f} MiB, "
                  f"{rss['cpu_used']:.0f}/{rss['cpu_blocks']:.0f} blocks) full, peak {rss['peak'] / 2**20:.0f} MiB: "
                  f"overhead {(rss['full'] - rss['gpu_bytes'] - rss['cpu_bytes']) / 2**20:.0f} MiB "
                  f"(peak {(rss['peak'] - rss['gpu_bytes'] - rss['cpu_bytes']) / 2**20:.0f} MiB)")
        worker.stop()
    for c in (m, r, p):
        if c is not None:
            c.close()
    if redis is not None:
        redis.stop()
    if a.json:
        Path(a.json).write_text(json.dumps({
            "ttft": {str(k): v for k, v in results.items()}, "prefetch": rss_pf, "rss": rss,
            "speeds": {"prefill_tokens_per_s": sp.prefill_tokens_per_s,
                       "prefill_attn_s_per_token2": sp.prefill_attn_s_per_token2,
                       "prefill_overhead_s": sp.prefill_overhead_s, "decode_step_s": sp.decode_step_s},
            "links": {k: {"read_Bps": v.read_Bps, "latency_s": v.latency_s} for k, v in links.items()},
            "load_average": load}, indent=1))


def print_table(results: dict[int, dict[str, Any]], tiers: list[str]) -> None:
    head = f"{'prompt':>7} {'miss ms':>9}" + "".join(f" {t + ' ms':>10} {'x':>6}" for t in tiers)
    print(head)
    for size, res in results.items():
        med = res["ttft_ms"]
        row = f"{size:>7} {med['miss']:>9.1f}"
        for t in tiers:
            row += f" {med[t]:>10.1f} {med['miss'] / med[t]:>5.1f}x"
        print(row)
    print("load_ms (median): " + "; ".join(
        f"{size}: " + ", ".join(f"{t} {res['load_ms'][t]:.1f}" for t in tiers) for size, res in results.items()))
    last = max(results)
    med = results[last]["ttft_ms"]
    for t, want in TARGETS.items():
        if t in med:
            got = med["miss"] / med[t]
            print(f"target at {last}: {t} hit >= {want:.0f}x faster than a miss: {got:.1f}x "
                  f"{'met' if got >= want else 'NOT met'}")


def hidden_by_prefetch(c: Any, m: Any, lm: Any, rng: random.Random, size: int, tier: str, ttft: Any,
                       flush: Any, runs: int) -> dict[str, Any]:
    """R (an 8k prefix on `tier` only) queued behind a 4k miss L on engine `c` (one sequence at
    a time), without then with a prefetch of R's blocks issued when R arrives; medians of `runs`."""
    from workers.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    ids = [rng.randrange(3, lm.vocab_size) for _ in range(size)]
    ttft(m, ids)  # M computes R's prompt: its blocks go down to DISK, and to REMOTE as they leave GPU
    flush(m, True)
    long = min(4096, size)
    samples: dict[str, list[float]] = {}
    for i in range(runs):
        for with_prefetch in (False, True):
            long_ids = [rng.randrange(3, lm.vocab_size) for _ in range(long)]
            lseq = c.new_sequence(f"L{i}{with_prefetch}{tier}", long_ids, params)
            rseq = c.new_sequence(f"R{i}{with_prefetch}{tier}", ids, params)
            with c.lock:
                c.add(lseq)
                c.add(rseq)
                if with_prefetch:
                    keys = rseq.keys[: rseq.cacheable_blocks]
                    c.tiers.prefetch(f"pf{i}{tier}", keys, 600.0,
                                     remote_present=set(keys) if tier == "REMOTE" else None)
            while c.seqs:
                c.step()
            u = rseq.usage
            if u.loaded_tokens[tier] != (size - 1) // BLOCK * BLOCK:
                print(f"  warning: prefetch experiment, {tier}: loaded {u.loaded_tokens}")
            key = "with" if with_prefetch else "without"
            for name, v in (("load", u.load_ms), ("ttft", u.ttft_ms), ("queue", u.queue_ms),
                            ("prefill", u.prefill_ms), ("long_ttft", lseq.usage.ttft_ms)):
                samples.setdefault(f"{name}_{key}_ms", []).append(v)
            flush(c, True)  # R's prefix off the device and off CPU again: on `tier` only
    out: dict[str, Any] = {k: statistics.median(v) for k, v in samples.items()}
    out.update(tokens=(size - 1) // BLOCK * BLOCK, long=long, runs=runs, queue_ms=out["queue_without_ms"])
    out["hidden"] = 1.0 - out["load_with_ms"] / out["load_without_ms"] if out["load_without_ms"] > 0 else 0.0
    return out


class Worker:
    """The worker process W: `python -m workers.cli engine` with a GPU pool and a CPU tier of
    known sizes and a peer token (the PEER source, and the process whose RSS is measured)."""

    def __init__(self, tmp: Path, a: argparse.Namespace, num_blocks: int, block_bytes: int) -> None:
        self.gpu_blocks = num_blocks
        self.cpu_blocks = 2 * num_blocks
        self.block_bytes = block_bytes
        cmd = [sys.executable, "-m", "workers.cli", "engine", "--port", "0", "--model", a.model,
               "--num-blocks", str(num_blocks), "--cpu-bytes", str(self.cpu_blocks * block_bytes),
               "--max-num-batched-tokens", str(a.budget), "--max-num-seqs", "1", "--threads", str(a.threads),
               "--peer-token", TOKEN, "--no-calibrate", "--worker-id", "W"]
        if a.cache_dir:
            cmd += ["--cache-dir", a.cache_dir]
        if a.device:
            cmd += ["--device", a.device]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     cwd=Path(__file__).resolve().parent.parent)
        _CHILDREN.append(self.proc)
        assert self.proc.stdout is not None
        self.url = ""
        deadline = time.monotonic() + 300
        for line in self.proc.stdout:
            if line.startswith("worker "):
                self.url = line.split("url=")[1].split()[0]
            if line.strip() == "ready" or time.monotonic() > deadline:
                break
        if not self.url:
            raise RuntimeError("the worker process did not start")

    def post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def compute(self, ids: list[int]) -> None:
        self.post("/v1/completions", {"prompt": ids, "max_tokens": 1, "ignore_eos": True})

    def rss(self, field: str = "VmRSS") -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) * 1024
        return 0.0

    def fill_and_measure(self, vocab: int, rng: random.Random) -> dict[str, float]:
        """Distinct prompts until the GPU pool and the CPU tier are full, then RSS."""
        n = 0
        while n < 20 * (self.gpu_blocks + self.cpu_blocks) // 2048 + 8:
            load = self.get("/load")["blocks"]
            if load["CPU"]["used"] >= load["CPU"]["capacity"] - 64:
                break
            self.compute([rng.randrange(3, vocab) for _ in range(2048)])
            n += 1
        load = self.get("/load")["blocks"]
        return {"full": self.rss(), "peak": self.rss("VmHWM"), "gpu_bytes": float(self.gpu_blocks * self.block_bytes),
                "cpu_bytes": float(self.cpu_blocks * self.block_bytes), "cpu_used": float(load["CPU"]["used"]),
                "cpu_blocks": float(load["CPU"]["capacity"]), "fill_requests": float(n)}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        main()
    finally:  # a failed run must not leave its worker process or its redis-server behind
        for proc in _CHILDREN:
            if proc.poll() is None:
                proc.kill()
