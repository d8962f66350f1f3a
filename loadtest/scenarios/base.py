"""What every scenario shares: checks with PASS/FAIL lines, the run context, sizing.

A scenario builds a workload, runs it through the offline simulator (policies × tier
sets, fault injections as timed actions), and states explicit checks. Each check is
printed as `PASS name: detail` or `FAIL name: detail`, the numbers behind it go into
the scenario's report (results.jsonl + report.md + plots), and the command's exit
status says whether everything held.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from workers.sim import SimProfile, load_profile
from workers.sim.profile import DeviceMemory, LinkSpec, TierSpec

from ..fleet import FleetSpec
from ..report import cache_table, latency_table, write_report
from ..results import ResultsWriter, Run
from ..router_model import RouterSettings
from ..simulate import Action, SimSettings, Simulation
from ..summary import RunSummary, summarize
from ..trace import Trace


@dataclass(slots=True)
class Check:
    name: str
    status: str  # PASS | FAIL
    detail: str

    def line(self) -> str:
        return f"{self.status:<7} {self.name}: {self.detail}"


@dataclass(slots=True)
class ScenarioResult:
    name: str
    checks: list[Check]
    runs: list[Run]
    report: Path | None = None

    @property
    def passed(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)


@dataclass(slots=True)
class Context:
    """Handed to a scenario: its size, seed, where to write, and run helpers."""

    name: str
    size: str  # "small" (tests, seconds) | "full" (the real check, under a minute or so)
    seed: int
    out_dir: Path | None
    verbose: bool = True
    runs: list[Run] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def small(self) -> bool:
        return self.size == "small"

    def pick(self, small: Any, full: Any) -> Any:
        return small if self.small else full

    def simulate(
        self,
        trace: Trace,
        policy: str,
        settings: SimSettings,
        *,
        label: str | None = None,
        params: dict[str, Any] | None = None,
        actions: Iterable[tuple[float, Action]] = (),
        request_hook: Any = None,
        keep: Callable[[Simulation], None] | None = None,
    ) -> Run:
        sim = Simulation(trace, policy, settings, policy_params=params, label=label, actions=actions,
                         request_hook=request_hook)
        run = sim.run()
        if keep is not None:
            keep(sim)
        self.runs.append(run)
        if self.verbose:
            s = summarize(run)
            print(f"  ran {run.meta.run:<30} TTFT p50 {s.ttft['p50'] * 1000:8.1f} ms  p99 "
                  f"{s.ttft['p99'] * 1000:9.1f} ms  ok {s.ok}/{s.requests}  ({run.meta.wall_s:.1f} s wall)",
                  flush=True)
        return run

    def check(self, name: str, ok: bool, detail: str) -> bool:
        c = Check(name, "PASS" if ok else "FAIL", detail)
        self.checks.append(c)
        if self.verbose:
            print(c.line(), flush=True)
        return ok

    def note(self, text: str) -> None:
        self.notes.append(text)
        if self.verbose:
            print(f"  note: {text}", flush=True)


# ------------------------------------------------------------------ sizing helpers

GiB = 1024**3


def sized_profile(
    base: str | SimProfile = "h200-llama3.1-8b",
    *,
    gpu_tokens: int | None = None,
    cpu_tokens: int | None = None,
    disk_tokens: int | None = None,
    remote_tokens: int | None = None,
    cpu_Bps: float | None = None,
    disk_Bps: float | None = None,
    remote_Bps: float | None = None,
    peer_Bps: float | None = None,
    disk_admit_after: int | None = None,
    max_waiting: int | None = None,
    name: str | None = None,
) -> SimProfile:
    """A profile with the same model and speeds but other capacities / bandwidths.

    Scenarios shrink the tiers so that eviction, cascades and a full disk happen within
    a bounded run; bandwidths are squeezed the same way. Capacities are in tokens."""
    p = load_profile(base) if isinstance(base, str) else base
    bpt = p.geometry.bytes_per_token
    if gpu_tokens is not None:
        p = replace(p, memory=DeviceMemory(device_bytes=float(gpu_tokens * bpt), memory_utilization=1.0,
                                           weights_bytes=0.0, reserved_bytes=0.0))

    def tier(spec: TierSpec | None, tokens: int | None, bps: float | None, **kw: Any) -> TierSpec | None:
        if spec is None:
            return None
        if tokens is not None:
            spec = replace(spec, capacity_bytes=float(tokens * bpt))
        if bps is not None:
            spec = replace(spec, read_Bps=bps)
        if kw:
            spec = replace(spec, **kw)
        return spec

    admit = {"admit_after_uses": disk_admit_after} if disk_admit_after is not None else {}
    p = replace(
        p,
        cpu=tier(p.cpu, cpu_tokens, cpu_Bps),
        disk=tier(p.disk, disk_tokens, disk_Bps, **admit),
        remote=tier(p.remote, remote_tokens, remote_Bps),
        peer=LinkSpec(peer_Bps, p.peer.latency_s) if (peer_Bps is not None and p.peer is not None) else p.peer,
        name=name or p.name,
    )
    if max_waiting is not None:
        p = replace(p, scheduler=replace(p.scheduler, max_waiting=max_waiting))
    return p


def settings(
    profile: SimProfile,
    *,
    workers: int,
    tiers: str = "all",
    block_size: int | None = 64,
    speed: float = 1.0,
    seed: int = 0,
    router: RouterSettings | None = None,
    remote_groups: int = 1,
    max_drain_s: float = 3600.0,
) -> SimSettings:
    """Scenario defaults: 64-token blocks (4x fewer block operations than 16; sharing in
    the synthetic workloads is at 64-token granularity anyway)."""
    return SimSettings(
        fleet=FleetSpec(workers=workers, profile=profile, tiers=tiers, block_size=block_size,
                        remote_groups=remote_groups),
        router=router or RouterSettings(),
        speed=speed,
        seed=seed,
        max_drain_s=max_drain_s,
    )


def by_run(runs: Sequence[Run]) -> dict[str, RunSummary]:
    return {r.meta.run: summarize(r) for r in runs}


def ms(x: float) -> str:
    return f"{x * 1000:.0f} ms"


def finish(ctx: Context) -> ScenarioResult:
    """Print the tables, write results + report (when out_dir is set), return the result."""
    sums = [summarize(r) for r in ctx.runs]
    if ctx.verbose and sums:
        print()
        print(latency_table(sums))
        print()
        print(cache_table(sums))
    report = None
    if ctx.out_dir is not None and ctx.runs:
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        with ResultsWriter(ctx.out_dir / "results.jsonl") as w:
            for r in ctx.runs:
                w.write_run(r.meta, r.results)
        notes = [c.line() for c in ctx.checks] + ctx.notes
        report = write_report(ctx.runs, ctx.out_dir, title=f"Scenario {ctx.name} ({ctx.size})", notes=notes)
        if ctx.verbose:
            print(f"\nreport: {report}")
    res = ScenarioResult(ctx.name, list(ctx.checks), list(ctx.runs), report)
    if ctx.verbose:
        n_fail = sum(c.status == "FAIL" for c in ctx.checks)
        verdict = "PASSED" if res.passed else "FAILED"
        print(f"\nscenario {ctx.name}: {verdict} ({len(ctx.checks) - n_fail} passed, {n_fail} failed)")
    return res


def worker_shares(run: Run, since_s: float = 0.0) -> dict[str, float]:
    """Share of the run's routed requests (arriving at or after `since_s`) per worker."""
    counts: dict[str, int] = {}
    for r in run.results:
        if r.worker is not None and r.arrival_s >= since_s:
            counts[r.worker] = counts.get(r.worker, 0) + 1
    total = sum(counts.values())
    return {w: c / total for w, c in counts.items()} if total else {}


