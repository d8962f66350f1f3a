"""The KV-event publisher speaks vLLM's protocol: PUB frames [topic, seq, payload] with
seq from 0, and a ROUTER replay socket with a bounded buffer answering
[b"", seq, payload]... then [b"", -1, b""]; malformed replay requests are ignored."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from hangs import patience

from kvindex.events import BlockRemoved, EventDecoder, seq_from_bytes, seq_to_bytes
from workers.publisher import KVEventPublisher


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll `predicate` until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + patience(timeout)
    while not await predicate():
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"


async def replay(dealer: zmq.asyncio.Socket, start: int) -> list[int]:
    await dealer.send_multipart([b"", seq_to_bytes(start)])
    seqs = []
    while True:
        frames = await asyncio.wait_for(dealer.recv_multipart(), patience(5))
        assert frames[0] == b"" and len(frames) == 3
        s = seq_from_bytes(frames[1])
        if s == -1:
            assert frames[2] == b""
            return seqs
        seqs.append(s)


async def test_pub_frames_and_bounded_replay() -> None:
    ctx = zmq.asyncio.Context()
    pub = KVEventPublisher(buffer=4, ctx=ctx)
    pub.start()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    sent: list[int] = []

    async def subscribed() -> bool:
        """PUB drops what it sends before the subscription arrives: publish until one is received."""
        sent.append(pub.publish([BlockRemoved([len(sent)], "CPU")]))
        return bool(await sub.poll(20))

    try:
        assert pub.publish([]) == -1  # nothing to send, no sequence used
        await wait_until(subscribed)
        assert sent == list(range(len(sent)))  # sequence numbers from 0, one per batch
        dec = EventDecoder()
        topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), patience(5))
        first = seq_from_bytes(seq)
        assert topic == b"kv" and first in sent
        assert dec.decode(payload).events == [BlockRemoved([first], "CPU")]
        for i in range(first + 1, first + 10):  # received in order, no gap, the seq publish() returned
            if i >= len(sent):
                assert pub.publish([BlockRemoved([i], "CPU")]) == i
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), patience(5))
            assert topic == b"kv" and seq_from_bytes(seq) == i
            assert dec.decode(payload).events == [BlockRemoved([i], "CPU")]
        last = first + 9
        assert await replay(dealer, 0) == list(range(last - 3, last + 1))  # only the last 4 are kept
        assert await replay(dealer, last - 1) == [last - 1, last]
        assert await replay(dealer, last + 50) == []
        await dealer.send_multipart([b"", b"short"])  # bad start sequence: ignored
        await dealer.send_multipart([b"only-one-frame"])
        assert await replay(dealer, last) == [last]  # still serving
        assert pub.replays == 4
    finally:
        sub.close(0)
        dealer.close(0)
        await pub.close()
        ctx.term()
