"""Routers in front of real vLLM-CPU servers (or of our engine workers): kvroute against
sglang-router and vllm-router.

    .venv/bin/python bench/bench_vllm_routers.py --trace TRACES/mooncake_conversation_first_half.jsonl \\
        [--engine vllm|ours] [--rounds 3] [--requests 240] [--rate 2.0] \\
        [--routers kvroute,sglang,vllm_cache,vllm_kv,vllm_rr] [--json FILE] [--requests-out FILE.jsonl] \\
        [--max-seconds 3600]

What a new user would try: two vLLM-CPU servers (the slow tests' venv and tiny Llama;
prefix caching, block 32, KV events, 4,096 blocks each, one OpenMP thread each pinned to
its own core) registered with kvroute as `kind: vllm` with no `cost:` settings, and the
same servers behind the Rust routers. The trace is a Mooncake conversation slice: each
512-token hash block becomes 32 tokens (one-word tokens in the chat text the replay
writes), prompts of at most 512 tokens, 16 output tokens, streamed chat, its arrivals
scaled to `--rate` requests/s (about half busy servers at the default).

Each round runs every router once, in an order rotated per round (interleaved rounds);
before each run both servers' prefix caches are reset (`POST /reset_prefix_cache`, dev
mode) and the router is started fresh. Per run: TTFT p50/p90/p99/mean at the client,
failures, the servers' prefix-cache hit rate over the run (their own counters), the
router's CPU seconds (its process tree), and for kvroute the retries and the chosen
worker's prediction |error| after the first 50 requests. The table gives the median of
the rounds per router. Everything binds 127.0.0.1; every process is stopped at exit.

`--engine ours`: the same with two of our engine workers (bench/engine_fleet.py: the bundled
tiny Llama, block 32, 4,096 blocks, one torch thread each pinned to its own core) in place of
the vLLM servers, registered with kvroute as `kind: kvroute` with no `cost:` and no profile;
caches reset by the workers' purge, the hit rate from their own counters.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
import vllm_harness as vh  # noqa: E402
from engine_fleet import EngineFleet, metric_sums  # noqa: E402  (the same directory: a sibling module)

from loadtest.mooncake import load_mooncake  # noqa: E402
from loadtest.ports import free_port  # noqa: E402
from loadtest.replay import ReplayConfig, Replayer  # noqa: E402
from loadtest.results import RequestResult  # noqa: E402
from loadtest.tokens import TokenSynth  # noqa: E402
from loadtest.trace import Trace, TraceRequest  # noqa: E402

PEERS_VENV = Path(os.environ.get("KVROUTE_PEERS_VENV") or Path.home() / ".cache/kvroute/peers-venv")
PEERS = {"sglang": "sglang-router==0.3.2", "vllm": "vllm-router==0.1.17"}
BLOCK = 32  # tokens per mapped hash block (512 in the trace)
MAX_PROMPT = 512
OUTPUT = 16
WARMUP_SKIP = 50  # prediction error is judged after this many requests


@dataclass
class Run:
    router: str
    round: int
    ttft_ms: list[float]
    failures: int
    hit_rate: float
    cpu_s: float
    retries: int | None = None
    pred_err: list[float] | None = None
    requests: list[RequestResult] | None = None  # for --requests-out


# ------------------------------------------------------------------------------ trace


def mapped_trace(path: str, requests: int, rate: float) -> Trace:
    """The issue's slice: 32 tokens per hash block, prompts <= 512 tokens, 16 output tokens,
    the first `requests` of them at `rate` requests/s on average."""
    src = load_mooncake(path)
    reqs: list[TraceRequest] = []
    for r in src.requests:
        n = math.ceil(r.input_length * BLOCK / 512)
        if n <= MAX_PROMPT:
            reqs.append(replace(r, index=len(reqs), input_length=n, output_length=OUTPUT))
        if len(reqs) >= requests:
            break
    span = reqs[-1].arrival_s - reqs[0].arrival_s or 1.0
    k = (len(reqs) / rate) / span
    t0 = reqs[0].arrival_s
    reqs = [replace(r, arrival_s=(r.arrival_s - t0) * k) for r in reqs]
    return Trace("mooncake-32", BLOCK, reqs, source=path, sharing="trace")


# ------------------------------------------------------------------------------ processes


class Procs:
    def __init__(self) -> None:
        self.items: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        out = open(log, "ab")  # noqa: SIM115 (kept open for the child's life)
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
        self.items.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)

    def stop_all(self) -> None:
        for p in reversed(self.items):
            self.stop(p)


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its descendants (alive ones)."""
    total, todo = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except (OSError, IndexError, ValueError):
            continue
        todo += [int(k) for k in kids]
    return total


