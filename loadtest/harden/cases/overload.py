"""Bursts: right after start, with a TTFT SLO, and at three times what the fleet holds.

Overload must be answered with 429 + Retry-After, never a 5xx; a busy worker is not a
dead one (no worker may leave the pool, its index must stay).
"""
from __future__ import annotations

import asyncio
import random
from typing import Any

from ..outcome import ANSWERED
from ..procs import GatewayProc
from ..runner import Ctx, case
from .common import ask, fleet, mixed, words

SEQS, WAITING = 8, 8  # the harden profile's scheduler (config.write_profile): capacity per worker


async def _watch_pool(ctx: Ctx, gw: GatewayProc, stop: asyncio.Event, seen: dict[str, Any]) -> None:
    """Every state a worker was seen in while the burst ran (anything but healthy is a failure)."""
    while not stop.is_set():
        for w in await ctx.workers_state(gw):
            st = w.get("state")
            if st != "healthy":
                seen.setdefault(str(w.get("id")), set()).add(f"{st} ({w.get('reason') or w.get('last_error')})")
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except TimeoutError:
            pass


async def _burst(ctx: Ctx, gw: GatewayProc, n: int, *, timeout: float, prefix_share: bool, mix: bool,
                 max_tokens: int = 16) -> None:
    rng = random.Random(7)
    shared = words(120, rng, "shared system prompt")
    prompts = [(shared + " " if prefix_share and i % 2 else "") + words(40, rng, f"req {i}") for i in range(n)]
    stop = asyncio.Event()
    seen: dict[str, Any] = {}
    before = await ctx.metrics(gw)
    watcher = asyncio.ensure_future(_watch_pool(ctx, gw, stop, seen))

    async def one(i: int) -> None:
        chat, stream = mixed(i) if mix else (True, True)
        await ask(ctx, gw, prompts[i], chat=chat, stream=stream, max_tokens=max_tokens, timeout=timeout,
                  label="burst")

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
        await asyncio.sleep(1.2)  # a health check after the burst
    finally:
        stop.set()
        await watcher
    after = await ctx.metrics(gw)
    trans = after.get("kvroute_worker_transitions_total", after.get("kvroute_worker_transitions", 0.0)) - \
        before.get("kvroute_worker_transitions_total", before.get("kvroute_worker_transitions", 0.0))
    ctx.check("every worker stayed healthy through the burst", not seen and trans == 0,
              "; ".join(f"{k}: {sorted(v)}" for k, v in seen.items()) + (f" ({trans:.0f} state transitions)"
                                                                          if trans else ""))
    idx = after.get("kvroute_index_blocks", 0.0)
    ctx.check("the index still holds the burst's blocks", idx > 0, f"kvroute_index_blocks = {idx:.0f}")


def _floor(ctx: Ctx, cap: int, sent: int, fraction: float = 0.25) -> None:
    """Not a throughput target: it catches a gateway that sheds nearly everything (`cap`:
    what the fleet holds at once, running + waiting)."""
    want = int(min(sent, cap) * fraction)
    got = ctx.result.counts[ANSWERED]
    ctx.check(f"served at least {want} (a quarter of what the fleet holds at once)", got >= want, f"served {got}")


# `full` bursts land on workers with real queues (64 running + 256 waiting each, as vLLM-class
# servers hold), so that the workers are busy and slow to answer `/load` and `/health`.
FULL_SEQS, FULL_WAITING = 64, 256


@case("burst_at_start", "streaming burst the moment the gateway is ready (3x capacity small, 500 full)",
      small_s=120, full_s=600)
async def burst_at_start(ctx: Ctx) -> None:
    seqs, waiting = ctx.pick((SEQS, WAITING), (FULL_SEQS, FULL_WAITING))
    ctx.use_profile(seqs, waiting)
    nw = ctx.pick(2, 4)
    gw, _, _ = await fleet(ctx, nw, ready=True)
    n = ctx.pick(3 * nw * (SEQS + WAITING), 500)
    # full: long streams keep the workers (and the one process they share) busy for a while
    await _burst(ctx, gw, n, timeout=ctx.pick(90, 240), prefix_share=False, mix=False,
                 max_tokens=ctx.pick(16, 128))
    _floor(ctx, nw * (seqs + waiting), n)


@case("burst_slo", "burst with routing.max_ttft_s set: 429 + Retry-After, never 5xx (150 small, 800 full)",
      small_s=120, full_s=600)
async def burst_slo(ctx: Ctx) -> None:
    seqs, waiting = ctx.pick((SEQS, WAITING), (FULL_SEQS, FULL_WAITING))
    ctx.use_profile(seqs, waiting)
    nw = ctx.pick(2, 4)
    gw, _, _ = await fleet(ctx, nw, routing={"policy": "kv_cost", "max_ttft_s": 0.5})
    n = ctx.pick(150, 800)
    await _burst(ctx, gw, n, timeout=ctx.pick(90, 240), prefix_share=True, mix=False)
    # The SLO limits what is admitted, so no capacity target here: only a floor that a gateway
    # shedding nearly everything misses (before the fix: 3-11 of 800 served): a quarter of the
    # fleet's running slots.
    want = nw * seqs // 4
    got = ctx.result.counts[ANSWERED]
    ctx.check(f"served at least {want} (a quarter of the fleet's running slots)", got >= want, f"served {got}")


@case("burst_3x", "warm fleet, then 3x its capacity at once (chat/completion, stream/whole, shared prefixes)",
      small_s=120, full_s=600)
async def burst_3x(ctx: Ctx) -> None:
    ctx.use_profile(SEQS, WAITING)
    nw = ctx.pick(2, 4)
    gw, _, _ = await fleet(ctx, nw)
    rng = random.Random(3)
    for i in range(8):  # warm: caches and the cost model's calibration
        await ask(ctx, gw, words(60, rng, f"warm {i}"), max_tokens=8, timeout=30, label="warm")
    n = 3 * nw * (SEQS + WAITING)
    await _burst(ctx, gw, n, timeout=ctx.pick(90, 240), prefix_share=True, mix=True)
    _floor(ctx, nw * (SEQS + WAITING), n)
