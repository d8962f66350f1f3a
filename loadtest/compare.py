"""Does the offline simulator tell the truth? The same trace slice, the same fleet,
the same policy — once on the virtual clock, once for real over HTTP — and the p50
TTFT of each policy compared (the acceptance bound is 10%).

The HTTP side runs what a user would run, as separate processes: `python -m
workers.cli sim-cluster` (N simulated workers with the same profile, block size and
one REMOTE group, restarted for each policy so every run starts cold, as the offline
one does) and the gateway (`python -m kvroute.cli serve` with a generated config
naming those workers and the policy). Routing decisions are the gateway's own — the
replay only sends the trace (token ids, open loop) to its OpenAI endpoint.

Both sides measure TTFT from the moment a request is issued. The offline side models
the HTTP path with `RouterSettings`' transport (`--offline-transport local-http`:
intake, large-body lag, jitter, fixed cost, as bench/transport_probe.py measured them
on a 2-core CPU host); `none` is the pure model. A loaded machine inflates the HTTP side: run
it on an otherwise idle host.
"""
from __future__ import annotations

import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from .fleet import FleetSpec
from .ports import free_port
from .replay import ReplayConfig, run_replay
from .report import latency_table, write_report
from .results import ResultsWriter, Run, read_runs
from .router_model import TRANSPORTS, RouterSettings
from .simulate import SimSettings, Simulation
from .summary import pct, summarize
from .tokens import TokenSynth
from .trace import Trace, TraceError

REPO = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class CompareConfig:
    policies: list[str] = field(default_factory=lambda: ["round_robin", "kv_cost"])
    workers: int = 4
    profile: str = "h200-llama3.1-8b"
    speed: float = 1.0
    block_size: int | None = None
    tolerance: float = 0.10
    seed: int = 0
    vocab_size: int = 8192
    base_port: int = 0
    python: str = sys.executable
    remote_groups: int = 1
    ready_timeout_s: float = 90.0
    # The offline side's model of the HTTP path (router_model.TRANSPORTS) and how many
    # draws of its jitter to take: the offline p50 is their median (see module doc).
    transport: str = "local-http"
    offline_seeds: int = 9
    http_runs: int = 1
    arrival_log: str | None = None  # the sim cluster's --arrival-log (bench/transport_probe.py)
    # The gateway's own queue on both sides (routing.gateway_queue; RouterSettings): off
    # unless `hold_target_s` is set.
    hold_target_s: float | None = None
    gateway_order: str = "fifo"
    max_hold_s: float = 20.0

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise TraceError(f"unknown transport {self.transport!r}; known: {', '.join(sorted(TRANSPORTS))}")
        if not 1 <= self.offline_seeds <= 99 or not 1 <= self.http_runs <= 9:
            raise TraceError("offline_seeds must be in 1..99 and http_runs in 1..9")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=5)


def cluster_env() -> dict[str, str]:
    """The sim cluster's environment: a fresh peer token, so its workers export blocks to
    each other and advertise `peer_pull` (as `kvroute up` starts them). Without it the
    gateway never plans a peer pull while the offline side does, and the two runs differ
    in what they can reuse, not only in transport."""
    return {**os.environ, "KVROUTE_PEER_TOKEN": secrets.token_urlsafe(24)}


def _start_cluster(cfg: CompareConfig, log: Path) -> tuple[subprocess.Popen[str], list[str]]:
    cmd = [cfg.python, "-m", "workers.cli", "sim-cluster", "--workers", str(cfg.workers), "--profile", cfg.profile,
           "--base-port", str(cfg.base_port), "--host", "127.0.0.1", "--remote-groups", str(cfg.remote_groups)]
    if cfg.block_size:
        cmd += ["--block-size", str(cfg.block_size)]
    if cfg.arrival_log:
        cmd += ["--arrival-log", cfg.arrival_log]
    proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=cluster_env())
    urls: list[str] = []
    deadline = time.monotonic() + cfg.ready_timeout_s
    assert proc.stdout is not None
    with log.open("a") as f:
        while True:
            if time.monotonic() > deadline:
                _stop(proc)
                raise TraceError(f"sim-cluster not ready after {cfg.ready_timeout_s:.0f}s (log: {log})")
            line = proc.stdout.readline()
            if not line:
                raise TraceError(f"sim-cluster exited with {proc.wait()} (log: {log})")
            f.write(line)
            words = line.split()
            if words == ["ready"]:
                break
            if words and words[0] == "worker":
                urls += [w[4:] for w in words[2:] if w.startswith("url=")]
    # Keep draining its output so it never blocks on a full pipe.
    import threading

    def drain() -> None:
        with log.open("a") as f2:
            for ln in proc.stdout:  # type: ignore[union-attr]
                f2.write(ln)

    threading.Thread(target=drain, daemon=True).start()
    return proc, urls


