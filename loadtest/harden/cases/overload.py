"""Bursts: right after start, with a TTFT SLO, and at three times what the fleet holds;
and a steady rate far above what a slow fleet completes.

Overload must be answered with 429 + Retry-After, never a 5xx; a busy worker is not a
dead one (no worker may leave the pool or trip its breaker, its index must stay).
"""
from __future__ import annotations

import asyncio
import random
import re
from collections import Counter
from typing import Any

from ..outcome import ANSWERED, REFUSED, RELAYED, S5XX, Outcome
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
    before, opens = await _series(ctx, gw), _circuit_opens(gw)
    watcher = asyncio.ensure_future(_watch_pool(ctx, gw, stop, seen))

    async def one(i: int) -> Outcome:
        chat, stream = mixed(i) if mix else (True, True)
        return await ask(ctx, gw, prompts[i], chat=chat, stream=stream, max_tokens=max_tokens, timeout=timeout,
                         label="burst")

    try:
        outs = await asyncio.gather(*(one(i) for i in range(n)))
        await asyncio.sleep(1.2)  # a health check after the burst
    finally:
        stop.set()
        await watcher
    after = await _series(ctx, gw)
    _overload_answers(ctx, gw, list(outs))
    _stayed_healthy(ctx, "the burst", seen, _transitions(_fold(before), _fold(after)))
    _breakers_shut(ctx, gw, before, after, opens)
    idx = _fold(after).get("kvroute_index_blocks", 0.0)
    ctx.check("the index still holds the burst's blocks", idx > 0, f"kvroute_index_blocks = {idx:.0f}")


def _transitions(before: dict[str, float], after: dict[str, float]) -> float:
    """Worker state changes between two `/metrics` reads (the counter with or without `_total`)."""
    def get(m: dict[str, float]) -> float:
        return m.get("kvroute_worker_transitions_total", m.get("kvroute_worker_transitions", 0.0))
    return get(after) - get(before)


def _stayed_healthy(ctx: Ctx, what: str, seen: dict[str, Any], trans: float) -> None:
    ctx.check(f"every worker stayed healthy through {what}", not seen and trans == 0,
              "; ".join(f"{k}: {sorted(v)}" for k, v in seen.items()) + (f" ({trans:.0f} state transitions)"
                                                                          if trans else ""))


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


# The slow fleet of `overload_rate`: each decode step takes 50 ms (12x the tiny-cpu profile's),
# so a 32-token stream holds a running slot for 1.6 s and the fleet completes at most
# workers x running slots / 1.6 s: 10 streams/s small, 160/s full, well under the rate sent.
SLOW_DECODE_S, RATE_TOKENS = 0.05, 32


@case("overload_rate", "open-loop streaming chats against a slow but alive fleet (100/s for 5 s small, "
      "300/s for 20 s full)", small_s=150, full_s=600)
async def overload_rate(ctx: Ctx) -> None:
    seqs, waiting = ctx.pick((SEQS, WAITING), (FULL_SEQS, FULL_WAITING))
    ctx.use_profile(seqs, waiting, decode_base_s=SLOW_DECODE_S)
    nw = ctx.pick(2, 4)
    gw, _, _ = await fleet(ctx, nw)
    rate, seconds = ctx.pick((100.0, 5.0), (300.0, 20.0))
    stop = asyncio.Event()
    seen: dict[str, Any] = {}
    before, opens = await _series(ctx, gw), _circuit_opens(gw)
    watcher = asyncio.ensure_future(_watch_pool(ctx, gw, stop, seen))
    try:
        outs, achieved = await _open_loop(ctx, gw, rate, seconds, timeout=ctx.pick(60, 180))
        await asyncio.sleep(1.2)  # a health check after the last answer
    finally:
        stop.set()
        await watcher
    after = await _series(ctx, gw)
    ctx.note(f"sent {len(outs)} at {achieved:.0f}/s (asked {rate:g}/s for {seconds:g} s)")
    _overload_answers(ctx, gw, outs)
    _stayed_healthy(ctx, "the rate", seen, _transitions(_fold(before), _fold(after)))
    _breakers_shut(ctx, gw, before, after, opens)
    _floor(ctx, nw * (seqs + waiting), len(outs))


