"""Router CPU per request and added TTFT: kvroute beside sglang-router and vllm-router, one run.

One simulated fleet (`python -m workers.cli sim-cluster --workers 4 --profile
h200-llama3.1-8b`), one open-loop load: streaming chat requests at a fixed rate
(300/s) for a bounded time, with `max_tokens` 8 (short streams) and, separately, 512
(long streams, at a lower rate: a 512-token stream lasts ~3.5 s on this profile).
The same load goes to the workers directly (round robin by the load generator) and
through each router:

- kvroute (`kvroute serve`) with `kv_cost` and with `round_robin`;
- sglang-router 0.3.2 with `cache_aware` and `round_robin`;
- vllm-router 0.1.17 with `cache_aware` and `round_robin`.

The peers are installed from PyPI into a venv of their own, outside the checkout
(~/.cache/kvroute/peers-venv, or $KVROUTE_PEERS_VENV; made on first use, shared with
bench_vllm_routers.py); a router that cannot be installed or started is skipped with a message.
Every router runs with its per-request logging off (log level warning) so none pays
for writing log lines.

Measured per (router, round): the router's CPU from its process tree's utime + stime
(/proc), over the whole window in which its load ran, divided by the requests it
served (background work such as load polls and health checks included); TTFT p50/p99
(request sent to the first event carrying generated text: a worker's role-only first
chunk, which it sends before prefill, is not a token) and errors (non-200, an error
event, a stream without `[DONE]`, a connection failure). Rounds are interleaved
(direct, then every router; the next round in reverse router order) and each figure
is the median over rounds. Method and results: bench/notes/performance.md. The load generator is
a separate process (aiohttp on uvloop, keep-alive); it reports the rate it actually
offered and how late its sends were, and a round in which it fell behind is flagged.

Everything listens on 127.0.0.1 only and every process started here is stopped at
exit.

    .venv/bin/python bench/bench_router_cpu.py [--rounds 3] [--seconds 20] [--rate 300]
        [--long-rate 20] [--long-seconds 10] [--only kvroute,sglang,vllm] [--lengths 8,512]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from loadtest.ports import free_port  # noqa: E402

PROFILE = "h200-llama3.1-8b"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TOKENIZER = ROOT / "configs/assets/tiny-tokenizer"
PEERS_VENV = Path(os.environ.get("KVROUTE_PEERS_VENV") or Path.home() / ".cache/kvroute/peers-venv")
PEERS = {"sglang": "sglang-router==0.3.2", "vllm": "vllm-router==0.1.17"}
WORDS = ("route the request to the worker that holds the prefix blocks of this long conversation "
         "and measure what each router spends per request while the cache stays warm on every node").split()


# ---------------------------------------------------------------------------------------- load


def _messages(rng: random.Random, systems: list[str], user_words: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": rng.choice(systems)},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(user_words))}]


async def _load(spec: dict[str, Any]) -> dict[str, Any]:
    """Open loop: request i is sent at t0 + i / rate, whatever the earlier ones are doing."""
    import aiohttp

    rng = random.Random(spec["seed"])
    srng = random.Random(7)
    systems = [" ".join(srng.choice(WORDS) for _ in range(spec["system_words"])) for _ in range(spec["systems"])]
    n = int(spec["rate"] * spec["seconds"])
    bodies = [json.dumps({"model": MODEL, "messages": _messages(rng, systems, spec["user_words"]),
                          "max_tokens": spec["max_tokens"], "stream": True, "temperature": 0.0,
                          "ignore_eos": True}).encode() for _ in range(n)]
    urls = [u + "/v1/chat/completions" for u in spec["urls"]]
    hdrs = {"content-type": "application/json"}
    ttft: list[float] = []
    lag: list[float] = []
    errors: dict[str, int] = {}

    def err(kind: str) -> None:
        errors[kind] = errors.get(kind, 0) + 1

    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=spec["request_timeout_s"])
    async with aiohttp.ClientSession(connector=conn, timeout=timeout, auto_decompress=False) as s:
        async def one(i: int, at: float) -> None:
            lag.append(time.monotonic() - at)
            t0 = time.monotonic()
            first = None
            tail = head = b""
            try:
                async with s.post(urls[i % len(urls)], data=bodies[i], headers=hdrs) as r:
                    if r.status != 200:
                        await r.read()
                        err(f"http_{r.status}")
                        return
                    async for data in r.content.iter_any():
                        if first is None:
                            head += data
                            if _first_token(head):
                                first = time.monotonic() - t0
                        if b'"error"' in data and (b'data: {"error"' in data or b'"object":"error"' in data):
                            err("error_event")
                            return
                        tail = (tail + data)[-64:]
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                err(type(e).__name__)
                return
            if b"data: [DONE]" not in tail:
                err("no_done")
                return
            if first is not None:
                ttft.append(first)

        c0 = time.process_time()
        t_start = time.monotonic() + 0.05
        tasks = []
        for i in range(n):
            at = t_start + i / spec["rate"]
            d = at - time.monotonic()
            if d > 0:
                await asyncio.sleep(d)
            tasks.append(asyncio.ensure_future(one(i, at)))
        sent_s = time.monotonic() - t_start
        await asyncio.gather(*tasks)
        cpu = time.process_time() - c0
        wall = time.monotonic() - t_start
    lag.sort()
    return {"n": n, "ok": len(ttft), "p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99), "errors": errors,
            "offered_rate": n / max(sent_s, 1e-9),
            "lag_p99_ms": lag[int(0.99 * (len(lag) - 1))] * 1000 if lag else 0.0,
            "loadgen_cpu_share": cpu / max(wall, 1e-9)}


def _first_token(buf: bytes) -> bool:
    """Whether the stream so far holds an event with generated text. A vLLM-style server
    (and our worker) sends a role-only chunk (`"content":""`) before prefill: that is no
    token, and the gateway sends its own only with the first token, so TTFT counts from
    the first event whose `content` is not empty."""
    for ev in buf.split(b"\n\n")[:-1]:
        i = ev.find(b'"content":"')
        if ev.startswith(b"data:") and i >= 0 and ev[i + 11 : i + 12] != b'"':
            return True
    return False


def _loadgen_main(spec_json: str, out: str) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    res = asyncio.run(_load(json.loads(spec_json)))
    Path(out).write_text(json.dumps(res))  # a file: the loop may leave stdout non-blocking
    return 0


# ------------------------------------------------------------------------------ processes


def _tree_cpu_s(pid: int) -> tuple[float, float]:
    """(utime + stime, stime), reaped children's included, of `pid` and every live descendant."""
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            f = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(d)] = f
        kids.setdefault(int(f[1]), []).append(int(d))
    total, system, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        f = stats.get(p)
        if f is None:
            continue
        total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
        system += int(f[12]) + int(f[14])
        todo.extend(kids.get(p, []))
    return total / tick, system / tick


