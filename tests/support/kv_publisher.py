"""A ZMQ publisher that speaks vLLM's KV-event protocol, and what the ingest tests drive it with.

`VllmStylePublisher` follows vllm/distributed/kv_events.py's ZmqEventPublisher behaviour (frames
`[topic, seq 8B big-endian, payload]`, a bounded replay buffer, a ROUTER answering `[b"", start]` with
`[b"", seq, payload]`* then `[b"", -1, b""]`); it uses XPUB instead of PUB only to learn when the
subscription is live (same wire). `Chain` is a prompt's blocks and their BlockStored events;
`start` registers one worker "w" with an IngestManager."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio
from hangs import patience

from kvindex.events import BlockRemoved, BlockStored, EventEncoder, KVEvent
from kvindex.index import PrefixIndex
from kvindex.ingest import IngestManager
from kvindex.keys import BlockHasher, Namespace, digests64
from kvindex.subscriber import WorkerSubscriber

NS = Namespace("test-model", block_size=4)
HASHER = BlockHasher.for_namespace(NS)
BS = 4


class VllmStylePublisher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        topic: bytes = b"kv",
        buffer_steps: int = 10_000,
        connect_to: str | None = None,
        replay: bool = True,
        replay_delay_s: float = 0.0,
        encoder: EventEncoder | None = None,
    ) -> None:
        """`replay_omits`: sequences the ROUTER leaves out of its replies (a buffer that
        missed them, e.g. not yet appended when the request came)."""
        self.topic = topic
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to:
            self.pub.connect(connect_to)
            self.endpoint = connect_to
        else:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replay_delay_s = replay_delay_s
        self.replay_requests: list[int] = []
        self.replay_omits: set[int] = set()
        self.enc = encoder or EventEncoder()

    async def wait_subscribed(self, timeout: float = 5.0) -> None:
        msg = await asyncio.wait_for(self.pub.recv(), timeout)
        assert msg[:1] == b"\x01"

    async def publish(self, events: list[KVEvent], *, deliver: bool = True) -> int:
        """Publish one batch; `deliver=False` loses it on the way (it stays replayable)."""
        payload = self.enc.encode(time.time(), events)
        seq = self.seq
        self.seq += 1
        if deliver:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.buffer.append((seq, payload))
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """What a restarted engine looks like on the wire: sequence from 0, empty buffer."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            if self.replay_delay_s:
                await asyncio.sleep(self.replay_delay_s)
            for seq, buf in list(self.buffer):
                if seq >= start_seq and seq not in self.replay_omits:
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), buf])
            await self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


class Chain:
    """A prompt's blocks and the BlockStored events our workers publish for them."""

    def __init__(self, seed: int, n_blocks: int) -> None:
        self.tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(n_blocks * BS)]
        self.keys = HASHER.keys(self.tokens)
        self.ds = digests64(self.keys)

    def stored(self, lo: int, hi: int, medium: str = "GPU") -> BlockStored:
        parent = self.ds[lo - 1] if lo else None
        return BlockStored(self.ds[lo:hi], parent, self.tokens[lo * BS : hi * BS], BS, None, medium, None)

    def removed(self, lo: int, hi: int, medium: str = "GPU") -> BlockRemoved:
        return BlockRemoved(self.ds[lo:hi], medium)


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + patience(timeout)
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def matched(index: PrefixIndex, chain: Chain, worker: str = "w") -> int:
    m = index.match(chain.ds).get(worker)
    return 0 if m is None else m.blocks


async def start(ctx, index, pub: VllmStylePublisher | None, **kw) -> tuple[IngestManager, WorkerSubscriber]:
    mgr = IngestManager(index, replay_timeout_s=kw.pop("replay_timeout_s", 1.0),
                        tail_probe_s=kw.pop("tail_probe_s", 5.0), ctx=ctx)
    endpoint = kw.pop("endpoint", pub.endpoint if pub else None)
    replay = kw.pop("replay_endpoint", pub.replay_endpoint if pub else None)
    sub = mgr.add_worker("w", endpoint, replay_endpoint=replay, ns_digest=NS.digest, block_size=BS, **kw)
    if pub is not None and not kw.get("bind"):
        await pub.wait_subscribed()
    return mgr, sub