def vllm_counters(url: str) -> tuple[float, float]:
    """(prefix cache hits, queries) in tokens, from a server's /metrics."""
    return metric_sums(url, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


class Fleet(Protocol):
    """The servers the routers are put in front of: vLLM's (VllmFleet) or ours
    (bench/engine_fleet.py); the runs and the report only see this."""

    kind: str
    served_name: str  # what clients send as `model`

    def start(self) -> None: ...

    @property
    def urls(self) -> list[str]: ...

    def reset(self) -> None: ...

    def counters(self) -> tuple[float, float]: ...

    def kvroute_model(self) -> dict[str, Any]: ...

    def kvroute_workers(self) -> list[dict[str, Any]]: ...

    def stop(self) -> None: ...


class VllmFleet:
    """Two vLLM-CPU servers of the tiny Llama (prefix caching, block 32, KV events, 4,096
    blocks, one OpenMP thread each pinned to its own core, dev mode for the cache reset)."""

    kind = "vllm"
    served_name = vh.SERVED_NAME

    def __init__(self, py: Path, tmp: Path, n: int = 2) -> None:
        self.py, self.tmp, self.n = py, tmp, n
        self.model = tmp / "model"
        self.servers: list[vh.VllmServer] = []

    def start(self) -> None:
        """Builds the model folder, starts the servers and waits until all are healthy."""
        vh.tiny_model_folder_in(self.py, self.model)
        for i in range(self.n):
            opts = vh.ServerOptions(num_blocks=4096, dev_mode=True, extra_env=(
                ("VLLM_CPU_OMP_THREADS_BIND", str(i % (os.cpu_count() or 1))), ("OMP_NUM_THREADS", "1")))
            self.servers.append(vh.start_server(self.py, self.model, self.tmp, f"vllm{i}", opts))
        vh.wait_healthy(self.servers)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def reset(self) -> None:
        for s in self.servers:
            req = urllib.request.Request(s.url + "/reset_prefix_cache", method="POST", data=b"")
            urllib.request.urlopen(req, timeout=30).read()

    def counters(self) -> tuple[float, float]:
        both = [vllm_counters(s.url) for s in self.servers]
        return sum(h for h, _ in both), sum(q_ for _, q_ in both)

    def kvroute_model(self) -> dict[str, Any]:
        return {"id": vh.SERVED_NAME, "tokenizer": str(self.model), "max_context_tokens": 4096,
                "namespace": {"block_size": 16}}

    def kvroute_workers(self) -> list[dict[str, Any]]:
        return [{"id": f"v{i}", "url": s.url, "kind": "vllm", "block_size": vh.BLOCK_SIZE,
                 "events": {"endpoint": s.events_endpoint, "replay_endpoint": s.replay_endpoint}}
                for i, s in enumerate(self.servers)]

    def stop(self) -> None:
        for s in self.servers:
            vh.stop_server(s)


# ------------------------------------------------------------------------------ routers


def peers_python() -> Path | None:
    py = PEERS_VENV / "bin/python"
    ok = py.exists() and subprocess.run([str(py), "-c", "import sglang_router, vllm_router"],
                                        capture_output=True).returncode == 0
    if ok:
        return py
    print(f"installing {', '.join(PEERS.values())} into {PEERS_VENV} ...", flush=True)
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True, capture_output=True)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *PEERS.values()], capture_output=True,
                           text=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as e:
        print(f"!!! cannot install the peer routers ({e}): they are SKIPPED", flush=True)
        return None
    if r.returncode != 0:
        print(f"!!! pip could not install the peer routers: SKIPPED\n{r.stderr[-1500:]}", flush=True)
        return None
    return py


