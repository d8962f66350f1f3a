"""Hostile tenants: huge prompts that stall everyone, prompts of special tokens that
freeze the gateway and balloon its memory, and two tenants probing each other through
cached tokens, timing, `/metrics` and the admin explain route.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from ..config import kvroute_worker
from ..outcome import COMPLETION, JSON, Spec
from ..procs import GatewayProc
from ..runner import Ctx, case
from .common import CHAT_PATH, COMP_PATH, ask, big_text, chat_body, comp_body, wait_all_healthy, words


def _keys(ctx: Ctx) -> tuple[str, str, str]:
    return f"sk-harden-a-{ctx.tag}", f"sk-harden-b-{ctx.tag}", f"adm-harden-{ctx.tag}"


async def _tenant_fleet(ctx: Ctx, n_sim: int = 2, **sections: Any) -> tuple[GatewayProc, dict[str, str],
                                                                          dict[str, str], dict[str, str]]:
    ka, kb, admin = _keys(ctx)
    sc = await ctx.sim(n_sim)
    workers = [kvroute_worker(ctx.worker_id("hw"), w.url) for w in sc.workers]
    cfg = ctx.config(workers, tenants=[{"id": "tenant-a", "api_keys": [ka]}, {"id": "tenant-b", "api_keys": [kb]}],
                     admin_token=admin, **sections)
    gw = await ctx.gateway(cfg, wait_ready=False)
    ha, hb, hadm = ({"Authorization": f"Bearer {k}"} for k in (ka, kb, admin))
    await wait_all_healthy(ctx, gw, len(workers), headers=hadm)
    return gw, ha, hb, hadm


async def _health_probes(ctx: Ctx, gw: GatewayProc, stop: asyncio.Event, deadline: float, every: float = 0.1) -> None:
    """GET /health every `every` s while `stop` is not set; each must answer within `deadline`."""
    while not stop.is_set():
        t = time.monotonic()
        await ctx.call(gw, "GET", "/health", spec=Spec(expect=JSON, tenant_facing=False), timeout=deadline,
                       label="health-during")
        await asyncio.sleep(max(0.0, every - (time.monotonic() - t)))


@case("noisy_tenant", "one tenant's huge prompts (2x3 MB small, 2x8 MB full), then a flood of long ones, must not "
      "stall another tenant",
      small_s=120, full_s=400)
async def noisy_tenant(ctx: Ctx) -> None:
    gw, ha, hb, _ = await _tenant_fleet(ctx)
    rng = random.Random(9)
    size = ctx.pick(3, 7.9) * 1_000_000
    bigs = [big_text(int(size), rng) for _ in range(2)]
    small_prompt = words(800, rng)[:5000]  # ~5 KB
    stop = asyncio.Event()
    b_times: list[float] = []

    async def tenant_b() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            o = await ask(ctx, gw, f"{i} {small_prompt}", max_tokens=4, timeout=2.5, headers=hb, label="tenant-b")
            b_times.append(o.elapsed)
            await asyncio.sleep(0.1)

    async def tenant_a(i: int) -> None:
        await ctx.call(gw, "POST", CHAT_PATH, chat_body(bigs[i], max_tokens=4), headers=ha, timeout=10.0,
                       spec=Spec(ok_statuses=(400, 413, 429)), label="tenant-a-huge")

    async def tenant_a_many(until: float) -> None:
        """Then many prompts just long enough to need the tokenizer (over the context all the same)."""
        mids = [big_text(120_000, rng) for _ in range(4)]
        i = 0
        while time.monotonic() < until:
            i += 1
            await asyncio.gather(*(ctx.call(gw, "POST", COMP_PATH, comp_body(f"{i} {j} " + mids[j % 4], max_tokens=4),
                                            headers=ha, timeout=10.0, spec=Spec(ok_statuses=(400, 413, 429)),
                                            label="tenant-a-many") for j in range(12)))

    probes = asyncio.ensure_future(_health_probes(ctx, gw, stop, 1.0, 0.25))
    b = asyncio.ensure_future(tenant_b())
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    await asyncio.gather(tenant_a(0), tenant_a(1), asyncio.sleep(2.0))
    ctx.note(f"the two huge prompts were answered after {time.monotonic() - t0:.1f} s")
    await tenant_a_many(time.monotonic() + ctx.pick(2.0, 10.0))
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(b, probes)
    if b_times:
        ctx.note(f"tenant B: {len(b_times)} requests, latency p50 {statistics.median(b_times) * 1000:.0f} ms, "
                 f"max {max(b_times) * 1000:.0f} ms")


@case("special_tokens", "prompts of 550k special tokens: no frozen /health, bounded memory (x2 small, x8 full)",
      small_s=120, full_s=400)
async def special_tokens(ctx: Ctx) -> None:
    gw, ha, _, _ = await _tenant_fleet(ctx, 1)
    n_req = ctx.pick(2, 8)  # chat and completion prompts in turn
    # pure, and interleaved with text (1.1M segments for the prefix cache and the splitter)
    pure, mixed_ = "<|im_start|>" * 550_000, "<|im_start|>x" * 550_000
    ctx.sampler.reset(gw.pid)
    base = ctx.sampler.sample_now(gw.pid) or 0
    stop = asyncio.Event()
    probes = asyncio.ensure_future(_health_probes(ctx, gw, stop, 1.0))

    async def one(i: int) -> None:
        if i % 2 == 0:
            body = comp_body(mixed_, max_tokens=4)
            path = COMP_PATH
        else:
            body = chat_body(pure, max_tokens=4)
            path = CHAT_PATH
        await ctx.call(gw, "POST", path, body, headers=ha, timeout=15.0, spec=Spec(ok_statuses=(400, 413, 429)),
                       label="special-tokens")

    await asyncio.sleep(0.3)
    await asyncio.gather(*(one(i) for i in range(n_req)))
    await asyncio.sleep(1.0)
    stop.set()
    await probes
    mib = ctx.sampler.mib(gw.pid)
    peak = (max(ctx.sampler.series[gw.pid].max, base) - base) / 2**20
    limit = ctx.pick(256, 512)
    ctx.check(f"gateway RSS grows by at most {limit} MiB", peak <= limit,
              f"RSS {mib.get('start', 0):.0f} MiB before, peak +{peak:.0f} MiB with {n_req} such prompt(s)")


@case("tenant_probe", "tenant B probing tenant A: cached tokens, timing, /metrics, explain and admin routes",
      small_s=120, full_s=400)
async def tenant_probe(ctx: Ctx) -> None:
    gw, ha, hb, hadm = await _tenant_fleet(ctx)
    rng = random.Random(13)
    marker = f"A-SECRET-{ctx.tag}"
    spec_b: dict[str, Any] = {"secrets": (marker,)}

    # 1. cached tokens: A's prompt, sent again by B, must not hit A's cache
    secret = f"{marker} " + words(1500, rng)
    a1 = await ask(ctx, gw, secret, chat=False, max_tokens=2, headers=ha, label="a-secret")
    a2 = await ask(ctx, gw, secret, chat=False, max_tokens=2, headers=ha, label="a-secret-again")
    a_hit = _cached(a2.data)
    ctx.note(f"tenant A's repeat: {a_hit} cached tokens (its own cache works)" if a1.category == "answered" else
             f"tenant A's request: {a1.category} {a1.why}")
    b1 = await ask(ctx, gw, secret, chat=False, max_tokens=2, headers=hb, label="b-same-text", **spec_b)
    b_hit = _cached(b1.data)
    ctx.check("tenant B gets no cached tokens from tenant A's prompt", b_hit == 0,
              f"B's request of A's text reported {b_hit} cached tokens")

    # 2. /metrics and timing: B sends texts A sent before (S) and fresh ones (R), one each
    k = ctx.pick(6, 20)
    seen = [f"{marker} {i} " + big_text(60_000, rng) for i in range(k)]
    fresh = [f"fresh {ctx.tag} {i} " + big_text(60_000, rng) for i in range(k)]
    for s in seen:  # too long for the context: refused, but tokenized (and cached) first
        await ctx.call(gw, "POST", COMP_PATH, comp_body(s, max_tokens=2), headers=ha, timeout=15.0,
                       spec=Spec(expect=COMPLETION), label="a-long")
    unauth = await ctx.raw(gw, "GET", "/metrics")
    as_b = await ctx.raw(gw, "GET", "/metrics", headers=hb)
    readable = unauth.status == 200 or as_b.status == 200
    ctx.note(f"/metrics: {unauth.status} without credentials, {as_b.status} with tenant B's key")
    hb_metric = hb if as_b.status == 200 else {}
    d_seen: list[float] = []
    d_fresh: list[float] = []
    t_seen: list[float] = []
    t_fresh: list[float] = []
    for s, r in zip(seen, fresh, strict=True):
        for text, dl, tl in ((s, d_seen, t_seen), (r, d_fresh, t_fresh)):
            before = await _hit_tokens(ctx, gw, hb_metric) if readable else 0.0
            o = await ctx.call(gw, "POST", COMP_PATH, comp_body(text, max_tokens=2), headers=hb, timeout=15.0,
                               spec=Spec(expect=COMPLETION, secrets=(marker,) if text is r else ()),
                               label="b-probe")
            tl.append(o.elapsed)
            if readable:
                dl.append(await _hit_tokens(ctx, gw, hb_metric) - before)
    if readable:
        leak = statistics.median(d_seen) > 0 and statistics.median(d_fresh) == 0
        ctx.check("/metrics does not tell B which texts A sent (kvroute_tokenize_cache_hit_tokens)", not leak,
                  f"hit-token increase per B request: A's texts {d_seen}, fresh texts {d_fresh}")
    ms, mf = statistics.median(t_seen) * 1000, statistics.median(t_fresh) * 1000
    timing_leak = ms < 0.6 * mf and mf - ms > 5.0
    ctx.check("timing does not tell B which texts A sent", not timing_leak,
              f"median time of B's request: A's texts {ms:.1f} ms, fresh texts {mf:.1f} ms")

    # 3. explain and the other admin routes: never with a tenant's key (or none)
    probe = comp_body(secret, max_tokens=2)
    for hdrs, who in ((hb, "B's key"), ({}, "no credentials"), ({**hb, "X-Tenant": "tenant-a"}, "B's key as A")):
        for method, path, body in (("POST", "/admin/route/explain", probe),
                                   ("POST", "/admin/route/explain?tenant=tenant-a", probe),
                                   ("GET", "/admin/workers", None), ("GET", "/admin/index", None),
                                   ("GET", "/admin/calibration", None),
                                   ("POST", "/admin/tenants/tenant-a/purge", {})):
            await ctx.call(gw, method, path, body, headers=hdrs, timeout=10.0, label=f"admin-as-{who}",
                           spec=Spec(must_refuse=True, tenant_facing=False, secrets=(marker,)))
    # the admin may: sanity that the routes exist and the token works
    data = await ctx.json(gw, "/admin/route/explain?tenant=tenant-a", method="POST", body=probe, headers=hadm)
    ctx.check("the admin token can use explain", isinstance(data, dict), "explain with the admin token failed")


def _cached(data: Any) -> int:
    try:
        return int(data["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)
    except (KeyError, TypeError, ValueError):
        return 0


async def _hit_tokens(ctx: Ctx, gw: GatewayProc, headers: dict[str, str]) -> float:
    rep = await ctx.raw(gw, "GET", "/metrics", headers=headers)
    total = 0.0
    for line in rep.body.decode(errors="replace").splitlines():
        if line.startswith("kvroute_tokenize_cache_hit_tokens") and not line.startswith("#"):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total
