"""The admin API and the workers' own surface: a worker registered with an `ipc://`
event endpoint and `bind: true` must not replace files; a worker URL must not be a
tool to reach arbitrary hosts, paths or credentials (SSRF); simulated workers must not
advertise `peer_pull` without a peer token.

The gateway runs the embedded default config (configs/default.yaml: no admin token,
no tenants), as a newcomer's `kvroute serve` would.
"""
from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from ..config import namespace_digest
from ..outcome import JSON, Spec
from ..procs import REPO, GatewayProc
from ..runner import Ctx, case

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_PROFILE = "h200-llama3.1-8b"  # configs/default.yaml's


def _default_config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    cfg["models"][0]["tokenizer"] = str(REPO / "configs" / "assets" / "tiny-tokenizer")
    cfg["observability"] = {"log_level": "WARNING"}
    cfg.update(over)
    return cfg


async def _default_gateway(ctx: Ctx, **over: Any) -> GatewayProc:
    return await ctx.gateway(_default_config(**over), wait_ready=False)


def _describe(p: Path) -> str:
    try:
        st = p.lstat()
    except FileNotFoundError:
        return "absent"
    if stat.S_ISSOCK(st.st_mode):
        return "a socket"
    if stat.S_ISREG(st.st_mode):
        return f"a regular file of {st.st_size} bytes"
    return f"mode {oct(st.st_mode)}"


@case("admin_ipc_bind", "POST /admin/workers with events ipc://FILE, bind: true must not replace FILE",
      small_s=60, full_s=120)
async def admin_ipc_bind(ctx: Ctx) -> None:
    victim_dir = ctx.folder / "victim"
    victim_dir.mkdir(exist_ok=True)
    # a worker of the default model (its digest too, so a kvroute-kind registration gets as far as events)
    target = await ctx.faulty("ok", kind="vllm", model=DEFAULT_MODEL, served=[DEFAULT_MODEL, "llama-3.1-8b"],
                              digest=namespace_digest(DEFAULT_PROFILE))
    phases: tuple[tuple[str, dict[str, Any], dict[str, str]], ...] = (("no admin token (the default config)", {}, {}),
              ("with the admin token", {"admin_token": f"adm-{ctx.tag}"}, {"Authorization": f"Bearer adm-{ctx.tag}"}))
    gws = await asyncio.gather(*(_default_gateway(ctx, **over) for _, over, _ in phases))
    files = []
    for gw, (phase, _, headers) in zip(gws, phases, strict=True):
        tag = "auth" if headers else "open"
        victim = victim_dir / f"important-{tag}.txt"
        content = f"precious data {ctx.tag}\n"
        victim.write_text(content)
        fresh = victim_dir / f"never-existed-{tag}.sock"
        files.append((phase, victim, content, fresh))
        for kind, i, path in (("vllm", 0, victim), ("kvroute", 1, fresh)):
            body = {"id": f"evil-{tag}-{i}", "url": target.url, "kind": kind,
                    "events": {"endpoint": f"ipc://{path}", "bind": True}}
            await ctx.call(gw, "POST", "/admin/workers", body, headers=headers, timeout=10.0,
                           spec=Spec(tenant_facing=False), label=f"add-ipc-worker ({phase})")
    await asyncio.sleep(3.0)  # registration: health, models, then the subscription
    for phase, victim, content, fresh in files:
        intact = victim.is_file() and not victim.is_symlink() and victim.read_text() == content
        ctx.check(f"{phase}: a file the gateway can write is not replaced", intact,
                  f"{victim} is now {_describe(victim)}")
        ctx.check(f"{phase}: no socket file is created", not fresh.exists(), f"{fresh} is now {_describe(fresh)}")


_CONTRACT = {"/health", "/info", "/load", "/metrics", "/v1/models"}


@case("admin_ssrf", "worker URLs with credentials, paths, queries, metadata hosts; contract paths only",
      small_s=60, full_s=120)