def kvroute_argv(tmp: Path, port: int, fleet: Fleet, policy: str) -> list[str]:
    import yaml

    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [fleet.kvroute_model()],
        "workers": fleet.kvroute_workers(),
        "routing": {"policy": policy},
        "observability": {"log_level": "WARNING", "request_log": False},
    }
    path = tmp / f"kvroute-{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)]


def peer_argv(py: Path, which: str, policy: str, port: int, urls: list[str]) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
              "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if which == "sglang":
        return [str(py), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    return [str(py.parent / "vllm-router"), *common, "--log-level", "warning"]


ROUTERS = {
    "kvroute": ("kvroute", "kv_cost"),
    "kvroute_rr": ("kvroute", "round_robin"),
    "sglang": ("sglang", "cache_aware"),
    "vllm_cache": ("vllm", "cache_aware"),
    "vllm_rr": ("vllm", "round_robin"),
}


def router_argv(name: str, tmp: Path, port: int, fleet: Fleet, peers: Path | None) -> list[str] | None:
    which, policy = ROUTERS[name]
    if which == "kvroute":
        return kvroute_argv(tmp, port, fleet, policy)
    if peers is None:
        return None
    return peer_argv(peers, which, policy, port, fleet.urls)


async def ready(url: str, proc: subprocess.Popen[bytes], model: str, timeout: float) -> bool:
    import aiohttp

    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                async with s.post(url + "/v1/chat/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=30)) as r:
                    await r.read()
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    return False


def kvroute_retries(url: str) -> int:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    n = 0.0
    for line in text.splitlines():
        if line.startswith("kvroute_upstream_errors_total{"):
            n += float(line.rsplit(" ", 1)[1])
    return int(n)


# ------------------------------------------------------------------------------ one run


def one_run(name: str, rnd: int, trace: Trace, synth: TokenSynth, fleet: Fleet, peers: Path | None,
            procs: Procs, tmp: Path) -> Run | None:
    port = free_port()
    argv = router_argv(name, tmp, port, fleet, peers)
    if argv is None:
        return None
    fleet.reset()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = procs.start(argv, tmp / f"{name}-{rnd}.log", env)
    url = f"http://127.0.0.1:{port}"
    try:
        if not asyncio.run(ready(url, p, fleet.served_name, 120.0)):
            print(f"!!! {name} did not become ready (log {tmp / f'{name}-{rnd}.log'})", flush=True)
            return None
        time.sleep(2.0)  # kvroute: its join probes end; every router: an idle start
        fleet.reset()
        hits0, queries0 = fleet.counters()
        cpu0 = tree_cpu_s(p.pid)
        cfg = ReplayConfig(url=url, endpoint="chat", model=fleet.served_name, concurrency=512,
                           request_timeout_s=120.0, grace_s=60.0, progress=False)
        results: list[RequestResult] = asyncio.run(Replayer(trace, synth, cfg, label=name).run())
        cpu = tree_cpu_s(p.pid) - cpu0
        hits1, queries1 = fleet.counters()
        hits, queries = hits1 - hits0, queries1 - queries0
        ok = [r for r in results if r.ok]
        run = Run(name, rnd, [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None], len(results) - len(ok),
                  hits / queries if queries else 0.0, cpu, requests=results)
        if ROUTERS[name][0] == "kvroute":
            run.retries = kvroute_retries(url)
            run.pred_err = [abs(r.ttft_s - r.predicted_ttft_s) / r.ttft_s for r in ok[WARMUP_SKIP:]
                            if r.predicted_ttft_s is not None and r.ttft_s]
        return run
    finally:
        procs.stop(p)


# ------------------------------------------------------------------------------ report


def write_requests(path: Path, r: Run) -> None:
    """Append a run's requests as JSON lines: what the prediction error is made of."""
    with path.open("a") as f:
        for q_ in r.requests or []:
            f.write(json.dumps({"router": r.router, "round": r.round, "index": q_.index, "worker": q_.worker,
                                "arrival_s": q_.arrival_s, "ttft_ms": None if q_.ttft_s is None else q_.ttft_s * 1e3,
                                "predicted_ms": None if q_.predicted_ttft_s is None else q_.predicted_ttft_s * 1e3,
                                "prompt_tokens": q_.prompt_tokens, "cached_tokens": q_.cached_tokens,
                                "status": q_.status}) + "\n")


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))] if s else float("nan")