@dataclass
class Target:
    name: str
    url: str  # "" for direct
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    rounds: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


class Procs:
    """Every process started here, stopped at exit (process groups: their children too)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, argv: list[str], log: Path | None, **kw: Any) -> subprocess.Popen[Any]:
        out = open(log, "wb") if log is not None else subprocess.DEVNULL
        p = subprocess.Popen(argv, cwd=kw.pop("cwd", ROOT), stdout=kw.pop("stdout", out), stderr=out,
                             start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)


def _peers_python() -> Path | None:
    """PEERS_VENV with the two Rust routers, made on first use; None when it cannot be."""
    py = PEERS_VENV / "bin/python"
    have = py.exists() and subprocess.run(
        [str(py), "-c", "import sglang_router, vllm_router"], capture_output=True).returncode == 0
    if have:
        return py
    print(f"installing {', '.join(PEERS.values())} into {PEERS_VENV} ...", flush=True)
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True, capture_output=True)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *PEERS.values()], capture_output=True, text=True,
                           timeout=900)
    except (subprocess.SubprocessError, OSError) as e:
        print(f"!!! cannot make the peers' venv ({e}): sglang-router and vllm-router are SKIPPED", flush=True)
        return None
    if r.returncode != 0:
        print(f"!!! pip could not install the peers (sglang-router and vllm-router are SKIPPED):\n{r.stderr[-2000:]}",
              flush=True)
        return None
    return py


def _start_fleet(procs: Procs, workers: int, cwd: Path = ROOT) -> list[str]:
    """The simulated fleet, run from the tree at `cwd`; its workers' URLs."""
    p = procs.start([sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", str(workers), "--profile",
                     PROFILE, "--base-port", "0", "--host", "127.0.0.1", "--tokenizer", str(TOKENIZER),
                     "--log-level", "WARNING"], None, stdout=subprocess.PIPE, cwd=cwd)
    urls = []
    assert p.stdout is not None
    for raw in p.stdout:
        w = raw.decode().split()
        if w and w[0] == "worker":
            urls.append(next(x[4:] for x in w if x.startswith("url=")))
        if w == ["ready"]:
            break
    if len(urls) != workers:
        raise SystemExit("the simulated fleet did not start")
    return urls


