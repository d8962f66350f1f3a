"""Details of the edge: `/tokenize`'s `return_token_strs` and unknown fields,
`continuous_usage_stats` without `include_usage` (no per-chunk usage, as vLLM), a vLLM
worker's own 5xx message relayed without its internals, `loadtest simulate --speed 0`,
and a request with two `Authorization` headers."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from ...tracefiles import MOONCAKE_SLICE
from ..client import Reply, head_bytes, open_conn, read_response, sse_events
from ..config import SERVED, kvroute_worker
from ..faulty import INTERNAL_MARKER
from ..outcome import COMPLETION, JSON, REFUSED, RELAYED, Spec, classify
from ..procs import GatewayProc
from ..runner import Ctx, case
from .common import COMP_PATH, comp_body, drain, set_mode, wait_all_healthy

KEY = "sk-edge-tenant-00001"


@case("edge_details", "/tokenize fields, per-chunk usage, a vLLM 5xx message, --speed 0, two Authorization headers",
      small_s=60, full_s=90)
async def edge_details(ctx: Ctx) -> None:
    fp = await ctx.faulty("ok", kind="vllm", tokens=6)
    sc = await ctx.sim(1)
    sim_id = ctx.worker_id("hw")
    workers = [kvroute_worker(sim_id, sc.workers[0].url), {"id": fp.worker_id, "url": fp.url, "kind": "vllm"}]
    gw = await ctx.gateway(ctx.config(workers, tenants=[{"id": "edge", "api_keys": [KEY]}]), wait_ready=False)
    ctx.check("both workers register", await wait_all_healthy(ctx, gw, 2))
    auth = {"Authorization": f"Bearer {KEY}"}
    await _tokenize(ctx, gw, auth)
    await drain(ctx, gw, sim_id)  # from here on the vLLM worker alone
    await _usage(ctx, gw, auth)
    await set_mode(ctx, fp, "s500")
    o = await ctx.call(gw, "POST", COMP_PATH, comp_body("x", max_tokens=4), headers=auth, label="vllm 500",
                       spec=Spec(expect=COMPLETION, worker_fault=True, single_worker=True,
                                 secrets=(INTERNAL_MARKER,)))
    ctx.check("a vLLM worker's 500 is relayed with its own words, without its internals",
              o.category == RELAYED and "engine crashed" in (o.error_message or ""), o.why)
    await _two_keys(ctx, gw)
    await _speed_zero(ctx)


async def _tokenize(ctx: Ctx, gw: GatewayProc, auth: dict[str, str]) -> None:
    o = await ctx.call(gw, "POST", "/tokenize", {"model": SERVED, "prompt": "hello world", "return_token_strs": True},
                       headers=auth, spec=Spec(expect=JSON), label="tokenize strs")
    d = o.data if isinstance(o.data, dict) else {}
    strs = d.get("token_strs")
    ctx.check("/tokenize returns token_strs, one per token", isinstance(strs, list) and len(strs) == d.get("count")
              and all(isinstance(s, str) for s in strs), str(d)[:200])
    for body, field in (({"model": SERVED, "prompt": "x", "no_such_field": 1}, "no_such_field"),
                        ({"model": SERVED, "prompt": "x", "chat_template": "{{ x }}"}, "chat_template")):
        o = await ctx.call(gw, "POST", "/tokenize", body, headers=auth, spec=Spec(ok_statuses=(400,)),
                           label="tokenize unknown")
        ctx.check(f"/tokenize refuses `{field}` with a 400 naming it",
                  o.category == REFUSED and f"`{field}`" in (o.error_message or ""), o.why)


async def _usage(ctx: Ctx, gw: GatewayProc, auth: dict[str, str]) -> None:
    for include in (False, True):
        so: dict[str, Any] = {"continuous_usage_stats": True, **({"include_usage": True} if include else {})}
        rep = await ctx.raw(gw, "POST", COMP_PATH, comp_body("count to six", max_tokens=6, stream=True,
                                                             stream_options=so), headers=auth, timeout=15.0)
        ctx.result.add(classify(rep, Spec(expect=COMPLETION, stream=True), "continuous usage"))
        n = sum(bool(isinstance(d, dict) and d.get("usage")) for d in map(_decode, sse_events(rep.body)[0]))
        if include:
            ctx.check("with include_usage, continuous_usage_stats gives usage on every chunk", n >= 6,
                      f"{n} chunks carried usage")
        else:
            ctx.check("continuous_usage_stats alone gives no usage at all (vLLM's rule)", n == 0,
                      f"{n} chunks carried usage")


def _decode(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


async def _two_keys(ctx: Ctx, gw: GatewayProc) -> None:
    """Two Authorization headers (a dict cannot hold them: the request is written by hand)."""
    body = msgspec.json.encode(comp_body("x", max_tokens=2))
    rep = Reply()
    t0 = time.monotonic()
    reader, writer = await open_conn("127.0.0.1", gw.port)
    try:
        head = head_bytes("POST", COMP_PATH, "127.0.0.1", gw.port,
                          {"Authorization": "Bearer sk-wrong-key-00000"}, len(body), False)
        head = head[:-2] + f"Authorization: Bearer {KEY}\r\n\r\n".encode()
        writer.write(head + body)
        await asyncio.wait_for(read_response(rep, t0, reader), 10.0)
    finally:
        writer.close()
    rep.elapsed = time.monotonic() - t0
    o = classify(rep, Spec(ok_statuses=(400,)), "two keys")
    ctx.result.add(o)
    ctx.check("two Authorization headers: a 400 naming the header", o.category == REFUSED
              and "authorization" in (o.error_message or ""), o.why)


async def _speed_zero(ctx: Ctx) -> None:
    proc = ctx.procs.spawn("simulate-speed-0", [ctx.st.python, "-m", "kvroute.cli", "loadtest", "simulate",
                                                "--trace", str(MOONCAKE_SLICE), "--limit", "5", "--workers", "2",
                                                "--policies", "round_robin", "--speed", "0",
                                                "--out", str(ctx.folder / "simulate-speed-0")])
    t0 = time.monotonic()
    while proc.alive and time.monotonic() - t0 < 60.0:
        await asyncio.sleep(0.1)
    code = proc.popen.poll()
    text = proc.log.read_text(errors="replace")
    ctx.check("loadtest simulate --speed 0: exit 2 naming --speed, no traceback",
              code == 2 and "--speed" in text and "Traceback" not in text, f"exit {code}: {text[-300:]!r}")