def row(r: Run) -> dict[str, Any]:
    t = r.ttft_ms
    out: dict[str, Any] = {"router": r.router, "round": r.round, "p50": q(t, 0.5), "p90": q(t, 0.9),
                           "p99": q(t, 0.99), "mean": statistics.fmean(t) if t else float("nan"),
                           "failures": r.failures, "hit_rate": r.hit_rate, "cpu_s": r.cpu_s}
    if r.retries is not None:
        out["retries"] = r.retries
    if r.pred_err:
        out["pred_err_p50"] = q(r.pred_err, 0.5)
        out["pred_err_p90"] = q(r.pred_err, 0.9)
    return out


def print_table(rows: list[dict[str, Any]], names: list[str]) -> None:
    keys = ("p50", "p90", "p99", "mean", "failures", "hit_rate", "cpu_s", "retries", "pred_err_p50", "pred_err_p90")
    print("\nmedian of rounds per router (TTFT ms at the client)")
    print("router        " + "".join(f"{k:>13}" for k in keys))
    for n in names:
        mine = [r for r in rows if r["router"] == n]
        if not mine:
            continue
        cells = []
        for k in keys:
            vals = [r[k] for r in mine if k in r]
            cells.append(f"{statistics.median(vals):>13.3f}" if vals else f"{'-':>13}")
        print(f"{n:<14}" + "".join(cells))


