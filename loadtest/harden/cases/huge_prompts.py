"""Two tenants sending ~8 MB prompts while a third one works: the gateway's memory stays
bounded and the third tenant does not notice.

Phase 1 measures tenant C alone (its latency p99 and one 100 KB prompt); phase 2 repeats
the same traffic while tenants A and B each keep one huge body in flight (chat text,
completion text, completion token ids and a chat of many messages, in turn), waiting out
the Retry-After of a 429 as the OpenAI SDK does. The
gateway's RSS is sampled every 0.1 s over phase 2 and 3 s after it.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

from ..config import kvroute_worker
from ..outcome import Spec
from ..procs import GatewayProc
from ..runner import Ctx, case
from .common import CHAT_PATH, COMP_PATH, ask, big_text, chat_body, comp_body, wait_all_healthy, words

PEAK_MIB = 600  # the gateway's RSS over phase 2, absolute
P99_RATIO = 1.2  # tenant C's p99 with the huge prompts over its p99 alone
P99_SLACK_S = 0.010  # below this a p99 difference is scheduling noise on a shared machine


def _huge_bodies(size: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    """Bodies of about `size` bytes each, in the shapes a prompt can take."""
    text = big_text(size, rng)
    n_ids = size // 5  # "1234," is five bytes
    per_msg = size // 4000 - 48  # the message's own JSON around its content
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": text[i * per_msg:(i + 1) * per_msg]}
            for i in range(4000)]
    return [
        (CHAT_PATH, chat_body(text, max_tokens=4)),
        (COMP_PATH, comp_body(text, max_tokens=4)),
        (COMP_PATH, comp_body([1000 + (i % 7000) for i in range(n_ids)], max_tokens=4)),
        (CHAT_PATH, {**chat_body("", max_tokens=4), "messages": msgs}),
    ]


async def _fleet(ctx: Ctx) -> tuple[GatewayProc, list[dict[str, str]]]:
    """Two simulated workers; tenants a and b (noisy) and c (the bystander)."""
    sc = await ctx.sim(2)
    workers = [kvroute_worker(ctx.worker_id("hp"), w.url) for w in sc.workers]
    keys = [f"sk-harden-{t}-{ctx.tag}" for t in "abc"]
    admin = f"adm-harden-{ctx.tag}"
    tenants = [{"id": f"tenant-{t}", "api_keys": [k]} for t, k in zip("abc", keys, strict=True)]
    cfg = ctx.config(workers, tenants=tenants, admin_token=admin)
    gw = await ctx.gateway(cfg, wait_ready=False)
    await wait_all_healthy(ctx, gw, len(workers), headers={"Authorization": f"Bearer {admin}"})
    return gw, [{"Authorization": f"Bearer {k}"} for k in keys]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _children_peak_mib(pid: int) -> float:
    """Peak RSS (VmHWM) of a process's children together: the gateway's screen helper."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except (OSError, ValueError):
        return 0.0
    for k in kids:
        try:
            with open(f"/proc/{k}/status") as f:
                total += next((int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")), 0) / 1024
        except (OSError, ValueError):
            pass
    return total


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else (xs[0] if xs else 0.0)


@case("huge_prompts", "two tenants' ~8 MB prompts (3 MB small): gateway RSS peak and a third tenant's p99",
      small_s=150, full_s=300)
async def huge_prompts(ctx: Ctx) -> None:
    gw, (ha, hb, hc) = await _fleet(ctx)
    rng = random.Random(25)
    bodies = _huge_bodies(int(ctx.pick(3e6, 7.9e6)), rng)
    encoded = [(p, json.dumps(b, separators=(",", ":")).encode()) for p, b in bodies]
    ctx.note("huge bodies: " + ", ".join(f"{len(e) / 1e6:.1f} MB" for _, e in encoded))
    del bodies
    mid = big_text(100_000, rng)
    duration = float(ctx.pick(8, 20))

    async def bystander(until: float, out: list[float], k: int) -> None:
        i = 0
        while time.monotonic() < until:
            i += 1
            o = await ask(ctx, gw, words(60, rng, f"c{k} {i}"), stream=i % 2 == 0, max_tokens=8, timeout=10.0,
                          headers=hc, label="tenant-c")
            out.append(o.elapsed)

    async def hundred_kb() -> float:
        await asyncio.sleep(duration / 2)
        o = await ctx.call(gw, "POST", CHAT_PATH, chat_body(mid, max_tokens=4), headers=hc, timeout=30.0,
                           spec=Spec(ok_statuses=(200, 400, 413)), label="tenant-c-100KB")
        return o.elapsed

    statuses: dict[int, int] = {}

    async def noisy(h: dict[str, str], until: float, first: int) -> int:
        """Huge bodies back to back, waiting out a 429's Retry-After as SDK clients do."""
        i = first
        while time.monotonic() < until:
            path, body = encoded[i % len(encoded)]
            i += 1
            o = await ctx.call(gw, "POST", path, body, headers=h, timeout=30.0,
                               spec=Spec(ok_statuses=(200, 400, 413, 429)), label=f"huge-{i % len(encoded)}")
            statuses[o.status or 0] = statuses.get(o.status or 0, 0) + 1
            if o.status == 429:
                await asyncio.sleep(min(float(o.headers.get("retry-after", "1")), max(0.0, until - time.monotonic())))
        return i - first

    async def phase(with_noise: bool) -> tuple[list[float], float, int]:
        until = time.monotonic() + duration
        lat: list[float] = []
        jobs: list[Any] = [bystander(until, lat, 0), bystander(until, lat, 1), hundred_kb()]
        if with_noise:
            jobs += [noisy(ha, until, 0), noisy(hb, until, 1)]
        got = await asyncio.gather(*jobs)
        return lat, got[2], sum(got[3:])

    cpu0 = _cpu_s(gw.pid)
    base, base_100k, _ = await phase(False)
    ctx.sampler.reset(gw.pid)
    cpu1 = _cpu_s(gw.pid)
    loud, loud_100k, n_huge = await phase(True)
    cpu2 = _cpu_s(gw.pid)
    peak = ctx.sampler.mib(gw.pid).get("max", 0.0)
    await asyncio.sleep(3.0)
    ctx.sampler.sample_now(gw.pid)
    mib = ctx.sampler.mib(gw.pid)
    ctx.result.rss_mb = mib
    p_base, p_loud = _p99(base), _p99(loud)
    ctx.note(f"tenant C alone: {len(base)} requests, p50 {statistics.median(base) * 1e3:.0f} ms, "
             f"p99 {p_base * 1e3:.0f} ms; 100 KB prompt {base_100k:.2f} s")
    ctx.note("huge prompts answered: " + ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items())))
    ctx.note(f"with {n_huge} huge prompts: {len(loud)} requests, p50 {statistics.median(loud) * 1e3:.0f} ms, "
             f"p99 {p_loud * 1e3:.0f} ms; 100 KB prompt {loud_100k:.2f} s")
    ctx.note(f"gateway CPU: {cpu1 - cpu0:.1f} s alone, {cpu2 - cpu1:.1f} s with the huge prompts "
             f"({(cpu2 - cpu1 - (cpu1 - cpu0) * len(loud) / max(1, len(base))) / max(1, n_huge) * 1e3:.0f} ms "
             "per huge prompt beyond tenant C's share)")
    ctx.note(f"gateway RSS: start {mib.get('start', 0):.0f} MiB, peak {peak:.0f} MiB, "
             f"3 s after {mib.get('end', 0):.0f} MiB; its child processes' peak {_children_peak_mib(gw.pid):.0f} MiB")
    ctx.check(f"gateway RSS peak at most {PEAK_MIB} MiB", peak <= PEAK_MIB, f"{peak:.0f} MiB")
    if not ctx.small:  # a small run's few hundred requests make a p99 of noise on a shared machine
        ctx.check(f"tenant C's p99 within {P99_RATIO:.1f}x of its p99 alone",
                  p_loud <= P99_RATIO * p_base + P99_SLACK_S, f"{p_loud * 1e3:.0f} ms vs {p_base * 1e3:.0f} ms")
