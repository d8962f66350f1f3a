"""router/intake/memtrim.py: malloc_trim after huge requests, in a thread, at most once a second."""
from __future__ import annotations

import asyncio

import pytest

from router.intake.memtrim import TRIM_AFTER_BYTES, MemoryTrim


async def test_trims_after_a_huge_body_only_and_not_too_often() -> None:
    t = MemoryTrim(min_interval_s=3600.0)
    if t._trim is None:
        pytest.skip("no glibc malloc_trim here: MemoryTrim does nothing, by design")
    t.after_body(TRIM_AFTER_BYTES - 1)
    await asyncio.sleep(0.2)
    assert t.trims == 0
    t.after_body(TRIM_AFTER_BYTES)
    for _ in range(100):
        if t.trims:
            break
        await asyncio.sleep(0.02)
    assert t.trims == 1
    t.after_body(8 * TRIM_AFTER_BYTES)  # within the interval: not again
    await asyncio.sleep(0.2)
    assert t.trims == 1
