"""Workers that accept and never answer, streams that stall after one chunk, and a
worker marked unhealthy while requests are on it: the client must never hang.

Each runs a faulty worker next to a healthy simulated one. Phase A: both routable —
before the first byte the gateway must give up on the faulty one and serve from the
healthy one; after it, end the stream with an explicit error event. Phase B: the
healthy worker drained — the client must get a relayed 502/504 (or error event) in
time, and the gateway must close its connections to the faulty worker.
"""
from __future__ import annotations

import asyncio
import random

from ..procs import FaultyProc, GatewayProc
from ..runner import Ctx, case
from .common import ask, drain, faulty_stats, fleet, mixed, released, words


async def phase(ctx: Ctx, gw: GatewayProc, n: int, *, timeout: float, label: str, worker_fault: bool,
                single_worker: bool = False, max_tokens: int = 8) -> None:
    rng = random.Random(label)

    async def one(i: int) -> None:
        chat, stream = mixed(i)
        await ask(ctx, gw, words(30, rng, f"{label} {i}"), chat=chat, stream=stream, max_tokens=max_tokens,
                  timeout=timeout, label=label, worker_fault=worker_fault, single_worker=single_worker)

    await asyncio.gather(*(one(i) for i in range(n)))


def deadline(ctx: Ctx) -> float:
    """Client deadline: the small run sets 3 s first-byte/idle timeouts (runner.Ctx.timeouts),
    so 12 s leaves room for a timeout, a retry and a loaded machine; `full` keeps the
    gateway's defaults, which must end a request well within a minute and a quarter."""
    return float(ctx.pick(12.0, 75.0))


async def _two_phases(ctx: Ctx, mode: str, *, a_fault: bool, b_fault: bool = True, n: int | None = None) -> None:
    fp = await ctx.faulty(mode)
    gw, _, sim_ids = await fleet(ctx, 1, [fp])
    n = n or ctx.pick(8, 40)
    before = (await faulty_stats(ctx, fp)).get("completions", 0)
    await phase(ctx, gw, n, timeout=deadline(ctx), label=f"{mode}-A", worker_fault=a_fault)
    got = (await faulty_stats(ctx, fp)).get("completions", 0) - before
    ctx.check(f"{mode} (A): the failing worker was tried", got > 0, "no request reached it")
    await drain(ctx, gw, sim_ids[0])
    await phase(ctx, gw, max(4, n // 2), timeout=deadline(ctx), label=f"{mode}-B", worker_fault=b_fault,
                single_worker=True)
    ok, still = await released(ctx, fp, 10.0)
    ctx.check("the gateway closed its connections to the faulty worker", ok,
              f"{still} completion connections still open 10 s after the last client was answered")


@case("hanging_worker", "a worker that accepts and never answers (before the first byte)", small_s=120, full_s=600)
async def hanging_worker(ctx: Ctx) -> None:
    await _two_phases(ctx, "hang", a_fault=False)


@case("stalled_stream", "a worker that sends one chunk and then nothing", small_s=120, full_s=600)
async def stalled_stream(ctx: Ctx) -> None:
    await _two_phases(ctx, "stall", a_fault=True)


@case("unhealthy_inflight", "requests already on a worker when it is marked unhealthy are ended",
      small_s=90, full_s=300)
async def unhealthy_inflight(ctx: Ctx) -> None:
    # Long upstream timeouts here: only the worker being marked unhealthy may end these requests.
    long = {k: 300.0 for k in ("first_byte_min_s", "idle_timeout_s") if k in ctx.st.pool_fields}
    fp = await ctx.faulty("sick")
    gw, _, sim_ids = await fleet(ctx, 1, [fp], pool=long)
    await drain(ctx, gw, sim_ids[0])  # every request goes to the faulty worker...
    n = ctx.pick(8, 24)
    task = asyncio.ensure_future(phase(ctx, gw, n, timeout=ctx.pick(15.0, 30.0), label="on-sick",
                                       worker_fault=True))
    await asyncio.sleep(1.0)
    await drain(ctx, gw, sim_ids[0], on=False)  # ...and the healthy one is back for retries
    marked = asyncio.ensure_future(_marked_unhealthy(ctx, gw, fp, 12.0))
    await task
    ctx.check("the sick worker was marked unhealthy", await marked, "its /health has answered 500 since the "
              "first request")
    ok, still = await released(ctx, fp, 5.0)
    ctx.check("the gateway closed its connections to the unhealthy worker", ok, f"{still} still open")
    await phase(ctx, gw, 4, timeout=15.0, label="after", worker_fault=False)


async def _marked_unhealthy(ctx: Ctx, gw: GatewayProc, fp: FaultyProc, timeout: float) -> bool:
    deadline_t = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline_t:
        for w in await ctx.workers_state(gw):
            if w.get("id") == fp.worker_id and w.get("state") == "unhealthy":
                return True
        await asyncio.sleep(0.25)
    return False