def sim_check(url: str, trace: Trace, tmp: Path) -> Path | None:
    """Calibrate server 0 into a simulator profile and simulate the slice on two such
    workers with round robin; returns the simulator's results file (None: it failed)."""
    from loadtest.calibrate import run_calibrate
    from loadtest.mooncake import dump_mooncake

    prof = tmp / "calibrated.yaml"
    m = run_calibrate(url, prof, base_profile="tiny-cpu", name="calibrated", model=vh.SERVED_NAME,
                      lengths=(32, 128, 256, 512), repeats=3)
    print(f"calibrated server 0: overhead {m.overhead_s * 1e3:.1f} ms + {m.prefill_tokens_per_s:.0f} tokens/s, "
          f"decode steps {', '.join(f'{b}: {v * 1e3:.1f} ms' for b, v in sorted(m.decode_steps.items()))}", flush=True)
    sl = tmp / "slice.jsonl"
    dump_mooncake(trace, sl)
    out = tmp / "sim"
    r = subprocess.run([sys.executable, "-m", "loadtest.cli", "simulate", "--trace", str(sl), "--block-tokens",
                        str(BLOCK), "--workers", "2", "--profile", str(prof), "--policies", "round_robin",
                        "--no-ideal", "--no-plots", "--transport", "local-http", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        print(f"!!! the simulation failed:\n{r.stderr[-1500:]}", flush=True)
        return None
    return out / "results.jsonl"


def sim_ttfts(path: Path) -> list[float]:
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if d.get("ttft_s") is not None and d.get("run", "").startswith("round_robin"):
            out.append(d["ttft_s"] * 1e3)
    return out


def run_rounds(args: argparse.Namespace, names: list[str], trace: Trace, synth: TokenSynth, fleet: Fleet,
               peers: Path | None, procs: Procs, tmp: Path, rows: list[dict[str, Any]], t_end: float) -> None:
    """Every router once per round, in an order rotated per round, until `t_end` (monotonic)."""
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for n in order:
            if time.monotonic() > t_end:
                print("!!! --max-seconds reached", flush=True)
                return
            r = one_run(n, rnd, trace, synth, fleet, peers, procs, tmp)
            if r is not None:
                rows.append(row(r))
                if args.requests_out:
                    write_requests(Path(args.requests_out), r)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in rows[-1].items()}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="Mooncake conversation JSONL (512-token hash blocks)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second")
    ap.add_argument("--routers", default="kvroute,sglang,vllm_cache,vllm_rr")
    ap.add_argument("--engine", choices=["vllm", "ours"], default="vllm",
                    help="what the routers front: two vLLM-CPU servers, or two of our engine workers "
                         "(bench/engine_fleet.py; registered with kvroute with no cost and no profile)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-seconds", type=float, default=3600.0)
    ap.add_argument("--requests-out", default=None,
                    help="also write every request (router, round, worker, TTFT, prediction, tokens) as JSON lines")
    ap.add_argument("--sim-check", action="store_true",
                    help="also calibrate server 0 into a simulator profile, simulate the slice with round robin "
                         "and compare its TTFT p50/p90 with the real round-robin runs (vllm_rr)")
    args = ap.parse_args()
    names = [n for n in args.routers.split(",") if n]
    bad = [n for n in names if n not in ROUTERS]
    if bad or args.rounds < 1 or args.requests < WARMUP_SKIP + 10 or args.rate <= 0:
        ap.error(f"unknown routers {bad}" if bad else "need rounds >= 1, requests >= 60, rate > 0")
    trace = mapped_trace(args.trace, args.requests, args.rate)
    synth = TokenSynth.for_trace(trace, vocab_size=8192)
    peers = peers_python() if any(ROUTERS[n][0] != "kvroute" for n in names) else None
    rows: list[dict[str, Any]] = []
    sim: list[float] = []
    t_end = time.monotonic() + args.max_seconds
    with tempfile.TemporaryDirectory(prefix="kvroute-vllm-bench-") as d:
        tmp = Path(d)
        fleet: Fleet = VllmFleet(vh.require_vllm(), tmp) if args.engine == "vllm" else EngineFleet(2, tmp)
        procs = Procs()
        try:
            fleet.start()
            sim_file = sim_check(fleet.urls[0], trace, tmp) if args.sim_check else None
            sim = sim_ttfts(sim_file) if sim_file is not None else []
            print(f"2 {fleet.kind} servers up; {len(trace.requests)} requests over "
                  f"{trace.requests[-1].arrival_s:.0f} s", flush=True)
            run_rounds(args, names, trace, synth, fleet, peers, procs, tmp, rows, t_end)
        finally:
            procs.stop_all()
            fleet.stop()
    print_table(rows, names)
    if args.sim_check and sim:
        real = [r for r in rows if r["router"] == "vllm_rr"]
        if real:
            rp50 = statistics.median(r["p50"] for r in real)
            rp90 = statistics.median(r["p90"] for r in real)
            sp50, sp90 = q(sim, 0.5), q(sim, 0.9)
            print(f"\nsim-to-real (round robin): simulated p50 {sp50:.1f} / p90 {sp90:.1f} ms, "
                  f"real p50 {rp50:.1f} / p90 {rp90:.1f} ms: ratios {sp50 / rp50:.2f} / {sp90 / rp90:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