def _gateway_config(cfg: CompareConfig, policy: str, urls: list[str], port: int) -> dict[str, object]:
    model: dict[str, object] = {"id": _profile_model(cfg.profile), "tokenizer": str(REPO / "configs" / "assets" /
                                                                                    "tiny-tokenizer"),
                                "profile": cfg.profile}
    if cfg.block_size:
        model["namespace"] = {"block_size": cfg.block_size}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [model],
        "workers": [{"id": f"w{i}", "url": u, "kind": "kvroute"} for i, u in enumerate(urls)],
        "routing": {"policy": policy, **_queue_config(cfg)},
        "observability": {"log_level": "WARNING"},
    }


def _queue_config(cfg: CompareConfig) -> dict[str, object]:
    if cfg.hold_target_s is None:
        return {}
    return {"gateway_queue": {"hold_target_s": cfg.hold_target_s, "order": cfg.gateway_order,
                              "max_hold_s": cfg.max_hold_s}}


def _profile_model(profile: str) -> str:
    from workers.sim import load_profile

    return load_profile(profile).model


def _start_gateway(cfg: CompareConfig, conf: Path, port: int, log: Path, n_workers: int) -> subprocess.Popen[str]:
    f = log.open("a")
    proc = subprocess.Popen([cfg.python, "-m", "kvroute.cli", "serve", "--config", str(conf)], cwd=str(REPO),
                            stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + cfg.ready_timeout_s
    url = f"http://127.0.0.1:{port}/ready"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TraceError(f"the gateway exited with {proc.returncode} (log: {log})")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    time.sleep(1.0)  # let every worker's first load report and event stream arrive
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    _stop(proc)
    raise TraceError(f"the gateway was not ready after {cfg.ready_timeout_s:.0f}s (log: {log})")


def offline_run(trace: Trace, cfg: CompareConfig, policy: str, synth: TokenSynth, seed: int = 0) -> Run:
    """One offline run with the configured transport model and jitter seed `seed`."""
    st = SimSettings(
        fleet=FleetSpec(workers=cfg.workers, profile=cfg.profile, tiers="all", block_size=cfg.block_size,
                        remote_groups=cfg.remote_groups),
        router=_router_settings(cfg, seed),
        speed=cfg.speed,
        vocab_size=cfg.vocab_size,
        seed=cfg.seed,
    )
    return Simulation(trace, policy, st, label=f"sim:{policy}", synth=synth).run()


def _router_settings(cfg: CompareConfig, seed: int) -> RouterSettings:
    rs = RouterSettings().with_transport(cfg.transport, seed)
    if cfg.hold_target_s is None:
        return rs
    return replace(rs, gateway_order=cfg.gateway_order, hold_target_s=cfg.hold_target_s, max_hold_s=cfg.max_hold_s)


def offline_median_run(trace: Trace, cfg: CompareConfig, policy: str, synth: TokenSynth) -> tuple[Run, list[float]]:
    """`offline_seeds` draws of the transport's jitter; returns the draw with the median
    p50 TTFT (the lower middle for an even count) and every draw's p50, in seed order.
    A transport without jitter is deterministic: one draw."""
    tr = TRANSPORTS[cfg.transport]
    k = cfg.offline_seeds if tr["route_jitter_s"] or tr["burst_jitter_s"] else 1
    runs = [offline_run(trace, cfg, policy, synth, seed) for seed in range(k)]
    p50s = [summarize(r).ttft["p50"] for r in runs]
    mid = sorted(range(k), key=lambda i: (p50s[i], i))[(k - 1) // 2]
    run = runs[mid]
    run.meta.params["transport"] = {"name": cfg.transport, "seed": mid, "seed_p50_s": p50s}
    return run, p50s


def http_run(trace: Trace, cfg: CompareConfig, policy: str, synth: TokenSynth, out: Path,
             writer: ResultsWriter, label: str | None = None) -> None:
    label = label or f"http:{policy}"
    log = out / f"{label.replace(':', '-').replace('#', '-')}.log"
    cluster, urls = _start_cluster(cfg, log)
    gw: subprocess.Popen[str] | None = None
    try:
        if len(urls) != cfg.workers:
            raise TraceError(f"sim-cluster announced {len(urls)} workers, expected {cfg.workers}")
        port = free_port()
        conf = out / f"gateway-{policy}.yaml"
        conf.write_text(yaml.safe_dump(_gateway_config(cfg, policy, urls, port)))
        gw = _start_gateway(cfg, conf, port, log, len(urls))
        rc = ReplayConfig(url=f"http://127.0.0.1:{port}", model=_profile_model(cfg.profile), speed=cfg.speed,
                          concurrency=1024, progress=False)
        run_replay(trace, synth, rc, label=label, writer=writer,
                   meta_extra={"policy": policy, "workers": cfg.workers, "profile": cfg.profile})
    finally:
        if gw is not None:
            _stop(gw)
        _stop(cluster)


def _per_request_diff(runs: list[Run], pol: str) -> tuple[float, float, float]:
    """Percentiles of (HTTP TTFT − offline TTFT) over the requests both answered: the
    transport/host overhead the simulator leaves out, request by request."""
    by = {r.meta.run: {x.index: x for x in r.results if x.ok} for r in runs}
    a, b = by.get(f"sim:{pol}", {}), by.get(f"http:{pol}", {})
    d = [b[i].ttft_s - a[i].ttft_s for i in a.keys() & b.keys()]  # type: ignore[operator]
    if not d:
        return float("nan"), float("nan"), float("nan")
    return pct(d, 10), pct(d, 50), pct(d, 90)


def _worker_side_p50(runs: list[Run], pol: str) -> float:
    """p50 of the TTFT the workers themselves report over HTTP (arrival at the worker to
    first token): separates the simulator's model error from gateway + transport costs."""
    for r in runs:
        if r.meta.run == f"http:{pol}":
            v = [(x.queue_ms + x.load_ms + x.prefill_ms) / 1000.0 for x in r.results
                 if x.ok and x.queue_ms is not None and x.load_ms is not None and x.prefill_ms is not None]
            return pct(v, 50)
    return float("nan")


def _http_label(pol: str, k: int) -> str:
    return f"http:{pol}" if k == 0 else f"http:{pol}#{k + 1}"


def run_compare(trace: Trace, cfg: CompareConfig, out: Path, http_from: Path | None = None) -> bool:
    """Both sides per policy; prints the table and a PASS/FAIL line per policy.

    The offline p50 is the median over `offline_seeds` draws of the transport model's
    jitter and the HTTP p50 the median over `http_runs` replays: on a bursty trace one
    draw of the order inside a burst moves a 300-request p50 by 15-25% on both sides
    (loadtest/README.md), so single draws would compare noise.

    `http_from`: a results.jsonl of an earlier compare; its HTTP runs are reused, not
    re-run (to re-check a changed offline model against the same measurements)."""
    out.mkdir(parents=True, exist_ok=True)
    synth = TokenSynth.for_trace(trace, vocab_size=cfg.vocab_size, seed=cfg.seed)
    res = out / "results.jsonl"
    if http_from is not None and http_from.resolve() == res.resolve():
        raise TraceError("--http-from must not be the output's own results.jsonl")
    earlier = {r.meta.run: r for r in read_runs(http_from)} if http_from is not None else {}
    offline_p50s: dict[str, list[float]] = {}
    with ResultsWriter(res) as w:
        for pol in cfg.policies:
            run, p50s = offline_median_run(trace, cfg, pol, synth)
            offline_p50s[pol] = p50s
            w.write_run(run.meta, run.results)
            print(f"offline {pol} ({cfg.transport}, {len(p50s)} draws): p50 TTFT median "
                  f"{summarize(run).ttft['p50'] * 1000:.1f} ms, range {min(p50s) * 1000:.1f}-"
                  f"{max(p50s) * 1000:.1f} ms", flush=True)
            for k in range(cfg.http_runs):
                label = _http_label(pol, k)
                if http_from is None:
                    http_run(trace, cfg, pol, synth, out, w, label=label)
                elif label in earlier:
                    w.write_run(earlier[label].meta, earlier[label].results)
                else:
                    raise TraceError(f"{http_from} has no run {label!r}")
                w.flush()
    runs = read_runs(res)
    sums = {r.meta.run: summarize(r) for r in runs}
    print(latency_table(list(sums.values())))
    lines = []
    ok_all = True
    for pol in cfg.policies:
        a = sums.get(f"sim:{pol}")
        bs = [sums.get(_http_label(pol, k)) for k in range(cfg.http_runs)]
        bad = [b for b in bs if b is None or b.ok < b.requests]
        if a is None or bad:
            errs = ", ".join(str(b.errors) if b else "missing" for b in bad)
            lines.append(f"FAIL {pol}: an HTTP run has failures ({errs})")
            ok_all = False
            continue
        http_p50s = [b.ttft["p50"] for b in bs if b is not None]
        h50 = statistics.median(http_p50s)
        o50 = a.ttft["p50"]
        rel = abs(h50 - o50) / o50
        ok = rel <= cfg.tolerance
        ok_all &= ok
        d10, d50, d90 = _per_request_diff(runs, pol)
        srv = _worker_side_p50(runs, pol)
        op = offline_p50s.get(pol, [o50])
        runs_txt = f" (runs: {', '.join(f'{x * 1000:.1f}' for x in http_p50s)})" if len(http_p50s) > 1 else ""
        lines.append(f"{'PASS' if ok else 'FAIL'} {pol}: p50 TTFT offline {o50 * 1000:.1f} ms (median of "
                     f"{len(op)} transport draws, {min(op) * 1000:.0f}-{max(op) * 1000:.0f}), HTTP "
                     f"{h50 * 1000:.1f} ms{runs_txt}, difference {rel:.1%} (bound {cfg.tolerance:.0%}); "
                     f"per request HTTP (first run) - offline: p10 {d10 * 1000:+.0f} / p50 {d50 * 1000:+.0f} / "
                     f"p90 {d90 * 1000:+.0f} ms; worker-side TTFT p50 over HTTP (usage.kv queue+load+prefill, "
                     f"no gateway/transport; first run) {srv * 1000:.1f} ms")
    for ln in lines:
        print(ln)
    write_report(runs, out, title=f"Offline simulator vs HTTP replay: {trace.name}", notes=lines)
    print(f"report: {out / 'report.md'}")
    return ok_all
