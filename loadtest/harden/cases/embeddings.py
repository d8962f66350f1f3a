"""`/v1/embeddings` on the path every route takes: the pool's timeouts (a worker that
never answers costs the first-byte window, not 300 s), the tenant's concurrency cap, the
served name and the request id sent to the worker, a bounded answer, and only what an
OpenAI route can legitimately answer relayed (a 202 is the worker's failure)."""
from __future__ import annotations

import asyncio
from typing import Any

from ..config import MODEL, SERVED
from ..faulty import INTERNAL_MARKER
from ..outcome import ANSWERED, JSON, REFUSED, RELAYED, Outcome, Spec
from ..runner import Ctx, case
from .common import drain, faulty_stats, fleet, gather_limited, set_mode
from .timeouts import deadline

PATH = "/v1/embeddings"
KEY = "sk-embed-tenant-0001"


async def _embed(ctx: Ctx, gw: Any, label: str, *, fault: bool, rid: str | None = None) -> Outcome:
    headers = {"Authorization": f"Bearer {KEY}", **({"X-Request-Id": rid} if rid else {})}
    spec = Spec(expect=JSON, worker_fault=fault, secrets=(INTERNAL_MARKER,))
    return await ctx.call(gw, "POST", PATH, {"model": SERVED, "input": ["a cat", "a dog"]}, spec=spec,
                          headers=headers, timeout=deadline(ctx), label=label)


@case("embeddings_path", "/v1/embeddings: timeouts, tenant cap, served name, request id, bounded, relay rules",
      small_s=90, full_s=400)
async def embeddings_path(ctx: Ctx) -> None:
    fp = await ctx.faulty("hang")
    tenants = [{"id": "emb", "api_keys": [KEY], "max_concurrency": 2}]
    # the faulty worker fails on purpose again and again: its breaker is not what is tested here
    gw, _, sim_ids = await fleet(ctx, 1, [fp], tenants=tenants, pool={"breaker_failures": 100})
    # A: a healthy simulated worker beside one that never answers: every request answered
    outs = await gather_limited(ctx.pick(8, 20), 2, lambda i: _embed(ctx, gw, "A hang", fault=False,
                                                                     rid=f"emb-{ctx.tag}-{i}"))
    ok = [o for o in outs if o.category == ANSWERED and isinstance(o.data, dict)]
    ctx.check("A: every request answered by the simulated worker (the silent one failed over)",
              len(ok) == len(outs), str([o.why for o in outs if o not in ok][:3]))
    ctx.check("A: the simulated worker answered with vectors and usage",
              all(o.data.get("usage", {}).get("prompt_tokens", 0) > 0 and len(o.data.get("data", [])) == 2
                  for o in ok), str(ok[0].data)[:200] if ok else "no answer")
    seen = [e for e in (await faulty_stats(ctx, fp)).get("log", []) if e.get("path") == PATH]
    ctx.check("A: the silent worker was tried, with the served name and the request id",
              bool(seen) and all(e.get("model") == MODEL and str(e.get("x-request-id", "")).startswith("emb-")
                                 for e in seen), str(seen[:2]))
    # B: the silent worker alone
    await drain(ctx, gw, sim_ids[0])
    o = await _embed(ctx, gw, "B hang", fault=True)
    ctx.check("B: a worker that never answers is a 504 within the deadline", o.status == 504, o.why)
    # B: two at a time at most for the tenant
    outs = await asyncio.gather(*(_embed(ctx, gw, "B cap", fault=True) for _ in range(4)))
    ctx.check("B: the tenant's cap applies (429 with Retry-After beyond 2 in flight)",
              any(x.category == REFUSED and x.status == 429 for x in outs), str([x.status for x in outs]))
    for mode, what in (("s202", "a 202 is not relayed"), ("s500", "a 500's message is relayed without its internals")):
        await set_mode(ctx, fp, mode)
        o = await _embed(ctx, gw, f"B {mode}", fault=True)
        ctx.check(f"B: {what}", o.status == 502 and o.category == RELAYED, o.why)
        if mode == "s500":
            ctx.check("B: the 500's own words reach the client", "engine crashed" in (o.error_message or ""),
                      str(o.error_message))
    # two 80 MB answers at once (chunked: bounded while read), the gateway's memory watched
    await set_mode(ctx, fp, "huge")
    ctx.sampler.reset(gw.pid)
    base = ctx.sampler.sample_now(gw.pid) or 0
    outs = await asyncio.gather(*(_embed(ctx, gw, "B huge", fault=True) for _ in range(2)))
    ctx.check("B: an 80 MB answer is a 502 (over limits.max_embeddings_answer_bytes)",
              all(o.status == 502 and o.category == RELAYED for o in outs), str([o.why for o in outs]))
    ctx.sampler.sample_now(gw.pid)
    grew = (ctx.sampler.mib(gw.pid).get("max", 0.0) * 2**20 - base) / 2**20
    ctx.note(f"gateway RSS grew by {grew:.0f} MiB over two 80 MB answers")
    ctx.check("B: the gateway's RSS grows by less than 256 MiB over two 80 MB answers", grew < 256,
              f"{grew:.0f} MiB")
