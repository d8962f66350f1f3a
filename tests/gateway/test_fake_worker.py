"""The fake worker (tests/support/fakes.py) answers a stream as a vLLM worker does."""
from __future__ import annotations

from fakes import FakeWorker, serve_fake


async def test_fake_worker_streams() -> None:
    import aiohttp

    async with serve_fake(FakeWorker("f0", "00" * 32)) as fw, aiohttp.ClientSession() as s:
        async with s.post(fw.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
            text = (await r.read()).decode()
    assert text.count("data: ") == 5 and text.endswith("data: [DONE]\n\n")