async def admin_ssrf(ctx: Ctx) -> None:
    rec = await ctx.faulty("record", worker_id=ctx.worker_id("internal"))
    gw = await _default_gateway(ctx)
    port = rec.port
    bad = [
        ("credentials", f"http://admin:hunter2@127.0.0.1:{port}"),
        ("path", f"http://127.0.0.1:{port}/internal/billing/export"),
        ("query", f"http://127.0.0.1:{port}?token=abc"),
        ("fragment", f"http://127.0.0.1:{port}/#x"),
        ("path traversal", f"http://127.0.0.1:{port}/../../admin"),
        ("metadata address", "http://169.254.169.254"),
        ("metadata address (IPv6-mapped)", "http://[::ffff:169.254.169.254]"),
        ("metadata name", "http://metadata.google.internal"),
        ("unspecified address", f"http://0.0.0.0:{port}"),
    ]
    for i, (what, url) in enumerate(bad):
        await ctx.call(gw, "POST", "/admin/workers", {"id": f"ssrf-{i}", "url": url, "kind": "vllm"}, timeout=10.0,
                       spec=Spec(must_refuse=True, tenant_facing=False), label=f"worker url with {what}")
    # a plain URL to something that is no worker: allowed to register (on an allowed
    # network); the admin view says why it is not routable, status included, since its
    # reader is the operator (the allow-list of networks is the defence, not silence)
    await ctx.call(gw, "POST", "/admin/workers", {"id": "not-a-worker", "url": f"http://127.0.0.1:{port}",
                                                  "kind": "vllm"}, timeout=10.0,
                   spec=Spec(tenant_facing=False), label="worker url to a non-worker service")
    await asyncio.sleep(3.5)
    data = await ctx.json(gw, "/admin/workers")
    shown = ""
    for w in (data or {}).get("workers", []):
        if w.get("id") == "not-a-worker":
            shown = f"{w.get('state')} | {w.get('reason')} | {w.get('last_error')}"
    ctx.check("the admin view shows the non-worker as not routable", bool(shown) and "healthy |" not in shown,
              f"/admin/workers shows {shown!r}")
    ctx.check("the admin view relays no body of the non-worker service", "internal-billing" not in shown,
              f"/admin/workers shows {shown!r}")
    stats = await ctx.json(rec.url, "/_stats") or {}
    log = stats.get("log", [])
    off = [e for e in log if e.get("path") not in _CONTRACT or e.get("query") or e.get("authorization")]
    made = [(e.get("path"), e.get("query"), e.get("authorization")) for e in off][:6]
    ctx.check("the gateway only ever asked the worker contract's paths (no path, query or credentials of the URL)",
              not off, f"requests it made: {made}")
    ctx.note(f"the non-worker service was fetched {len(log)} times in ~3.5 s")


@case("sim_peer_pull", "simulated workers advertise peer_pull only with a peer token; /kv/blocks needs it",
      small_s=60, full_s=60)
async def sim_peer_pull(ctx: Ctx) -> None:
    env_had = os.environ.get("KVROUTE_PEER_TOKEN")
    ctx.procs.env.pop("KVROUTE_PEER_TOKEN", None)
    sc = await ctx.sim(1)
    w = sc.workers[0]
    o = await ctx.call(w.url, "GET", "/info", spec=Spec(expect=JSON, tenant_facing=False), label="info")
    caps = (o.data or {}).get("capabilities", []) if isinstance(o.data, dict) else []
    ctx.check("without a peer token, /info does not advertise peer_pull", "peer_pull" not in caps,
              f"capabilities {caps}")
    for method, path, body in (("GET", "/kv/blocks?keys_b64=AAAA", None),
                               ("POST", "/kv/blocks", {"keys_b64": "AAAA", "meta": True})):
        await ctx.call(w.url, method, path, body, spec=Spec(must_refuse=True, tenant_facing=False),
                       label="kv-blocks-without-token")
    if env_had is not None:
        ctx.note("KVROUTE_PEER_TOKEN was set in this environment; the workers were started without it")
