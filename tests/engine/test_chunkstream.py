"""The engines' common stream (workers/chunkstream.py): output pushed while the reader
waits wakes it, output pushed while it lags comes as one chunk, the end after the last
chunk, a failure as `StreamFailed`, and cancel: the engine asked once, the waiting reader
ended, later output ignored by the reader."""
from __future__ import annotations

import asyncio

import pytest

from workers.api import GenChunk
from workers.chunkstream import ChunkStream, StreamFailed
from workers.sim.driver import _SimStream


class Counting(ChunkStream):
    __slots__ = ("ids", "aborts")

    def __init__(self) -> None:
        super().__init__("r")
        self.ids: list[int] = []
        self.aborts = 0

    def push(self, *ids: int) -> None:
        self.ids += ids
        self._wake()

    def _pending(self) -> bool:
        return bool(self.ids)

    def _take(self) -> GenChunk:
        ids, self.ids = self.ids, []
        return GenChunk(ids, "x" * len(ids))

    def _abort(self) -> None:
        self.aborts += 1


async def test_chunks_wakeups_and_the_end() -> None:
    s = Counting()
    got: list[list[int]] = []

    async def read() -> None:
        async for ch in s:
            got.append(ch.token_ids)

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0)  # the reader waits
    s.push(1)
    await asyncio.sleep(0)
    s.push(2)
    s.push(3)  # the reader lags: one chunk
    await asyncio.sleep(0)
    s.push(4)
    s._end()  # output then the end, before the reader runs: the output still comes
    await asyncio.wait_for(reader, 1)
    assert got == [[1], [2, 3], [4]]
    assert not hasattr(s, "__dict__")  # slots all the way down
    assert _SimStream.__dictoffset__ == 0  # and in the simulated engine's stream


async def test_a_failure_after_the_last_chunk() -> None:
    s = Counting()
    s.push(1)
    s._end("boom")
    got = []
    with pytest.raises(StreamFailed) as e:
        async for ch in s:
            got.append(ch.token_ids)
    assert got == [[1]] and e.value.status == 500 and e.value.message == "boom"


async def test_cancel_is_idempotent_and_ends_the_reader() -> None:
    s = Counting()
    got: list[list[int]] = []

    async def read() -> None:
        async for ch in s:
            got.append(ch.token_ids)

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    s.cancel()
    s.cancel()
    await asyncio.wait_for(reader, 1)
    assert s.aborts == 1 and got == [] and s.usage is None
    ended = Counting()
    ended._end()
    ended.cancel()  # a finished request is not dropped again
    assert ended.aborts == 0
