"""The connection's edge: clients that never finish a request head.

`header_flood`: connections sending one endless header (`X-Big: aaaa...`, from a process of
their own: loadtest/harden/flood.py), reconnecting whenever the gateway closes them, while
another client asks `/health`; the gateway
must cut each off early and stay responsive. `slow_loris`: many connections that send
half a request line (or nothing) and stop; the gateway must close them once its head
timeout passes. Timing checks are scaled by the machine's load (load.py); the raw
numbers are in the notes.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from ..outcome import Spec
from ..procs import GatewayProc
from ..runner import Ctx, case

FLOOD_SCRIPT = Path(__file__).resolve().parent.parent / "flood.py"
HEALTH_P99_S = 0.050  # /health p99 for other clients while the flood runs (idle machine)
HEADER_TIMEOUT_S = 10.0  # the gateway's default listen.header_timeout_s


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _health_probe(ctx: Ctx, gw: GatewayProc, stop: asyncio.Event, every: float, label: str) -> list[float]:
    """`/health` on fresh connections until `stop`; the times of those answered."""
    times = []
    while not stop.is_set():
        o = await ctx.call(gw, "GET", "/health", timeout=5.0, spec=Spec(ok_statuses=(200,), tenant_facing=False),
                           label=label)
        if o.category == "answered":
            times.append(o.elapsed)
        await asyncio.sleep(every)
    return times


async def _baseline(ctx: Ctx, gw: GatewayProc, n: int) -> list[float]:
    stop = asyncio.Event()
    task = asyncio.ensure_future(_health_probe(ctx, gw, stop, 0.02, "health (no flood)"))
    await asyncio.sleep(n * 0.025)
    stop.set()
    return await task


@case("header_flood", "4 connections sending one endless header each (reconnecting), /health beside them",
      small_s=90, full_s=180)
async def header_flood(ctx: Ctx) -> None:
    gw = await ctx.gateway(ctx.config([]), wait_ready=False)
    base = await _baseline(ctx, gw, 100)
    seconds = ctx.pick(8.0, 22.0)
    # the script of this checkout (stdlib only), whichever checkout's gateway is under test
    flood = ctx.procs.spawn("flood", [ctx.st.python, str(FLOOD_SCRIPT), "--port", str(gw.port),
                                      "--connections", "4", "--seconds", str(seconds)], watch_stdout=True)
    stop = asyncio.Event()
    probe = asyncio.ensure_future(_health_probe(ctx, gw, stop, 0.02, "health (during the flood)"))
    line = (await asyncio.to_thread(ctx.procs.wait_line, flood, "{", seconds + 60.0 * ctx.stretch))[-1]
    stop.set()
    times = await probe
    st = json.loads(line)
    p50, p99 = _quantile(times, 0.5), _quantile(times, 0.99)
    ctx.note(f"flood {seconds:.0f} s: {st['connections']} attacker connections, {st['bytes'] / 1e6:.1f} MB sent, at "
             f"most {st['max_per_connection'] / 1024:.0f} KiB on one; /health n={len(times)} p50 {p50 * 1000:.1f} ms "
             f"p99 {p99 * 1000:.1f} ms (without the flood: p50 {_quantile(base, 0.5) * 1000:.1f} ms, p99 "
             f"{_quantile(base, 0.99) * 1000:.1f} ms); load factor {ctx.stretch:.2f}")
    ctx.check("the gateway cuts endless headers off (the attackers had to reconnect)", st["connections"] >= 40,
              f"{st['connections']} connections in {seconds:.0f} s")
    # sent = what left the client: the kernels' socket buffers on both sides hold up to a few MiB
    ctx.check("at most 8 MiB sent on one connection, socket buffers included", st["max_per_connection"] < 8 << 20,
              f"{st['max_per_connection']} bytes sent on one connection")
    ctx.check("/health answered throughout", len(times) >= 10, f"{len(times)} answers")
    ctx.timing("/health p99 for other clients during the flood", p99 if times else None, HEALTH_P99_S,
               f"p99 over {len(times)} requests:")


async def _half_request(host: str, port: int, opening: bytes) -> float | None:
    """Send `opening` and nothing more; seconds until the gateway closed (None: it did not)."""
    try:
        r, w = await asyncio.open_connection(host, port)
    except OSError:
        return None
    t0 = time.monotonic()
    try:
        if opening:
            w.write(opening)
            await w.drain()
        while await r.read(4096):
            pass
        return time.monotonic() - t0
    except (ConnectionError, OSError):
        return time.monotonic() - t0
    finally:
        w.close()


@case("slow_loris", "connections sending half a request line (and some nothing at all), then silence",
      small_s=120, full_s=240)
async def slow_loris(ctx: Ctx) -> None:
    gw = await ctx.gateway(ctx.config([]), wait_ready=False)
    n = ctx.pick(300, 3000)
    openings = [b"GET /heal" if i % 10 else b"" for i in range(n)]
    limit = HEADER_TIMEOUT_S + 2.0 * ctx.stretch
    opened = time.monotonic()
    tasks = [asyncio.ensure_future(asyncio.wait_for(_half_request("127.0.0.1", gw.port, o), limit + 20))
             for o in openings]
    stop = asyncio.Event()
    probe = asyncio.ensure_future(_health_probe(ctx, gw, stop, 0.05, "health (beside slow-loris)"))
    done = await asyncio.gather(*tasks, return_exceptions=True)
    stop.set()
    times = await probe
    closed = [d for d in done if isinstance(d, float)]
    f = ctx.stretch
    worst = max(closed) if closed else float("nan")
    spread = (f", after {min(closed):.1f}–{worst:.1f} s (median {statistics.median(closed):.1f} s)"
              if closed else "")
    ctx.note(f"{n} slow connections opened over {time.monotonic() - opened:.1f} s; {len(closed)} closed by the "
             f"gateway{spread}; head timeout {HEADER_TIMEOUT_S:g} s; /health n={len(times)} "
             f"p99 {_quantile(times, 0.99) * 1000:.1f} ms; load factor {f:.2f}")
    ctx.check("every slow connection was closed by the gateway", len(closed) == n,
              f"{n - len(closed)} of {n} still open {limit + 20:.0f} s after opening (or never connected)")
    ctx.timing("the last slow connection closed", worst if len(closed) == n else None, HEADER_TIMEOUT_S + 2.0,
               f"(head timeout {HEADER_TIMEOUT_S:g} s) the last closed after")
    ctx.check("/health answered beside them", len(times) >= 5, f"{len(times)} answers")