def _kvroute(procs: Procs, tmp: Path, policy: str, workers: list[str], cwd: Path = ROOT) -> Target:
    """`kvroute serve` with `policy` in front of `workers`, run from the tree at `cwd`."""
    import yaml

    port = free_port()
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"id": MODEL, "tokenizer": str(TOKENIZER), "profile": PROFILE}],
        "workers": [{"id": f"w{i}", "url": u} for i, u in enumerate(workers)],
        "routing": {"policy": policy},
        "observability": {"log_level": "WARNING"},
    }
    path = tmp / f"kvroute-{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp / f"kvroute-{policy}.log"
    p = procs.start([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)], log, cwd=cwd)
    return Target(f"kvroute {policy}", f"http://127.0.0.1:{port}", p, log)


def _peer(procs: Procs, tmp: Path, py: Path, which: str, policy: str, workers: list[str]) -> Target:
    port = free_port()
    log = tmp / f"{which}-{policy}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if which == "sglang":
        argv = [str(py), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    else:
        argv = [str(py.parent / "vllm-router"), *common, "--log-level", "warning"]
    p = procs.start(argv, log, env=env)
    ver = PEERS[which].split("==")[1]
    return Target(f"{which}-router {ver} {policy}", f"http://127.0.0.1:{port}", p, log)


async def _ready(t: Target, timeout: float) -> bool:
    import aiohttp

    deadline = time.monotonic() + timeout
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if t.proc is not None and t.proc.poll() is not None:
                return False
            try:
                async with s.post(t.url + "/v1/chat/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=5)) as r:
                    await r.read()
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.3)
    return False


# ------------------------------------------------------------------------------ running


def _drive(t: Target, workers: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    spec = {**spec, "urls": workers if t.proc is None else [t.url]}
    cpu0 = _tree_cpu_s(t.proc.pid) if t.proc is not None else (0.0, 0.0)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--loadgen", json.dumps(spec), f.name],
                           cwd=ROOT, capture_output=True, text=True,
                           timeout=spec["seconds"] + spec["request_timeout_s"] + 60)
        if r.returncode != 0:
            raise SystemExit(f"load generator failed:\n{r.stderr[-3000:]}")
        res: dict[str, Any] = json.loads(Path(f.name).read_text())
    res["cpu_us"] = res["sys_share"] = None
    if t.proc is not None:
        cpu1 = _tree_cpu_s(t.proc.pid)
        res["cpu_us"] = (cpu1[0] - cpu0[0]) / max(1, res["n"]) * 1e6
        res["sys_share"] = (cpu1[1] - cpu0[1]) / max(1e-9, cpu1[0] - cpu0[0])
    return res


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    cpu = [r["cpu_us"] for r in rounds if r["cpu_us"] is not None]
    return {
        "cpu_us": statistics.median(cpu) if cpu else None, "cpu_min": min(cpu) if cpu else None,
        "cpu_max": max(cpu) if cpu else None,
        "sys_share": statistics.median(r["sys_share"] for r in rounds) if cpu else None,
        "p50": statistics.median(r["p50"] * 1000 for r in rounds),
        "p99": statistics.median(r["p99"] * 1000 for r in rounds),
        "errors": sum(sum(r["errors"].values()) for r in rounds),
        "error_kinds": {k: sum(r["errors"].get(k, 0) for r in rounds) for r in rounds for k in r["errors"]},
        "n": sum(r["n"] for r in rounds),
        "offered": statistics.median(r["offered_rate"] for r in rounds),
        "lag_p99_ms": max(r["lag_p99_ms"] for r in rounds),
        "loadgen_cpu": max(r["loadgen_cpu_share"] for r in rounds),
    }


def _table(targets: list[Target], mt: int, rate: float, seconds: float, rounds: int) -> dict[str, dict[str, Any]]:
    sums = {t.name: _summary(t.rounds[mt]) for t in targets if t.rounds.get(mt)}
    d = sums.get("direct")
    print(f"\n== max_tokens {mt}: {rate:g} streaming chat req/s for {seconds:g} s, {rounds} interleaved rounds "
          f"(medians; CPU min–max over rounds)")
    print(f"{'router':34s} {'CPU µs/req':>11s} {'(min–max)':>14s} {'TTFT p50':>9s} {'p99':>8s} {'+p50':>7s} "
          f"{'kernel':>7s} {'errors':>7s} {'offered/s':>10s} {'send lag p99':>13s}")
    for name, s in sums.items():
        cpu = f"{s['cpu_us']:,.0f}" if s["cpu_us"] is not None else "–"
        rng = f"{s['cpu_min']:,.0f}–{s['cpu_max']:,.0f}" if s["cpu_us"] is not None else ""
        add = f"{s['p50'] - d['p50']:+.1f}" if d else ""
        ker = f"{100 * s['sys_share']:.0f}%" if s["sys_share"] is not None else "–"
        print(f"{name:34s} {cpu:>11s} {rng:>14s} {s['p50']:9.1f} {s['p99']:8.1f} {add:>7s} {ker:>7s} {s['errors']:7d} "
              f"{s['offered']:10.1f} {s['lag_p99_ms']:10.1f} ms")
        if s["errors"]:
            print(f"{'':34s} errors: {s['error_kinds']}")
        if s["offered"] < 0.97 * rate or s["lag_p99_ms"] > 20:
            print(f"{'':34s} !!! the load generator fell behind here: the offered load is below the target")
    kv = sums.get("kvroute kv_cost")
    sg = next((s for n, s in sums.items() if n.startswith("sglang-router") and n.endswith("cache_aware")), None)
    if kv and sg and kv["cpu_us"] and sg["cpu_us"]:
        print(f"kvroute kv_cost / sglang-router cache_aware CPU per request: {kv['cpu_us'] / sg['cpu_us']:.2f}×"
              f" (target ≤ 1.0×, stretch ≤ 0.7×)")
    if kv and d:
        print(f"kvroute kv_cost TTFT p50 added over direct: {kv['p50'] - d['p50']:+.2f} ms (target ≤ 2 ms)")
    return sums


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--loadgen":
        return _loadgen_main(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=300.0, help="requests/s for short streams")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of load per round, short streams")
    ap.add_argument("--long-rate", type=float, default=20.0, help="requests/s for long streams")
    ap.add_argument("--long-seconds", type=float, default=10.0)
    ap.add_argument("--lengths", default="8,512", help="max_tokens values, comma-separated")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--only", default="kvroute,sglang,vllm", help="routers to run, comma-separated")
    ap.add_argument("--policies", default="", help="only these policies (e.g. kv_cost,cache_aware)")
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",") if x]
    only = set(a.only.split(","))
    pols = set(a.policies.split(",")) if a.policies else None
    procs = Procs()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        with tempfile.TemporaryDirectory(prefix="bench-router-cpu-") as td:
            tmp = Path(td)
            workers = _start_fleet(procs, a.workers)
            print(f"fleet: {a.workers} simulated {PROFILE} workers", flush=True)
            targets = [Target("direct", "")]
            for pol in ("kv_cost", "round_robin"):
                if "kvroute" in only and (pols is None or pol in pols):
                    targets.append(_kvroute(procs, tmp, pol, workers))
            py = _peers_python() if only & {"sglang", "vllm"} else None
            for which in ("sglang", "vllm"):
                if which in only and py is not None:
                    for pol in ("cache_aware", "round_robin"):
                        if pols is None or pol in pols:
                            targets.append(_peer(procs, tmp, py, which, pol, workers))
            live = []
            for t in targets:
                if t.proc is None or asyncio.run(_ready(t, 90.0)):
                    live.append(t)
                    continue
                tail = t.log.read_text(errors="replace")[-1500:] if t.log and t.log.exists() else ""
                print(f"!!! {t.name} did not start or answer; SKIPPED. Its log ends:\n{tail}", flush=True)
            targets = live
            base = {"systems": 8, "system_words": a.system_words, "user_words": a.user_words,
                    "request_timeout_s": 120.0}
            for t in targets:  # warm every path (connections, caches of the shared system prompts)
                _drive(t, workers, {**base, "seed": 999, "rate": 50.0, "seconds": 2.0, "max_tokens": 8})
            sums: dict[str, Any] = {}
            for mt in lengths:
                rate, secs = (a.rate, a.seconds) if mt <= 64 else (a.long_rate, a.long_seconds)
                for rnd in range(a.rounds):
                    order = targets if rnd % 2 == 0 else [targets[0], *reversed(targets[1:])]
                    for t in order:
                        spec = {**base, "seed": 1000 * mt + rnd, "rate": rate, "seconds": secs, "max_tokens": mt}
                        r = _drive(t, workers, spec)
                        t.rounds.setdefault(mt, []).append(r)
                        cpu = f"{r['cpu_us']:,.0f} µs/req" if r["cpu_us"] is not None else ""
                        print(f"  max_tokens {mt} round {rnd + 1}: {t.name:34s} {cpu:>14s} "
                              f"p50 {r['p50'] * 1000:6.1f} ms  errors {sum(r['errors'].values())}",
                              flush=True)
                        time.sleep(1.0)
                sums[str(mt)] = _table(targets, mt, rate, secs, a.rounds)
            if a.json is not None:
                a.json.write_text(json.dumps(sums, indent=1))
    finally:
        procs.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
