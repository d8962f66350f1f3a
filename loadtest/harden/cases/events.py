"""The prefix index across failures: a lost KV-event frame (a sequence gap, and a lost
last frame), a worker whose publisher restarts (its sequence starts again at 0, its
cache is empty), and a gateway restarted under load (in-flight requests finish, and
the index comes back without waiting for every worker to publish again).

The index is read through `/admin/route/explain` (matched blocks per worker) for
token-id prompts, whose block keys the gateway and the worker compute alike.
"""
from __future__ import annotations

import asyncio
import random
import signal
import socket
import threading
import time
from typing import Any

import zmq

from ...ports import free_port
from ..config import kvroute_worker
from ..outcome import CHAT, COMPLETION, Spec, classify
from ..procs import GatewayProc
from ..runner import Ctx, case
from .common import CHAT_PATH, COMP_PATH, chat_body, comp_body, explain_blocks, ids_prompt, wait_all_healthy, wait_until
from .common import words as _words

BLOCKS = 8
BLOCK = 16


class FrameDropper:
    """A ZMQ relay between a worker's PUB socket and the gateway: forwards every
    multipart frame, except the next one(s) after `arm()`."""

    def __init__(self, upstream: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.forwarded = 0
        self.dropped = 0
        self._arm = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="frame-dropper", daemon=True)
        self._thread.start()

    def arm(self, n: int = 1) -> None:
        with self._lock:
            self._arm = n

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            frames = self.sub.recv_multipart()
            with self._lock:
                drop = self._arm > 0
                if drop:
                    self._arm -= 1
            if drop:
                self.dropped += 1
                continue
            self.pub.send_multipart(frames)
            self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sub.close()
        self.pub.close()
        self.ctx.term()


async def _send_ids(ctx: Ctx, gw: GatewayProc, ids: list[int], label: str, *, timeout: float = 30.0) -> None:
    await ctx.call(gw, "POST", COMP_PATH, comp_body(ids, max_tokens=4), spec=Spec(expect=COMPLETION),
                   timeout=timeout, label=label)


async def _matched(ctx: Ctx, gw: GatewayProc, ids: list[int], wid: str) -> int:
    m = await explain_blocks(ctx, gw, comp_body(ids, max_tokens=4))
    return (m or {}).get(wid, 0)


async def _until_matched(ctx: Ctx, gw: GatewayProc, ids: list[int], wid: str, want: int, timeout: float) -> int:
    last = {"n": 0}

    async def ok() -> bool:
        last["n"] = await _matched(ctx, gw, ids, wid)
        return last["n"] >= want

    await wait_until(ok, timeout, 0.2)
    return last["n"]


@case("event_gap", "a KV-event frame lost in transit (a sequence gap, then a lost last frame)",
      small_s=90, full_s=300)
async def event_gap(ctx: Ctx) -> None:
    sc = await ctx.sim(1)
    w = sc.workers[0]
    relay = await asyncio.to_thread(FrameDropper, w.events)
    try:
        wid = ctx.worker_id("hw")
        ev = {"endpoint": relay.endpoint, "replay_endpoint": w.replay, "topic": "kv"}
        gw = await ctx.gateway(ctx.config([kvroute_worker(wid, w.url, events=ev)]), wait_ready=False)
        await wait_all_healthy(ctx, gw, 1)
        warm, p, q, tail = (ids_prompt(BLOCKS * BLOCK, s) for s in (1, 2, 3, 4))
        await asyncio.sleep(0.5)  # let the gateway's subscription settle (ZMQ slow joiner)
        await _send_ids(ctx, gw, warm, "warm")
        n = await _until_matched(ctx, gw, warm, wid, BLOCKS, 5.0)
        if not ctx.check("events reach the index through the relay", n >= BLOCKS, f"warm prompt: {n}/{BLOCKS}"):
            return
        relay.arm(1)
        await _send_ids(ctx, gw, p, "dropped")
        await wait_until(_async(lambda: relay.dropped >= 1), 5.0)
        ctx.note(f"frames forwarded {relay.forwarded}, dropped {relay.dropped}")
        await _send_ids(ctx, gw, q, "after-gap")  # its frame reveals the gap
        n = await _until_matched(ctx, gw, p, wid, BLOCKS, 5.0)
        ctx.check("a sequence gap is repaired from the replay socket", n >= BLOCKS,
                  f"prompt whose frame was dropped: {n}/{BLOCKS} blocks indexed 5 s after the next frame")
        # a lost LAST frame: nothing follows it, so no gap shows
        relay.arm(1)
        await _send_ids(ctx, gw, tail, "dropped-last")
        n = await _until_matched(ctx, gw, tail, wid, BLOCKS, ctx.pick(10.0, 20.0))
        ctx.check("a lost last frame is found (idle tail probe)", n >= BLOCKS,
                  f"{n}/{BLOCKS} blocks indexed {ctx.pick(10, 20)} s after its frame was dropped")
    finally:
        await asyncio.to_thread(relay.close)


def _async(fn: Any) -> Any:
    async def f() -> bool:
        return bool(fn())
    return f


def _two_free_ports() -> int:
    """A port p with p and p+1 free (sim-cluster's events and replay ports)."""
    for _ in range(200):
        p = free_port()
        if p >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


@case("publisher_restart", "a worker restarted on the same ports: sequence back at 0, cache empty",
      small_s=90, full_s=300)
