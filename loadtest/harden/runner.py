"""Running the cases: each in a fresh set of processes, with a wall-clock cap, its
counters and checks, the gateway's RSS; then the table and the JSON report.

A case is an async function of a `Ctx`, which starts what the case needs (gateway,
simulated workers, faulty workers — real processes, see procs.py), sends requests
through `ctx.call` (each one judged and counted, outcome.py), and records checks that
are not a single request's (a worker stayed healthy, a file was not replaced, the
index came back). Everything a case started is stopped when it ends, however it ends.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .client import Reply, request
from .config import DECODE_BASE_S, SMALL_TIMEOUTS, gateway_config, namespace_digest, pool_fields, write_profile
from .load import load_factor
from .outcome import ABANDONED, CaseResult, Outcome, Spec, classify
from .procs import REPO, FaultyProc, GatewayProc, Procs, SimCluster, StartError
from .rss import RssSampler

SIZES = ("small", "full")


class Skip(Exception):
    """The case cannot run here (a missing optional tool); the message says why."""


@dataclass
class Case:
    name: str
    summary: str
    fn: Callable[[Ctx], Awaitable[None]]
    budget_s: tuple[float, float]  # wall-clock cap (small, full)


CASES: dict[str, Case] = {}


def case(name: str, summary: str, small_s: float = 60.0, full_s: float = 600.0
         ) -> Callable[[Callable[[Ctx], Awaitable[None]]], Callable[[Ctx], Awaitable[None]]]:
    def deco(fn: Callable[[Ctx], Awaitable[None]]) -> Callable[[Ctx], Awaitable[None]]:
        CASES[name] = Case(name, summary, fn, (small_s, full_s))
        return fn
    return deco


@dataclass
class Settings:
    size: str = "small"
    out: Path = field(default_factory=lambda: Path(tempfile.gettempdir())
                      / f"kvroute-harden-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    python: str = sys.executable
    code_root: Path = REPO
    pool_fields: list[str] = field(default_factory=list)
    verbose: bool = True


class Ctx:
    """What a case works with: its processes, its counters, its size."""

    def __init__(self, c: Case, st: Settings, folder: Path, sampler: RssSampler, stretch: float = 1.0) -> None:
        self.case = c
        self.stretch = stretch  # the load factor at the case's start: deadlines and timing bounds × this
        self.st = st
        self.size = st.size
        self.small = st.size == "small"
        self.folder = folder
        self.procs = Procs(folder, st.python, st.code_root)
        self.result = CaseResult(c.name, c.summary)
        self.sampler = sampler
        self.gateways: list[GatewayProc] = []
        self.secrets: set[str] = set()
        self._bg: set[asyncio.Future[Any]] = set()
        self.tag = secrets.token_hex(3)
        self.use_profile(32, 32)

    def use_profile(self, max_num_seqs: int, max_waiting: int, decode_base_s: float | None = None) -> None:
        """The simulated workers' scheduler for this case (capacity = seqs + waiting per worker);
        `decode_base_s`: a slower decode step than the suite's (a slow fleet)."""
        self.profile = write_profile(self.folder, max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                                     decode_base_s=DECODE_BASE_S if decode_base_s is None else decode_base_s)
        self.digest = namespace_digest(self.profile)

    # ------------------------------------------------------------------ sizes, checks

    def pick(self, small: Any, full: Any) -> Any:
        return small if self.small else full

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        return self.result.check(name, ok, detail)

    def timing(self, name: str, seconds: float | None, idle_bound_s: float, what: str = "took") -> bool:
        """A wall-clock bound: `seconds` (None: it never happened) within `idle_bound_s`
        stretched by the load factor. Judged in the report, not by the default test run."""
        bound = idle_bound_s * self.stretch
        ok = seconds is not None and seconds <= bound
        got = "never" if seconds is None else f"{seconds:.1f} s"
        return self.result.check(f"{name} (within {idle_bound_s:g} s × load {self.stretch:.2f})", ok,
                                 f"{what} {got}; bound {bound:.1f} s", timing=True)

    def note(self, text: str) -> None:
        self.result.notes.append(text)

    def log(self, text: str) -> None:
        with (self.folder / "case.log").open("a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    def worker_id(self, role: str) -> str:
        """A distinctive worker id (so a leak of it is found by a plain substring search)."""
        wid = f"{role}-{self.tag}-{len(self.secrets)}"
        self.secrets.add(wid)
        return wid

    def timeouts(self) -> dict[str, float]:
        """The short upstream timeouts of a small run, where this gateway's config has them."""
        if not self.small:
            return {}
        return {k: v for k, v in SMALL_TIMEOUTS.items() if k in self.st.pool_fields}

    # ------------------------------------------------------------------ processes

    def config(self, workers: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
        pool = {**self.timeouts(), **sections.pop("pool", {})}
        return gateway_config(self.profile, workers, pool=pool, **sections)

    async def gateway(self, config: dict[str, Any], *, wait_ready: bool = True, name: str = "gateway",
                      timeout: float = 60.0, port: int | None = None) -> GatewayProc:
        for w in config.get("workers", []):
            self.secrets.add(w["id"])
            self.secrets.add(w["url"].split("//", 1)[-1])
        t0 = time.monotonic()
        gw = await asyncio.to_thread(self.procs.gateway, config, name=name, wait_ready=False, timeout=timeout,
                                     port=port)
        self.gateways.append(gw)
        self.sampler.track(gw.pid)
        self.log(f"gateway pid {gw.pid} on {gw.url}, /health after {time.monotonic() - t0:.1f} s")
        task = asyncio.ensure_future(self._time_ready(gw, t0, timeout))
        self._bg.add(task)
        if wait_ready:
            await task
            if gw.ready_s is None:
                raise StartError(f"{gw.url}/ready not 200 after {timeout:.0f} s (log {gw.proc.log}):\n"
                                 + gw.proc.tail())
        return gw

    async def _time_ready(self, gw: GatewayProc, t0: float, timeout: float) -> None:
        """When `/ready` first says 200 (noted: a gateway slow to be ready delays every client)."""
        while time.monotonic() - t0 < timeout and gw.proc.alive:
            rep = await self.raw(gw, "GET", "/ready", timeout=2.0)
            if rep.status == 200:
                gw.ready_s = time.monotonic() - t0
                self.log(f"gateway pid {gw.pid}: /ready after {gw.ready_s:.1f} s")
                self.result.ready_s.append(round(gw.ready_s, 2))
                return
            await asyncio.sleep(0.1)


    async def sim(self, n: int, **kw: Any) -> SimCluster:
        kw.setdefault("id_prefix", f"simw-{self.tag}-")
        sc = await asyncio.to_thread(self.procs.sim_cluster, n, self.profile, **kw)
        for w in sc.workers:
            self.secrets.add(w.worker_id)
            self.secrets.add(w.url.split("//", 1)[-1])
        return sc

    async def faulty(self, mode: str, **kw: Any) -> FaultyProc:
        kw.setdefault("model", "kvroute/tiny-llama")
        kw.setdefault("served", ["kvroute/tiny-llama", "tiny"])
        kw.setdefault("digest", self.digest)
        kw.setdefault("worker_id", self.worker_id("fw"))
        fp = await asyncio.to_thread(self.procs.faulty, mode, **kw)
        self.secrets.add(fp.worker_id)
        self.secrets.add(fp.url.split("//", 1)[-1])
        return fp

    # ------------------------------------------------------------------ requests

    async def call(self, base: str | GatewayProc, method: str, path: str, body: Any = None, *,
                   spec: Spec | None = None, headers: dict[str, str] | None = None, timeout: float = 30.0,
                   label: str = "", count: bool = True, **kw: Any) -> Outcome:
        """Send one request, judge it (outcome.classify) and count it in the table."""
        spec = spec or Spec()
        timeout *= self.stretch  # a request's deadline, on the machine running the suite, now
        if spec.tenant_facing:
            spec.secrets = tuple(sorted(set(spec.secrets) | self.secrets))
        host, port = _host_port(base)
        rep = await request(host, port, method, path, body, headers, timeout=timeout, **kw)
        o = classify(rep, spec, label)
        if count and o.category != ABANDONED:
            self.result.add(o)
        elif o.category == ABANDONED:
            self.result.counts[ABANDONED] += 1
        if o.category not in ("answered", "refused", ABANDONED):
            self.log(f"{label or path}: {o.category}: {o.why}")
        elif o.elapsed > 2.0:
            self.log(f"{label or path}: {o.category} after {o.elapsed:.1f} s ({o.why[:120]})")
        return o

    async def raw(self, base: str | GatewayProc, method: str, path: str, body: Any = None, *,
                  headers: dict[str, str] | None = None, timeout: float = 10.0, **kw: Any) -> Reply:
        """A request that is not counted (the case's own bookkeeping: admin, metrics, stats)."""
        host, port = _host_port(base)
        return await request(host, port, method, path, body, headers, timeout=timeout * self.stretch, **kw)

    async def json(self, base: str | GatewayProc, path: str, *, method: str = "GET", body: Any = None,
                   headers: dict[str, str] | None = None, timeout: float = 10.0) -> Any:
        rep = await self.raw(base, method, path, body, headers=headers, timeout=timeout)
        if rep.status != 200 or not rep.complete:
            return None
        try:
            return msgspec.json.decode(rep.body)
        except msgspec.DecodeError:
            return None

    async def metrics(self, base: str | GatewayProc) -> dict[str, float]:
        """`/metrics` summed per metric name (labels folded)."""
        rep = await self.raw(base, "GET", "/metrics")
        out: dict[str, float] = {}
        if rep.status != 200:
            return out
        for line in rep.body.decode(errors="replace").splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, val = line.rpartition(" ")
            metric = name.split("{", 1)[0]
            try:
                out[metric] = out.get(metric, 0.0) + float(val)
            except ValueError:
                pass
        return out

    async def workers_state(self, gw: GatewayProc, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
        data = await self.json(gw, "/admin/workers", headers=headers)
        return list(data.get("workers", [])) if isinstance(data, dict) else []


def _host_port(base: str | GatewayProc) -> tuple[str, int]:
    url = base.url if isinstance(base, GatewayProc) else base
    hp = url.split("//", 1)[-1].split("/", 1)[0]
    host, _, port = hp.rpartition(":")
    return host, int(port)


# ---------------------------------------------------------------------- the suite


def run_case(c: Case, st: Settings, sampler: RssSampler) -> CaseResult:
    """One case in its own event loop and processes; whatever happens, a result."""
    folder = st.out / c.name
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    stretch = load_factor()  # a busy machine gets more time, never less than an idle one's
    budget = c.budget_s[0 if st.size == "small" else 1] * stretch
    ctx: Ctx | None = None
    res = CaseResult(c.name, c.summary)
    try:
        ctx = Ctx(c, st, folder, sampler, stretch)
        res = ctx.result
        ctx.log(f"case {c.name} ({st.size}); load factor {stretch:.2f}: budget {budget:.0f} s")
        asyncio.run(asyncio.wait_for(c.fn(ctx), budget))
        ctx.log("case done")
    except Skip as e:
        res.skipped = str(e)
    except TimeoutError as e:
        if time.monotonic() - t0 >= budget:
            res.error = f"the case did not finish within its {budget:.0f} s budget (load factor {stretch:.2f})"
        else:
            res.error = f"TimeoutError: {e}"
            _trace(folder)
    except StartError as e:
        res.error = f"could not start: {e}"
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
        _trace(folder)
    finally:
        res = _finish(res, ctx, t0)
    return res


def _trace(folder: Path) -> None:
    with (folder / "case.log").open("a") as f:
        f.write(traceback.format_exc())


def _finish(res: CaseResult, ctx: Ctx | None, t0: float) -> CaseResult:
    if ctx is not None:
        for gw in ctx.gateways:
            ctx.sampler.sample_now(gw.pid)
        if ctx.gateways and not res.rss_mb:
            # over the case: the first gateway's start, the max over all, the last one's end
            per = [ctx.sampler.mib(g.pid) for g in ctx.gateways]
            per = [p for p in per if p]
            if per:
                res.rss_mb = {"start": per[0]["start"], "max": max(p["max"] for p in per), "end": per[-1]["end"]}
        for gw in ctx.gateways:
            if not gw.proc.alive and gw.proc.popen.returncode not in (0, -15, -9, 143, 137):
                res.check("gateway process alive", False,
                          f"the gateway exited with {gw.proc.popen.returncode} (log {gw.proc.log})")
        ctx.procs.close()
    res.seconds = time.monotonic() - t0
    return res


def run_suite(names: list[str], st: Settings, on_case: Callable[[CaseResult], None] | None = None
              ) -> list[CaseResult]:
    st.out.mkdir(parents=True, exist_ok=True)
    if not st.pool_fields:
        st.pool_fields = pool_fields(st.python, st.code_root)
    sampler = RssSampler()
    results = []
    try:
        for n in names:
            r = run_case(CASES[n], st, sampler)
            results.append(r)
            if on_case is not None:
                on_case(r)
    finally:
        sampler.stop()
    return results


def env_summary(st: Settings) -> list[str]:
    applied = {k: v for k, v in SMALL_TIMEOUTS.items() if k in st.pool_fields} if st.size == "small" else {}
    missing = [k for k in SMALL_TIMEOUTS if k not in st.pool_fields]
    lines = [f"size {st.size}; gateway and workers from {st.code_root} ({st.python}); pid {os.getpid()}"]
    if st.size == "small":
        lines.append("upstream timeouts set for the small run: "
                     + (", ".join(f"pool.{k}={v:g}" for k, v in applied.items()) or "none")
                     + (f" (not in this gateway's config: {', '.join('pool.' + k for k in missing)};"
                        " it runs with its defaults)" if missing else ""))
    return lines