async def _open_loop(ctx: Ctx, gw: GatewayProc, rate: float, seconds: float, *, timeout: float
                     ) -> tuple[list[Outcome], float]:
    """Streaming chats sent at fixed times whatever the answers (open loop: a slow gateway
    meets the same arrivals, where a closed loop would wait for it); returns the outcomes
    and the rate achieved (a client on a busy machine may send late, then catches up)."""
    n = int(rate * seconds)
    rng = random.Random(11)
    prompts = [words(40, rng, f"rate {i}") for i in range(n)]
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Future[Outcome]] = []
    t0 = loop.time()
    for i, prompt in enumerate(prompts):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(ask(ctx, gw, prompt, stream=True, max_tokens=RATE_TOKENS,
                                               timeout=timeout, label="rate")))
    span = loop.time() - t0 + 1.0 / rate
    return list(await asyncio.gather(*tasks)), n / span


def _overload_answers(ctx: Ctx, gw: GatewayProc, outs: list[Outcome]) -> None:
    """The acceptance of overload: no 5xx at all (a 502 says a live worker failed), every
    request a 200 or a 429 with Retry-After; the statuses and the gateway's own account
    of any 502 (its log) are noted for the report."""
    by = Counter(o.status for o in outs)
    ctx.note("answers by status: " + ", ".join(f"{k}: {v}" for k, v in sorted(by.items(), key=lambda kv: str(kv[0]))))
    why = Counter(re.sub(r"\d+", "N", o.error_message or "")[:80] for o in outs if o.status == 429)
    if why:
        ctx.note("429s: " + "; ".join(f"{v} x {k!r}" for k, v in why.most_common(4)))
    s5 = sum(v for k, v in by.items() if k is not None and k >= 500)
    errs = ctx.result.counts[RELAYED] + ctx.result.counts[S5XX]
    ctx.check("no 5xx: overload is not a worker failure", s5 == 0 and errs == 0,
              f"502: {by[502]}, 5xx statuses: {s5}, 5xx or error events counted: {errs}")
    no_ra = sum(1 for o in outs if o.status == 429 and not o.headers.get("retry-after"))
    other = sum(1 for o in outs if o.status not in (200, 429) or o.category not in (ANSWERED, REFUSED))
    ctx.check("every request answered 200 or 429 with Retry-After", other == 0 and no_ra == 0,
              f"{other} neither a complete 200 nor a 429; {no_ra} 429s without Retry-After")
    failed = [ln for ln in _gateway_log(gw) if "no worker answered" in ln]
    if failed:
        ctx.note(f"gateway log: {len(failed)} requests no worker answered, e.g. {failed[0][-240:]}")


def _breakers_shut(ctx: Ctx, gw: GatewayProc, before: dict[str, float], after: dict[str, float],
                   opens: int) -> None:
    """No circuit breaker opened (the gateway logs each opening) and no request was shed as
    "workers are failing"; the proxy's upstream errors by phase are noted."""
    new = _circuit_opens(gw) - opens
    shed = _delta(before, after, "kvroute_shed_total", reason="workers_failing")
    ctx.check("no circuit breaker opened, nothing shed as workers failing", new == 0 and shed == 0,
              f"{new} breaker openings, {shed:.0f} shed as workers_failing")
    errors = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith("kvroute_upstream_errors_total{")}
    errors = {k: v for k, v in errors.items() if v}
    if errors:
        ctx.note("upstream errors: " + ", ".join(f"{k.split('{', 1)[1].rstrip('}')}: {v:.0f}"
                                                 for k, v in sorted(errors.items())))


def _delta(before: dict[str, float], after: dict[str, float], metric: str, **labels: str) -> float:
    """How much a counter's series with these labels grew between two reads of `_series`."""
    keys = [k for k in after if k.startswith(metric + "{") and all(f'{n}="{v}"' in k for n, v in labels.items())]
    return sum(after[k] - before.get(k, 0.0) for k in keys)


async def _series(ctx: Ctx, gw: GatewayProc) -> dict[str, float]:
    """`/metrics` per series (name and labels, unlike `ctx.metrics`, which folds the labels)."""
    rep = await ctx.raw(gw, "GET", "/metrics")
    out: dict[str, float] = {}
    for line in rep.body.decode(errors="replace").splitlines() if rep.status == 200 else []:
        key, _, val = line.rpartition(" ")
        if key and not line.startswith("#"):
            try:
                out[key] = float(val)
            except ValueError:
                pass
    return out


def _fold(series: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in series.items():
        name = k.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + v
    return out


def _gateway_log(gw: GatewayProc) -> list[str]:
    try:
        return gw.proc.log.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _circuit_opens(gw: GatewayProc) -> int:
    """Breaker openings so far: the gateway logs each one ("circuit open for ...")."""
    return sum(1 for ln in _gateway_log(gw) if "circuit open" in ln)