def mooncake_slice(ctx: Context, limit: int, start_s: float = 0.0) -> Trace:
    """The first `limit` requests (from `start_s`) of the Mooncake conversation trace:
    the full file from $LOADTEST_TRACES, else the slice the tests ship (tests/data/traces/,
    in a source checkout) where it holds that many; a synthetic multi-turn workload of
    the same size, with a note, where neither does."""
    from ..tracefiles import ENV, MOONCAKE, MOONCAKE_SLICE, find_trace
    from ..traces import load_trace
    from ..workloads import Sessions, session_workload

    path = find_trace(MOONCAKE)
    if path is not None:
        return load_trace(path).window(start_s=start_s, limit=limit)
    if MOONCAKE_SLICE.is_file():
        part = load_trace(MOONCAKE_SLICE).window(start_s=start_s, limit=limit)
        if len(part) == limit:
            ctx.note(f"{MOONCAKE} not in ${ENV}: the first {limit} requests come from the shipped slice")
            return part
    ctx.note(f"{MOONCAKE} not in ${ENV} (see README.md, Replaying traces): using a synthetic multi-turn "
             "workload instead of the Mooncake trace")
    return session_workload("sessions", Sessions(sessions=max(1, limit // 4), turns=4), seed=ctx.seed).window(
        limit=limit)
