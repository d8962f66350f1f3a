"""Clients that misbehave: slow readers, clients that leave (before the body, mid-body,
before the first byte, mid-stream), and a connection reused after a 413/401 that was
sent before its body had been read.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from ..client import Reply, encode_body, head_bytes, open_conn, read_response
from ..config import SERVED
from ..outcome import CHAT, Spec, classify
from ..procs import GatewayProc, SimCluster
from ..runner import Ctx, case
from .common import CHAT_PATH, ask, chat_body, fleet, wait_until, words


@case("slow_readers", "clients that read their streams very slowly, next to normal ones", small_s=120, full_s=400)
async def slow_readers(ctx: Ctx) -> None:
    gw, _, _ = await fleet(ctx, 2)
    rng = random.Random(1)
    n_slow = ctx.pick(8, 32)
    stop = asyncio.Event()

    async def slow(i: int) -> None:
        body = chat_body(words(40, rng, f"slow {i}"), max_tokens=ctx.pick(120, 400), stream=True)
        # a 4 KiB socket buffer, 256-byte reads, 40 ms apart: ~6 KB/s
        await ctx.call(gw, "POST", CHAT_PATH, body, spec=Spec(expect=CHAT, stream=True), timeout=90.0,
                       label="slow-reader", rcvbuf=4096, read_size=256, read_pause=0.04)

    async def normal() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            await ask(ctx, gw, words(30, rng, f"normal {i}"), stream=i % 2 == 0, max_tokens=16, timeout=5.0,
                      label="normal-next-to-slow")

    slows = [asyncio.ensure_future(slow(i)) for i in range(n_slow)]
    normals = [asyncio.ensure_future(normal()) for _ in range(3)]
    await asyncio.gather(*slows)
    stop.set()
    await asyncio.gather(*normals)


async def _idle(ctx: Ctx, gw: GatewayProc, sc: SimCluster | None, timeout: float) -> tuple[bool, str]:
    """Nothing left in flight: the gateway's per-worker count and each worker's own queues."""
    last: dict[str, Any] = {}

    async def ok() -> bool:
        ws = await ctx.workers_state(gw)
        infl = {w.get("id"): w.get("inflight") for w in ws}
        loads = {}
        for w in sc.workers if sc else []:
            d = await ctx.json(w.url, "/load")
            if isinstance(d, dict):
                loads[w.worker_id] = int(d.get("running_requests", 0)) + int(d.get("waiting_requests", 0))
        last.update(gateway_inflight=infl, worker_requests=loads)
        return all(v == 0 for v in infl.values()) and all(v == 0 for v in loads.values())

    good = await wait_until(ok, timeout, 0.3)
    return good, str(last)


@case("client_disconnects", "clients that leave: before/mid body, before the first byte, mid-stream",
      small_s=90, full_s=300)
async def client_disconnects(ctx: Ctx) -> None:
    gw, sc, _ = await fleet(ctx, 2)
    rng = random.Random(2)
    n = ctx.pick(6, 30)
    long = 800  # tokens: the worker is still generating when the client leaves

    async def leave(i: int, how: str) -> None:
        stream = how in ("after_headers", "after_first_chunk")
        body = chat_body(words(40, rng, f"leave {how} {i}"), max_tokens=long, stream=stream)
        kw: dict[str, Any] = {"abort": how} if how != "timer" else {"abandon_after": 0.3}
        await ctx.call(gw, "POST", CHAT_PATH, body, spec=Spec(expect=CHAT, stream=stream), timeout=30.0,
                       label=f"leave-{how}", **kw)

    hows = ("before_body", "mid_body", "after_headers", "after_first_chunk", "timer")
    await asyncio.gather(*(leave(i, h) for i in range(n) for h in hows))
    ctx.note(f"{ctx.result.counts['abandoned']} requests abandoned on purpose")
    ok, detail = await _idle(ctx, gw, sc, 10.0)
    ctx.check("nothing left in flight 10 s after the clients left (gateway and workers)", ok, detail)
    m = await ctx.metrics(gw)
    ctx.note(f"kvroute_disconnects = {m.get('kvroute_disconnects_total', m.get('kvroute_disconnects', 0)):.0f}")
    for i in range(n):  # and the gateway still serves
        await ask(ctx, gw, words(30, rng, f"after {i}"), stream=i % 2 == 0, max_tokens=8, timeout=15.0,
                  label="after-disconnects")


@case("body_413_keepalive", "a connection reused after a 413/401 sent before the body was read",
      small_s=60, full_s=120)
async def body_413_keepalive(ctx: Ctx) -> None:
    key = f"sk-harden-{ctx.tag}-tenant"
    gw, _, _ = await fleet(ctx, 1, limits={"max_body_bytes": 65536}, tenants=[{"id": "t1", "api_keys": [key]}],
                           admin_token=f"adm-{ctx.tag}")
    auth = {"Authorization": f"Bearer {key}"}
    big = encode_body(chat_body("x " * 100_000, max_tokens=4))  # ~200 KB, over the 64 KiB limit
    small = encode_body(chat_body("hello there", max_tokens=4))
    for _ in range(ctx.pick(2, 10)):
        # 1. Content-Length over the limit, the whole body sent anyway (what SDKs do)
        await _reuse(ctx, gw, "content-length", head_bytes("POST", CHAT_PATH, "127.0.0.1", gw.port,
                                                               auth, len(big), True), big, 413, auth, small)
        # 2. a chunked body that passes the limit while being read
        chunked = b"".join(b"%x\r\n" % len(big[i:i + 16384]) + big[i:i + 16384] + b"\r\n"
                           for i in range(0, len(big), 16384)) + b"0\r\n\r\n"
        h = dict(auth, **{"Transfer-Encoding": "chunked"})
        await _reuse(ctx, gw, "chunked", head_bytes("POST", CHAT_PATH, "127.0.0.1", gw.port, h, None, True),
                     chunked, 413, auth, small)
        # 3. a wrong API key: refused before the (small) body is read
        mid = encode_body(chat_body("y " * 8000, max_tokens=4))
        await _reuse(ctx, gw, "bad-key", head_bytes("POST", CHAT_PATH, "127.0.0.1", gw.port,
                                                        {"Authorization": "Bearer sk-wrong-key-000"}, len(mid), True),
                     mid, 401, auth, small)
        # 5. `Expect: 100-continue` (curl does it for large bodies): refused before the body,
        #    which the client then never sends; the connection must not wait for it
        h = dict(auth, Expect="100-continue")
        await _reuse(ctx, gw, "expect-413", head_bytes("POST", CHAT_PATH, "127.0.0.1", gw.port, h, len(big), True),
                     big, 413, auth, small, expect=True)
        h = {"Authorization": "Bearer sk-wrong-key-000", "Expect": "100-continue"}
        await _reuse(ctx, gw, "expect-401", head_bytes("POST", CHAT_PATH, "127.0.0.1", gw.port, h, len(mid), True),
                     mid, 401, auth, small, expect=True)
        # 4. control: invalid JSON, read whole, refused: the connection stays usable
        junk = b'{"model": "' + SERVED.encode() + b'", "messages": [oops'
        await _reuse(ctx, gw, "bad-json", head_bytes("POST", CHAT_PATH, "127.0.0.1", gw.port, auth, len(junk),
                                                         True), junk, 400, auth, small)


async def _reuse(ctx: Ctx, gw: GatewayProc, label: str, head: bytes, body: bytes, status: int,
                 auth: dict[str, str], follow: bytes, expect: bool = False) -> None:
    """Send head+body on a keep-alive connection, read the refusal, then reuse the
    connection for a valid request (or open a new one if the server said it closes).
    With `expect` the body is sent only if the server answers `100 Continue`."""
    t0 = time.monotonic()
    reader, writer = await open_conn("127.0.0.1", gw.port)

    async def send_all(payload: bytes) -> None:
        try:
            writer.write(head)
            for i in range(0, len(payload), 65536):
                writer.write(payload[i:i + 65536])
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    async def on_continue() -> None:
        writer.write(body)

    sender = asyncio.ensure_future(send_all(b"" if expect else body))
    first = Reply()
    try:
        await asyncio.wait_for(read_response(first, t0, reader, on_continue=on_continue if expect else None), 10.0)
    except TimeoutError:
        first.timed_out = True
    except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        first.error = f"{type(e).__name__}: {e}"
    first.elapsed = time.monotonic() - t0
    ctx.result.add(classify(first, Spec(ok_statuses=(status,), secrets=tuple(ctx.secrets)), f"{label}-refusal"))
    sent, _ = await asyncio.wait({sender}, timeout=2.0)
    sender.cancel()
    ctx.log(f"{label}: first reply {first.status} after {first.elapsed:.2f} s, body sent: {bool(sent)}, "
            f"{time.monotonic() - t0:.2f} s")
    if first.headers.get("connection", "").lower() == "close" or first.status is None or first.timed_out:
        writer.transport.abort()
        await ctx.call(gw, "POST", CHAT_PATH, follow, spec=Spec(expect=CHAT), headers=auth, timeout=15.0,
                       label=f"{label}-new-connection")
        return
    # the server kept the connection open without saying otherwise: it must serve the next request on it
    t1 = time.monotonic()
    second = Reply()
    if not sent:  # it stopped reading our body, yet did not say it would close: the client is stuck
        second.timed_out = True
        second.elapsed = 2.0
        o = classify(second, Spec(expect=CHAT), f"{label}-reused")
        o.why = (f"after a {first.status} without `Connection: close` the server stopped reading the rest of the "
                 "body: the connection can carry nothing more, and the client cannot know")
        ctx.result.add(o)
        writer.transport.abort()
        return
    try:
        writer.write(head_bytes("POST", CHAT_PATH, "127.0.0.1", gw.port, auth, len(follow), True) + follow)
        await writer.drain()
        await asyncio.wait_for(read_response(second, t1, reader), 5.0)
    except TimeoutError:
        second.timed_out = True
    except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        second.error = f"{type(e).__name__}: {e}"
    second.elapsed = time.monotonic() - t1
    o = classify(second, Spec(expect=CHAT, secrets=tuple(ctx.secrets)), f"{label}-reused")
    if o.category != "answered":
        o.why = f"on the reused connection after a {first.status} without `Connection: close`: {o.why}"
    ctx.result.add(o)
    writer.transport.abort()