async def publisher_restart(ctx: Ctx) -> None:
    sc = await ctx.sim(1, base_port=free_port(), events_base_port=_two_free_ports())
    wid = ctx.worker_id("hw")
    gw = await ctx.gateway(ctx.config([kvroute_worker(wid, sc.workers[0].url)]), wait_ready=False)
    await wait_all_healthy(ctx, gw, 1)
    old, new = ids_prompt(BLOCKS * BLOCK, 21), ids_prompt(BLOCKS * BLOCK, 22)
    await asyncio.sleep(0.5)
    await _send_ids(ctx, gw, old, "before-restart")
    n = await _until_matched(ctx, gw, old, wid, BLOCKS, 5.0)
    if not ctx.check("events reach the index", n >= BLOCKS, f"{n}/{BLOCKS}"):
        return
    sc = await asyncio.to_thread(ctx.procs.restart_sim, sc)
    ctx.log("worker restarted")
    healthy = await wait_all_healthy(ctx, gw, 1, timeout=15.0)
    ctx.check("the restarted worker is routed to again", healthy, "not healthy 15 s after its restart")
    await _send_ids(ctx, gw, new, "after-restart")
    n_new = await _until_matched(ctx, gw, new, wid, BLOCKS, 8.0)
    ctx.check("the restarted publisher's events are applied (sequence from 0)", n_new >= BLOCKS,
              f"prompt sent after the restart: {n_new}/{BLOCKS} blocks indexed")
    stale = await _matched(ctx, gw, old, wid)
    ctx.check("what the worker lost in the restart is gone from the index", stale == 0,
              f"prompt cached before the restart still credited with {stale} blocks")
    await _send_ids(ctx, gw, old, "again")


@case("gateway_restart", "the gateway restarted under load: nothing lost, the index back at once",
      small_s=120, full_s=400)
async def gateway_restart(ctx: Ctx) -> None:
    sc = await ctx.sim(2)
    ids_ = [ctx.worker_id("hw"), ctx.worker_id("hw")]
    gw = await ctx.gateway(ctx.config([kvroute_worker(i, w.url) for i, w in zip(ids_, sc.workers, strict=True)]),
                           wait_ready=False)
    await wait_all_healthy(ctx, gw, 2)
    await asyncio.sleep(0.5)
    warm = [ids_prompt(BLOCKS * BLOCK, 100 + k) for k in range(ctx.pick(4, 20))]
    for k, p in enumerate(warm):
        await _send_ids(ctx, gw, p, f"warm-{k}")

    async def best(p: list[int], g: GatewayProc) -> int:
        m = await explain_blocks(ctx, g, comp_body(p, max_tokens=4))
        return max((m or {}).values(), default=0)

    await asyncio.sleep(1.0)
    before = [await best(p, gw) for p in warm]
    if not ctx.check("warm prompts are indexed before the restart", all(b >= BLOCKS for b in before), str(before)):
        return
    stop = asyncio.Event()
    counts = {"refused_connects": 0}
    rng = random.Random(5)
    target = {"g": gw}

    async def loop(k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            body = chat_body(_words(30, rng, f"load {k} {i}"), max_tokens=48, stream=True)
            rep = await ctx.raw(target["g"], "POST", CHAT_PATH, body, timeout=30.0)
            if rep.refused:  # nothing listens (between the two processes): a client retries
                counts["refused_connects"] += 1
                await asyncio.sleep(0.05)
                continue
            ctx.result.add(classify(rep, Spec(expect=CHAT, stream=True, secrets=tuple(ctx.secrets)), "load"))

    n_loops = ctx.pick(6, 16)
    loops = [asyncio.ensure_future(loop(k)) for k in range(n_loops)]
    await asyncio.sleep(ctx.pick(1.0, 5.0))
    # SIGTERM under load: what is in flight must finish (or end with an explicit error)
    t0 = time.monotonic()
    await asyncio.to_thread(ctx.procs.stop, gw.proc, signal.SIGTERM, 20.0)
    ctx.note(f"the old gateway took {time.monotonic() - t0:.1f} s to exit after SIGTERM")
    stop.set()
    await asyncio.gather(*loops)
    # a new gateway, no traffic at all: the index must come back from the workers
    gw2 = await ctx.gateway(gw.config, wait_ready=True, port=gw.port)
    t_ready = time.monotonic()
    ctx.timing("the restarted gateway is ready", gw2.ready_s, 5.0, "/ready said 200 after")

    async def back() -> bool:
        return all([await best(p, gw2) >= BLOCKS for p in warm])

    ok = await wait_until(back, 60.0, 0.25)  # a bound against never; how soon is the timing check below
    t_back = time.monotonic() - t_ready
    after = [await best(p, gw2) for p in warm]
    ctx.check("the index is back after the restart, with no traffic", ok,
              f"matched blocks of the warm prompts {t_back:.1f} s after ready: {after} (want {BLOCKS} each)")
    ctx.timing("the index is back after /ready", t_back if ok else None, 5.0, "the warm prompts matched after")
    # and the new one serves under the same load
    stop.clear()
    target["g"] = gw2
    loops = [asyncio.ensure_future(loop(k)) for k in range(n_loops)]
    await asyncio.sleep(ctx.pick(1.0, 5.0))
    stop.set()
    await asyncio.gather(*loops)
    ctx.note(f"{counts['refused_connects']} connection attempts found nothing listening (retried, not counted)")
