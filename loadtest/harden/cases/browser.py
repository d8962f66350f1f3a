"""The admin API against a web page in the operator's browser.

With no admin token (the newcomer's default) the admin API answers local clients, and
the browser is one: a page may POST `text/plain` or a form to 127.0.0.1 without a CORS
preflight (drain, add, remove a worker), read answers through DNS rebinding (its own
host name in `Host`), and, if it can add a worker, point the gateway at the LAN.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from ..client import Reply, open_conn, read_response
from ..outcome import Spec, classify
from ..procs import GatewayProc
from ..runner import Ctx, case
from .common import fleet

EVIL = "http://evil.example"


async def _raw_head(ctx: Ctx, gw: GatewayProc, head: str, body: bytes, label: str) -> None:
    """A request written byte for byte (its own Host header), judged like `ctx.call`."""
    rep = Reply()
    t0 = time.monotonic()
    try:
        reader, writer = await open_conn("127.0.0.1", gw.port)
        writer.write(head.encode("latin-1") + body)
        await writer.drain()
        await asyncio.wait_for(read_response(rep, t0, reader), 10.0 * ctx.stretch)
        writer.close()
    except TimeoutError:
        rep.timed_out = True
    except OSError as e:
        rep.error = f"{type(e).__name__}: {e}"
    rep.elapsed = time.monotonic() - t0
    ctx.result.add(classify(rep, Spec(must_refuse=True, tenant_facing=False), label))


@case("admin_cross_site", "a web page's requests to the open admin API: text/plain, forms, foreign Origin, "
      "DNS rebinding, a LAN worker", small_s=90, full_s=120)
async def admin_cross_site(ctx: Ctx) -> None:
    gw, _, (wid,) = await fleet(ctx, 1)
    refuse = Spec(must_refuse=True, tenant_facing=False)
    add_body = {"id": f"evil-{ctx.tag}", "url": "http://127.0.0.1:9"}
    plain = {"Content-Type": "text/plain"}
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    sends: tuple[tuple[str, str, Any, dict[str, str], str], ...] = (
        ("POST", f"/admin/workers/{wid}/drain", b"", {"Origin": EVIL}, "drain, foreign Origin"),
        ("POST", f"/admin/workers/{wid}/drain", b"{}", plain, "drain, text/plain"),
        ("POST", f"/admin/workers/{wid}/drain", b"a=1", form, "drain, a form"),
        ("DELETE", f"/admin/workers/{wid}", None, {"Origin": "null"}, "remove, Origin null"),
        ("POST", "/admin/workers", add_body, plain, "add, text/plain"),
        ("POST", "/admin/workers", add_body, {"Origin": EVIL}, "add, JSON from a foreign Origin"),
        ("POST", "/admin/workers", {"id": f"lan-{ctx.tag}", "url": "http://192.168.1.20:8000"}, {},
         "add a LAN worker without a token"),
    )
    for method, path, body, headers, label in sends:
        await ctx.call(gw, method, path, body, headers=headers, spec=refuse, label=label, timeout=10.0)
    for path in ("/admin/workers", "/admin/index"):  # DNS rebinding: the page's own name as Host
        head = f"GET {path} HTTP/1.1\r\nHost: evil.example:{gw.port}\r\nConnection: close\r\n\r\n"
        await _raw_head(ctx, gw, head, b"", f"GET {path}, Host: evil.example")
    states = {w.get("id"): w.get("state") for w in await ctx.workers_state(gw)}
    ctx.check("the worker is still there and healthy, nothing was added", states == {wid: "healthy"}, str(states))
    # the operator's own calls still work
    ok = await ctx.raw(gw, "POST", f"/admin/workers/{wid}/drain", {}, headers={"Origin": gw.url})
    ctx.check("a same-origin JSON call is served", ok.status == 200, f"status {ok.status}")
