"""KV-event publisher in vLLM's wire protocol (docs/wire.md § KV events), shared by engines.

- PUB socket: multipart `[topic, seq (8-byte big-endian), payload]`, payload encoded by
  `kvindex.events.EventEncoder` (default encoding: maps with a `type` tag inside a
  positional batch `[ts, events, dp_rank]`, as vLLM 0.32 sends). `seq` starts at 0 and
  grows by one per batch, so a subscriber sees gaps and restarts.
- ROUTER replay socket with a bounded buffer of the last `buffer` batches: a request
  `[identity, b"", start_seq]` (from a DEALER sending `[b"", start_seq]`) is answered
  with `[identity, b"", seq, payload]` for every buffered batch with `seq >= start_seq`,
  then `[identity, b"", -1 (8 bytes, signed), b""]`.

Publishing never blocks the engine: PUB drops when a subscriber is slow (ZMQ's HWM),
and the drop is counted. Endpoints may name port `*`; the bound ones are reported by
`endpoint` / `replay_endpoint` (what /info announces).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from kvindex.events import END_SEQ, EventEncoder, KVEvent, seq_from_bytes, seq_to_bytes

log = logging.getLogger(__name__)
_END = seq_to_bytes(END_SEQ)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        replay_endpoint: str | None = "tcp://127.0.0.1:*",
        *,
        topic: str = "kv",
        buffer: int = 10000,
        ctx: zmq.asyncio.Context | None = None,
        encoder: EventEncoder | None = None,
        data_parallel_rank: int | None = None,
        hwm: int = 100000,
    ) -> None:
        if buffer <= 0:
            raise ValueError("replay buffer must hold at least one batch")
        self._want_endpoint = endpoint
        self._want_replay = replay_endpoint
        self.topic = topic
        self._topic_b = topic.encode()
        self._own_ctx = ctx is None
        self._actx = ctx if ctx is not None else zmq.asyncio.Context()
        self._encoder = encoder or EventEncoder()
        self._rank = data_parallel_rank
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._seq = 0
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self.batches = 0
        self.events = 0
        self.dropped = 0
        self.replays = 0

    def start(self) -> None:
        """Bind both sockets and start serving replays (on the running loop)."""
        sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._actx.underlying)
        pub = sync_ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.bind(self._want_endpoint)
        self._pub = pub
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._want_replay:
            rep = self._actx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            rep.bind(self._want_replay)
            self._replay = rep
            self.replay_endpoint = rep.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number (-1 if nothing was sent)."""
        if not events:
            return -1
        seq = self._seq
        self._seq = seq + 1
        payload = self._encoder.encode(time.time() if ts is None else ts, events, self._rank)
        self._buffer.append((seq, payload))
        self.batches += 1
        self.events += len(events)
        if self._pub is not None:
            try:
                self._pub.send_multipart((self._topic_b, seq_to_bytes(seq), payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1
        return seq

    async def _serve_replay(self) -> None:
        rep = self._replay
        assert rep is not None
        while True:
            try:
                frames = await rep.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as e:  # pragma: no cover - socket closed under us
                log.debug("replay socket: %s", e)
                return
            if len(frames) != 3 or frames[1] != b"":
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            ident = frames[0]
            try:
                start = seq_from_bytes(frames[2])
            except ValueError:
                log.warning("ignoring replay request with a bad start sequence")
                continue
            self.replays += 1
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        await rep.send_multipart((ident, b"", seq_to_bytes(seq), payload))
                await rep.send_multipart((ident, b"", _END, b""))
            except zmq.ZMQError as e:  # pragma: no cover - peer vanished
                log.debug("replay reply failed: %s", e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._own_ctx:
            self._actx.term()
