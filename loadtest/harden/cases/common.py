"""What many cases share: request bodies, a standard fleet, admin calls, polling."""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...ports import free_port
from ..config import SERVED, kvroute_worker
from ..load import scaled
from ..outcome import CHAT, COMPLETION, Outcome, Spec
from ..procs import FaultyProc, GatewayProc, SimCluster, free_ports
from ..runner import Ctx

CHAT_PATH = "/v1/chat/completions"
COMP_PATH = "/v1/completions"

_WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
          "upsilon phi chi psi omega river stone cloud maple copper violet harbor meadow signal quartz").split()


def words(n: int, rng: random.Random | None = None, tag: str = "") -> str:
    r = rng or random.Random()
    out = " ".join(r.choice(_WORDS) for _ in range(n))
    return f"{tag} {out}" if tag else out


def big_text(n_bytes: int, rng: random.Random | None = None) -> str:
    """About `n_bytes` of word text (fast: a block of random words repeated with variations)."""
    r = rng or random.Random()
    block = words(2000, r)
    reps = max(1, n_bytes // (len(block) + 8))
    parts = [block]
    for i in range(reps - 1):
        parts.append(f"{i} " + block[r.randrange(0, 500):])
    return " ".join(parts)[:n_bytes]


def chat_body(prompt: str, *, max_tokens: int = 8, stream: bool = False, usage: bool = False,
              **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": SERVED, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                         "stream": stream}
    if stream and usage:
        b["stream_options"] = {"include_usage": True}
    b.update(extra)
    return b


def comp_body(prompt: Any, *, max_tokens: int = 8, stream: bool = False, usage: bool = False,
              **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if stream and usage:
        b["stream_options"] = {"include_usage": True}
    b.update(extra)
    return b


async def ask(ctx: Ctx, gw: GatewayProc | str, prompt: str, *, chat: bool = True, stream: bool = False,
              max_tokens: int = 8, timeout: float = 30.0, label: str = "", headers: dict[str, str] | None = None,
              count: bool = True, usage: bool = False, **spec_kw: Any) -> Outcome:
    """One chat or completion request, judged and counted."""
    body = (chat_body if chat else comp_body)(prompt, max_tokens=max_tokens, stream=stream, usage=usage)
    spec = Spec(expect=CHAT if chat else COMPLETION, stream=stream, **spec_kw)
    return await ctx.call(gw, "POST", CHAT_PATH if chat else COMP_PATH, body, spec=spec, timeout=timeout,
                          label=label or ("chat" if chat else "comp") + ("-stream" if stream else ""),
                          headers=headers, count=count)


def mixed(i: int) -> tuple[bool, bool]:
    """(chat, stream) for the i-th request of a mix: every combination in turn."""
    return (i % 2 == 0, (i // 2) % 2 == 0)


async def gather_limited(n: int, limit: int, fn: Callable[[int], Awaitable[Any]]) -> list[Any]:
    """fn(0..n-1) with at most `limit` running at once."""
    sem = asyncio.Semaphore(limit)

    async def one(i: int) -> Any:
        async with sem:
            return await fn(i)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def wait_until(pred: Callable[[], Awaitable[bool]], timeout: float, every: float = 0.2) -> bool:
    """Poll `pred` for `timeout` seconds of an idle machine (stretched by the load)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        if await pred():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(every)


# ---------------------------------------------------------------------- fleets


async def fleet(ctx: Ctx, n_sim: int = 1, faulty: list[FaultyProc] | None = None, *, sim_extra: list[str] | None = None,
                ready: bool = False, **sections: Any) -> tuple[GatewayProc, SimCluster | None, list[str]]:
    """A gateway over `n_sim` simulated workers (one process) plus the given faulty ones;
    returns (gateway, cluster, the gateway's ids of the simulated workers). The workers
    and the gateway start at the same time (the workers on ports chosen here). The case
    starts once every worker is healthy (`/admin/workers`); with `ready`, once `/ready`
    says so too (how long that takes is noted either way)."""
    base = free_ports(n_sim) if n_sim else 0
    workers: list[dict[str, Any]] = []
    sim_ids: list[str] = []
    for i in range(n_sim):
        wid = ctx.worker_id("hw")
        sim_ids.append(wid)
        workers.append(kvroute_worker(wid, f"http://127.0.0.1:{base + i}"))
    for fp in faulty or []:
        workers.append(kvroute_worker(fp.worker_id, fp.url))
    token = sections.get("admin_token")
    sim_task = asyncio.ensure_future(ctx.sim(n_sim, base_port=base, extra=sim_extra)) if n_sim else None
    gw_port = free_port()
    while base <= gw_port < base + n_sim:
        gw_port = free_port()
    try:
        gw = await ctx.gateway(ctx.config(workers, **sections), port=gw_port, wait_ready=ready)
    finally:
        sc = await sim_task if sim_task is not None else None
    hdrs = {"Authorization": f"Bearer {token}"} if token else None
    if not await wait_all_healthy(ctx, gw, len(workers), headers=hdrs):
        states = [(w.get("id"), w.get("state"), w.get("reason")) for w in await ctx.workers_state(gw, hdrs)]
        ctx.check("every worker registers at start", False, f"not all healthy 20 s after start: {states}")
    return gw, sc, sim_ids


async def wait_all_healthy(ctx: Ctx, gw: GatewayProc, n: int, timeout: float = 20.0,
                           headers: dict[str, str] | None = None) -> bool:
    async def ok() -> bool:
        ws = await ctx.workers_state(gw, headers)
        return len(ws) >= n and all(w.get("state") == "healthy" for w in ws)

    return await wait_until(ok, timeout)


async def admin_post(ctx: Ctx, gw: GatewayProc, path: str, body: Any = None,
                     headers: dict[str, str] | None = None) -> int | None:
    rep = await ctx.raw(gw, "POST", path, body if body is not None else {}, headers=headers)
    return rep.status


async def drain(ctx: Ctx, gw: GatewayProc, wid: str, on: bool = True, headers: dict[str, str] | None = None) -> None:
    st = await admin_post(ctx, gw, f"/admin/workers/{wid}/{'drain' if on else 'undrain'}", headers=headers)
    if st != 200:
        raise RuntimeError(f"could not {'drain' if on else 'undrain'} {wid}: HTTP {st}")


async def set_mode(ctx: Ctx, fp: FaultyProc, mode: str) -> None:
    rep = await ctx.raw(fp.url, "POST", "/_mode", {"mode": mode})
    if rep.status != 200:
        raise RuntimeError(f"faulty worker: mode {mode}: HTTP {rep.status}")


async def faulty_stats(ctx: Ctx, fp: FaultyProc) -> dict[str, Any]:
    data = await ctx.json(fp.url, "/_stats")
    return data if isinstance(data, dict) else {}


async def released(ctx: Ctx, fp: FaultyProc, timeout: float = 10.0) -> tuple[bool, int]:
    """Whether the gateway closed every completion connection it had open on `fp`."""
    last = {"open": -1}

    async def ok() -> bool:
        st = await faulty_stats(ctx, fp)
        last["open"] = int(st.get("open", -1))
        return last["open"] == 0

    good = await wait_until(ok, timeout, 0.25)
    return good, last["open"]


async def explain_blocks(ctx: Ctx, gw: GatewayProc, body: dict[str, Any], headers: dict[str, str] | None = None,
                         query: str = "") -> dict[str, int] | None:
    """Matched index blocks per worker for `body`, from /admin/route/explain (None: refused)."""
    data = await ctx.json(gw, "/admin/route/explain" + query, method="POST", body=body, headers=headers)
    if not isinstance(data, dict):
        return None
    m = data.get("matches") or {}
    return {wid: int(v.get("blocks", 0)) for wid, v in m.items() if isinstance(v, dict)}


def ids_prompt(n: int, seed: int) -> list[int]:
    """A token-id prompt of `n` ids (below the tiny vocabulary), distinct per seed."""
    r = random.Random(seed)
    return [r.randrange(300, 8000) for _ in range(n)]
