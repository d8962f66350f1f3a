"""The end of a SIGTERM drain: requests still in flight when `shutdown.drain_timeout_s`
runs out must end with an explicit error (an SSE error event, `[DONE]` and a terminated
chunked body for a stream; a 503 for an answer not yet started), and the gateway's log
must carry no traceback for them."""
from __future__ import annotations

import asyncio
import random
import signal
import time

from ..outcome import CHAT, COMPLETION, RELAYED, Outcome, Spec
from ..runner import Ctx, case
from .common import CHAT_PATH, COMP_PATH, chat_body, comp_body, fleet, wait_until, words

_TRACE_WORDS = ("Traceback", "CancelledError", "Exception in ASGI")


@case("drain_streams", "SIGTERM with streams that outlive the drain: each ends with an error event, no traceback",
      small_s=60, full_s=120)
async def drain_streams(ctx: Ctx) -> None:
    drain_s = float(ctx.pick(1.0, 3.0))
    gw, _, _ = await fleet(ctx, 1, shutdown={"grace_s": 0, "drain_timeout_s": drain_s})
    rng = random.Random(4)
    n = ctx.pick(6, 24)
    # 2 ms decode steps: 4,000 tokens take ~8 s, far past the drain
    calls: list[asyncio.Future[Outcome]] = []
    for i in range(n + 2):
        chat, stream = i % 2 == 0, i < n
        body = (chat_body if chat else comp_body)(words(20, rng, f"drain {i}"), max_tokens=4000, stream=stream,
                                                  ignore_eos=True)
        spec = Spec(expect=CHAT if chat else COMPLETION, stream=stream, worker_fault=True)
        calls.append(asyncio.ensure_future(ctx.call(gw, "POST", CHAT_PATH if chat else COMP_PATH, body, spec=spec,
                                                    timeout=30.0, label="stream" if stream else "whole")))

    async def all_in_flight() -> bool:
        ws = await ctx.workers_state(gw)
        return bool(sum(int(w.get("inflight", 0)) for w in ws) >= n + 2)

    if not ctx.check("every request reached the worker before the SIGTERM", await wait_until(all_in_flight, 15.0),
                     str([(w.get("id"), w.get("inflight")) for w in await ctx.workers_state(gw)])):
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        return
    t0 = time.monotonic()
    code = await asyncio.to_thread(ctx.procs.stop, gw.proc, signal.SIGTERM, 30.0)
    took = time.monotonic() - t0
    outs = await asyncio.gather(*calls)
    ctx.note(f"the gateway exited {took:.1f} s after SIGTERM (drain {drain_s:.0f} s), code {code}")
    ctx.check("the gateway exited cleanly (code 0)", code == 0, f"exit code {code}")
    streams, wholes = outs[:n], outs[n:]
    cut = [o.why for o in streams if not (o.category == RELAYED and "shutting down" in (o.error_message or ""))]
    ctx.check("every stream alive at the drain's end ended with a shutting-down error event and [DONE]", not cut,
              f"{len(cut)} of {len(streams)} did not: {cut[:3]}")
    bad = [f"{o.status} {o.why}" for o in wholes if o.status != 503 or o.category != RELAYED]
    ctx.check("a whole answer not yet started got a 503", not bad, str(bad[:3]))
    text = gw.proc.log.read_text(errors="replace")
    found = [w for w in _TRACE_WORDS if w in text]
    ctx.check("no traceback in the gateway's log", not found, f"the log ({gw.proc.log}) names {found}")
