"""The KV-event publisher speaks vLLM's protocol: PUB frames [topic, seq, payload] with
seq from 0, and a ROUTER replay socket with a bounded buffer answering
[b"", seq, payload]... then [b"", -1, b""]; malformed replay requests are ignored."""
from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from kvindex.events import BlockRemoved, EventDecoder, seq_from_bytes, seq_to_bytes
from workers.publisher import KVEventPublisher


async def replay(dealer: zmq.asyncio.Socket, start: int) -> list[int]:
    await dealer.send_multipart([b"", seq_to_bytes(start)])
    seqs = []
    while True:
        frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
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
    try:
        await asyncio.sleep(0.2)
        assert pub.publish([]) == -1  # nothing to send, no sequence used
        for i in range(10):
            assert pub.publish([BlockRemoved([i], "CPU")]) == i
        dec = EventDecoder()
        for i in range(10):
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert topic == b"kv" and seq_from_bytes(seq) == i
            ev = dec.decode(payload).events
            assert ev == [BlockRemoved([i], "CPU")]
        assert await replay(dealer, 0) == [6, 7, 8, 9]  # only the last 4 are kept
        assert await replay(dealer, 8) == [8, 9]
        assert await replay(dealer, 50) == []
        await dealer.send_multipart([b"", b"short"])  # bad start sequence: ignored
        await dealer.send_multipart([b"only-one-frame"])
        assert await replay(dealer, 9) == [9]  # still serving
        assert pub.replays == 4
    finally:
        sub.close(0)
        dealer.close(0)
        await pub.close()
        ctx.term()
