"""Workers that fail: killed mid-stream or before the first byte, garbage or truncated
SSE, 500, 429, and the same failures behind a vLLM (pass-through) worker.

Phase A has a healthy worker next to the failing one: a failure before the first byte
must be retried there (answered), a failure after it must end the stream with an
explicit error event (5xx relayed). Phase B drains the healthy worker: the failure can
only be relayed, with a message that names no worker, host or library and claims no
retry that could not happen.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable

from ..config import kvroute_worker
from ..faulty import INTERNAL_MARKER
from ..outcome import ANSWERED
from ..procs import FaultyProc, GatewayProc
from ..runner import Ctx, case
from .common import ask, drain, faulty_stats, fleet, mixed, set_mode, wait_all_healthy, words
from .timeouts import deadline, phase

_INTERNAL = (INTERNAL_MARKER, "/opt/worker", "CUDA error")


async def _fault_case(ctx: Ctx, mode: str, *, a_fault: bool) -> None:
    fp = await ctx.faulty(mode)
    gw, _, sim_ids = await fleet(ctx, 1, [fp])
    n = ctx.pick(12, 60)
    await tried(ctx, fp, f"{mode} (A)", _phase(ctx, gw, n, f"{mode}-A", a_fault, False))
    await drain(ctx, gw, sim_ids[0])
    await _phase(ctx, gw, max(4, n // 2), f"{mode}-B", True, True)


async def tried(ctx: Ctx, fp: FaultyProc, what: str, work: Awaitable[None]) -> None:
    """Run `work` and check that the faulty worker got at least one request meanwhile
    (else the phase proved nothing)."""
    before = (await faulty_stats(ctx, fp)).get("completions", 0)
    await work
    got = (await faulty_stats(ctx, fp)).get("completions", 0) - before
    ctx.check(f"{what}: the failing worker was tried", got > 0, "no request reached it")


async def _phase(ctx: Ctx, gw: GatewayProc, n: int, label: str, fault: bool, single: bool) -> None:
    rng = random.Random(label)

    async def one(i: int) -> None:
        chat, stream = mixed(i)
        await ask(ctx, gw, words(30, rng, f"{label} {i}"), chat=chat, stream=stream, max_tokens=8,
                  timeout=deadline(ctx), label=label, worker_fault=fault, single_worker=single,
                  secrets=_INTERNAL)

    await asyncio.gather(*(one(i) for i in range(n)))


@case("worker_garbage_sse", "a worker whose SSE payloads are not JSON", small_s=90, full_s=300)
async def worker_garbage_sse(ctx: Ctx) -> None:
    await _fault_case(ctx, "garbage", a_fault=False)


@case("worker_truncated_sse", "a worker that closes the stream mid-event, without [DONE]", small_s=90, full_s=300)
async def worker_truncated_sse(ctx: Ctx) -> None:
    await _fault_case(ctx, "truncated", a_fault=True)


@case("worker_500", "a worker answering 500 with internal details in its body", small_s=90, full_s=300)
async def worker_500(ctx: Ctx) -> None:
    await _fault_case(ctx, "s500", a_fault=False)


@case("worker_429", "a worker answering 429 (its own queue is full)", small_s=90, full_s=300)
async def worker_429(ctx: Ctx) -> None:
    await _fault_case(ctx, "s429", a_fault=False)


@case("worker_reset", "a worker whose connection is reset before the first byte, then after one chunk",
      small_s=90, full_s=300)
async def worker_reset(ctx: Ctx) -> None:
    fp = await ctx.faulty("reset_first")
    gw, _, sim_ids = await fleet(ctx, 1, [fp])
    n = ctx.pick(12, 60)
    await tried(ctx, fp, "reset_first (A)", _phase(ctx, gw, n, "reset_first-A", False, False))
    await set_mode(ctx, fp, "reset_mid")
    await asyncio.sleep(ctx.pick(2.0, 2.0))  # let a circuit opened by the resets close again
    await tried(ctx, fp, "reset_mid (A)", _phase(ctx, gw, n, "reset_mid-A", True, False))
    await drain(ctx, gw, sim_ids[0])
    await set_mode(ctx, fp, "reset_first")
    await _phase(ctx, gw, max(4, n // 2), "reset_first-B", True, True)


@case("worker_killed_first_byte", "a worker process that dies on receiving a request (before its first byte)",
      small_s=90, full_s=300)
async def worker_killed_first_byte(ctx: Ctx) -> None:
    fp = await ctx.faulty("exit_first")
    gw, _, _ = await fleet(ctx, 1, [fp])
    n = ctx.pick(12, 60)
    await _phase(ctx, gw, n, "exit-A", False, False)
    ctx.check("the faulty worker died", not fp.proc.alive, "it was to exit on its first completion request")
    await _phase(ctx, gw, n, "after-death", False, False)


@case("worker_killed_mid_stream", "a simulated worker process SIGKILLed while streaming", small_s=120, full_s=400)
async def worker_killed_mid_stream(ctx: Ctx) -> None:
    a = await ctx.sim(1, name="sim-a")
    b = await ctx.sim(1, name="sim-b")
    ids = [ctx.worker_id("hw"), ctx.worker_id("hw")]
    workers = [kvroute_worker(ids[0], a.workers[0].url), kvroute_worker(ids[1], b.workers[0].url)]
    gw = await ctx.gateway(ctx.config(workers), wait_ready=False)
    await wait_all_healthy(ctx, gw, 2)
    rng = random.Random(11)
    n = ctx.pick(16, 64)

    async def one(i: int, label: str, fault: bool, max_tokens: int) -> None:
        chat, stream = mixed(i)
        await ask(ctx, gw, words(30, rng, f"{label} {i}"), chat=chat, stream=stream, max_tokens=max_tokens,
                  timeout=deadline(ctx), label=label, worker_fault=fault)

    # long answers (~1.5 s each) so that the kill finds streams in flight on the victim
    answered_before = ctx.result.counts[ANSWERED]
    batch = asyncio.ensure_future(asyncio.gather(*(one(i, "during-kill", True, 600) for i in range(n))))
    await asyncio.sleep(0.6)
    ctx.procs.kill(a.proc)
    ctx.log("killed sim-a")
    await batch
    cut = n - (ctx.result.counts[ANSWERED] - answered_before)
    ctx.check("the kill cut requests in flight (the case tested something)", cut > 0,
              "every request of the batch was answered: the victim had no stream in flight")
    # after the kill: the dead worker is refused; everything must be served by the other
    await asyncio.gather(*(one(i, "after-kill", False, 8) for i in range(n)))


@case("vllm_passthrough_faults", "the failures above behind kind: vllm workers (pass-through relay)",
      small_s=200, full_s=900)
async def vllm_passthrough_faults(ctx: Ctx) -> None:
    # one vLLM-like faulty worker per failure (each its own circuit breaker), one good one;
    # every faulty one but the mode under test is drained
    modes = (("hang", False), ("s500", False), ("garbage", False), ("reset_first", False),
             ("stall", True), ("truncated", True), ("reset_mid", True))
    bad = {m: await ctx.faulty(m, kind="vllm") for m, _ in modes}
    good = await ctx.faulty("ok", kind="vllm", worker_id=ctx.worker_id("vw"))
    # Stated, equal speeds: the case is about what a failure does, so each faulty worker must
    # be as attractive as the good one (measured speeds would rightly steer around them).
    same = {"prefill_tokens_per_s": 10_000.0, "prefill_overhead_s": 0.0}
    workers = [{"id": fp.worker_id, "url": fp.url, "kind": "vllm", "cost": same} for fp in (*bad.values(), good)]
    gw = await ctx.gateway(ctx.config(workers), wait_ready=False)
    await wait_all_healthy(ctx, gw, len(workers))
    for fp in bad.values():
        await drain(ctx, gw, fp.worker_id)
    n = ctx.pick(8, 40)
    await phase(ctx, gw, 4, timeout=30, label="vllm-ok", worker_fault=False)  # the healthy path works
    for mode, fault in modes:  # A: before the first byte retried on the good worker; after it, an error
        fp = bad[mode]
        await drain(ctx, gw, fp.worker_id, on=False)
        await tried(ctx, fp, f"vllm {mode} (A)", _phase(ctx, gw, n, f"vllm-{mode}-A", fault, False))
        await drain(ctx, gw, fp.worker_id)
    await drain(ctx, gw, good.worker_id)
    for mode in ("hang", "s500", "truncated"):  # B: nothing else to try
        await drain(ctx, gw, bad[mode].worker_id, on=False)
        await _phase(ctx, gw, max(4, n // 2), f"vllm-{mode}-B", True, True)
        await drain(ctx, gw, bad[mode].worker_id)
