"""Large bodies whose prompt is too long are refused from their raw JSON (router/intake/screen.py),
with the same 400 as after a full decode, and without the full decode: building 1.6 M
ints or thousands of message dicts on the event loop is what stalled other tenants."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from fakes import FakeWorker
from gateway_fleet import DIGEST, MODEL, _cfg, fleet

import router.api.schema
import router.intake.prepare
from router.intake.screen import SCREEN_BYTES, PromptSize, measure


def _enc(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def test_measure_reads_the_prompt_from_raw_json() -> None:
    ids = _enc({"model": "m", "prompt": list(range(1000)), "max_tokens": 3})
    assert measure(ids, False) == PromptSize("m", ids=1000)
    spaced = b'{"prompt" : [ 1 ,2,\n 3 ] , "model":"m"}'
    assert measure(spaced, False) == PromptSize("m", ids=3)
    text = _enc({"model": "m", "prompt": "h\u00e9llo \\n \U0001F600"})
    assert measure(text, False) == PromptSize("m", chars=len("h\u00e9llo \\n \U0001F600"))
    chat = _enc({"model": "m", "messages": [{"role": "user", "content": "abc"},
                                            {"role": "user", "content": [{"type": "text", "text": "xyz"}]},
                                            {"role": "assistant", "content": None}]})
    assert measure(chat, True) == PromptSize("m", chars=3, messages=3)  # parts: not measured, so not counted
    # what the screen cannot measure cheaply is left to the full decode
    assert measure(_enc({"model": "m", "prompt": [[1, 2], [3]]}), False) is None  # a batch
    assert measure(_enc({"model": "m", "prompt": ["a", "b"]}), False) is None
    assert measure(_enc({"model": "m", "prompt": [5]}), False) is None  # no comma: one id, decoded at once
    assert measure(b'{"model": "m", "prompt": [1,2', False) is None
    assert measure(_enc({"model": 3, "prompt": "x"}), False) is None
    assert measure(_enc({"model": "m", "messages": "x"}), True) is None
    deep = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert measure(deep, False) is None and measure(b"[" * 100_000, True) is None  # nested too deep: a 400 later


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Sizes of the bodies the Preparer fully decoded."""
    seen: list[int] = []
    real = router.api.schema.decode_request

    def counting(body: bytes, chat: bool) -> Any:
        seen.append(len(body))
        return real(body, chat)

    monkeypatch.setattr(router.intake.prepare, "decode_request", counting)
    yield seen


def _huge() -> list[tuple[str, bytes]]:
    text = "lorem ipsum dolor " * 60_000  # ~1 MB
    return [
        ("/v1/completions", _enc({"model": MODEL, "prompt": [7] * 300_000, "max_tokens": 2})),
        ("/v1/completions", _enc({"model": MODEL, "prompt": text, "max_tokens": 2})),
        ("/v1/chat/completions", _enc({"model": MODEL, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": text}]})),
        ("/v1/chat/completions", _enc({"model": MODEL, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "hello there"}] * 5000})),
        ("/v1/chat/completions", _enc({"model": MODEL, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "lorem ipsum " * 30}] * 3000})),
    ]


async def _post_all(url: str) -> list[tuple[int, dict[str, Any]]]:
    out = []
    async with aiohttp.ClientSession() as s:
        for path, body in _huge():
            async with s.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                out.append((r.status, await r.json()))
    return out


async def test_huge_prompts_are_refused_before_the_body_is_decoded(decodes: list[int],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(len(b) >= SCREEN_BYTES for _, b in _huge())
    async with fleet([FakeWorker("a", DIGEST)], _cfg(limits={"max_body_bytes": 8 << 20})) as (_, url):
        screened = await _post_all(url)
        assert decodes == []  # nothing of these bodies was built
        monkeypatch.setattr(router.intake.prepare, "SCREEN_BYTES", 1 << 40)  # the same bodies, fully decoded
        full = await _post_all(url)
        assert len(decodes) == len(_huge())
    assert [s for s, _ in screened] == [400] * len(_huge())
    assert screened == full  # the same status, message, param and code
    codes = [e["error"]["code"] for _, e in screened]
    assert codes == ["context_length_exceeded"] * 3 + [None, "context_length_exceeded"]
    assert "your prompt has 300000 tokens" in screened[0][1]["error"]["message"]


async def test_a_large_body_whose_prompt_fits_is_served(decodes: list[int]) -> None:
    """The screen refuses only what is too long: a large body with a short prompt goes on."""
    big = "x" * SCREEN_BYTES  # a long `user` field: large body, short prompt
    bodies = [("/v1/completions", _enc({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "user": big})),
              ("/v1/completions", _enc({"model": MODEL, "prompt": "hello", "max_tokens": 2, "user": big})),
              ("/v1/chat/completions", _enc({"model": MODEL, "max_tokens": 2, "user": big,
                                             "messages": [{"role": "user", "content": "hello"}] * 3}))]
    async with fleet([FakeWorker("a", DIGEST)], _cfg(limits={"max_body_bytes": 8 << 20})) as (_, url):
        async with aiohttp.ClientSession() as s:
            for path, body in bodies:
                async with s.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200, await r.text()
    assert len(decodes) == len(bodies)


async def test_the_helper_process_measures_as_inline_and_is_replaced_when_it_dies() -> None:
    import os
    import signal

    from router.intake.screener import Screener

    s = Screener(offload_bytes=0)
    try:
        for path, body in _huge():
            assert await s.measure(body, "chat" in path) == measure(body, "chat" in path)
        [pid] = s.helper_pids
        os.kill(pid, signal.SIGKILL)
        path, body = _huge()[0]
        assert await s.measure(body, False) == measure(body, False)  # measured here meanwhile
        assert await s.measure(body, False) == measure(body, False)
        assert s.helper_pids and s.helper_pids != [pid] and not s.inline_only
    finally:
        await s.aclose()


async def test_a_helper_that_cannot_start_means_inline_screening_not_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import router.intake.screener

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    s = router.intake.screener.Screener(offload_bytes=0)
    for _ in range(4):
        for path, body in _huge()[:2]:
            assert await s.measure(body, "chat" in path) == measure(body, "chat" in path)
    assert s.inline_only and s.helper_pids == []
    await s.aclose()


async def test_warm_starts_the_helper_in_the_background_once() -> None:
    import asyncio

    from router.intake.screener import Screener

    s = Screener(offload_bytes=0)
    try:
        s.warm()
        s.warm()  # one start, not two
        for _ in range(200):
            if s.helper_pids:
                break
            await asyncio.sleep(0.05)
        [pid] = s.helper_pids
        path, body = _huge()[1]
        assert await s.measure(body, False) == measure(body, False) and s.helper_pids == [pid]
    finally:
        await s.aclose()
