"""`min_tokens`, log-probabilities and returned token ids on the real engine (tiny Llama,
CPU): EOS masked and stop strings ignored until min_tokens; logprobs equal to the
log_softmax of a plain forward's logits at each generated position, top alternatives
sorted, greedy tokens unchanged by asking for them; over HTTP, vLLM's shapes for chat
(streamed and not) and completions, `return_token_ids`, and the 400s for bad values."""
from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from workers.engine.core import EngineCore, SeqUpdate
from workers.engine.engine import TorchEngine
from workers.engine.engineconfig import EngineConfig
from workers.engine.model import LoadedModel, ModelSpec, load_model
from workers.engine.sequence import SamplingParams
from workers.engine.server import EngineWorker, ServeOptions


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is faster than two fighting
    try:
        yield load_model(ModelSpec(cache_dir=Path(tmp_path_factory.getbasetemp()) / "kvroute-cache"))
    finally:
        torch.set_num_threads(threads)


def core_of(lm: LoadedModel) -> EngineCore:
    return EngineCore(lm, EngineConfig(num_blocks=64, max_num_batched_tokens=512, max_waiting=16))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def run(core: EngineCore, rid: str, ids: list[int], p: SamplingParams) -> list[SeqUpdate]:
    core.add(core.new_sequence(rid, ids, p))
    out: list[SeqUpdate] = []
    while core.seqs:
        out += [u for u in core.step() if u.seq.request_id == rid]
    return out


def tokens(updates: list[SeqUpdate]) -> list[int]:
    return [t for u in updates for t in u.token_ids]


def last_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """The logits after `ids` from one plain forward (no cache reuse)."""
    with torch.inference_mode():
        return lm.model(torch.tensor([ids]), use_cache=True).logits[0, -1].float()


# ------------------------------------------------------------------ min_tokens


def test_min_tokens_masks_eos_until_reached(lm: LoadedModel) -> None:
    ids = prompt(1, 24)
    free = tokens(run(core_of(lm), "f", ids, SamplingParams(max_tokens=6, ignore_eos=True)))
    first = free[0]
    eos_lm = dataclasses.replace(lm, eos_ids=frozenset({first}))  # the greedy first token ends the answer
    assert tokens(run(core_of(eos_lm), "e", ids, SamplingParams(max_tokens=6))) == [first]
    out = run(core_of(eos_lm), "m", ids, SamplingParams(max_tokens=6, min_tokens=3))
    got = tokens(out)
    assert len(got) >= 3 and first not in got[:3], got
    # the first token is the best one but EOS: the argmax of the logits with EOS masked
    assert got[0] == int(last_logits(lm, ids).topk(2).indices[1])
    assert out[-1].seq.finish_reason == ("length" if len(got) == 6 else "stop")
    if len(got) < 6:
        assert got[-1] == first  # ended on EOS once min_tokens were out
    sampled = tokens(run(core_of(eos_lm), "s", ids, SamplingParams(max_tokens=6, min_tokens=4, temperature=1.0,
                                                                   seed=5)))
    assert len(sampled) >= 4 and first not in sampled[:4]


def test_min_tokens_defers_stop_strings(lm: LoadedModel) -> None:
    ids = prompt(2, 30)
    free = run(core_of(lm), "f", ids, SamplingParams(max_tokens=10, ignore_eos=True))
    text = "".join(u.text for u in free)
    first_piece = next(u.text for u in free if u.text)
    stop = first_piece[:2] if len(first_piece) >= 2 else text[:2]
    early = run(core_of(lm), "e", ids, SamplingParams(max_tokens=10, stop=(stop,), ignore_eos=True))
    assert len(tokens(early)) < 6 and early[-1].seq.finish_reason == "stop"
    held = run(core_of(lm), "h", ids, SamplingParams(max_tokens=10, stop=(stop,), min_tokens=6, ignore_eos=True))
    assert len(tokens(held)) >= 6
    assert tokens(held) == tokens(free)[: len(tokens(held))]  # greedy: the same tokens, only longer
    assert "".join(u.text for u in held).startswith(text[: text.find(stop) + len(stop)])


def test_min_tokens_is_bounded_by_max_tokens() -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


# ------------------------------------------------------------------ logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_log_softmax_of_a_plain_forward(lm: LoadedModel, temperature: float) -> None:
    ids = prompt(3, 40)
    p = SamplingParams(max_tokens=5, temperature=temperature, seed=11, ignore_eos=True)
    plain = tokens(run(core_of(lm), "p", ids, p))
    out = run(core_of(lm), "l", ids, dataclasses.replace(p, logprobs=4))
    got = tokens(out)
    assert got == plain  # asking for logprobs changes no token (greedy, or seeded)
    lps = [lp for u in out for lp in (u.logprobs or [])]
    assert len(lps) == len(got)
    for i, (tok, lp) in enumerate(zip(got, lps, strict=True)):
        ref = torch.log_softmax(last_logits(lm, ids + got[:i]), dim=-1)
        assert abs(lp.logprob - float(ref[tok])) < 1e-4, (i, lp.logprob, float(ref[tok]))
        assert len(lp.top) == 4
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        fourth = float(ref.topk(4).values[-1])
        assert len({t for t, _ in lp.top}) == 4
        assert all(abs(v - float(ref[t])) < 1e-4 and v >= fourth - 1e-4 for t, v in lp.top)  # the 4 best
        if temperature == 0.0:
            assert lp.top[0][0] == tok
    none = run(core_of(lm), "n", ids, dataclasses.replace(p, logprobs=0))
    assert all(lp.top == [] for u in none for lp in (u.logprobs or [])) and len(none[-1].logprobs or []) == 1
    assert all(u.logprobs is None for u in run(core_of(lm), "x", ids, p))


# ------------------------------------------------------------------ over HTTP


@pytest.fixture
async def worker(lm: LoadedModel) -> AsyncIterator[EngineWorker]:
    engine = TorchEngine(EngineCore(lm, EngineConfig(num_blocks=128, max_num_batched_tokens=256, max_waiting=8)),
                         calibrate=False)
    w = EngineWorker(engine, ServeOptions())
    await w.start()
    try:
        yield w
    finally:
        await w.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict[str, Any]]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def sse(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    async with http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if line and line != b"data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


CHAT = [{"role": "user", "content": "What is a KV cache?"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def check_entry(e: dict[str, Any], k: int) -> None:
    assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
    assert isinstance(e["token"], str) and e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0
    top = e["top_logprobs"]
    assert len(top) == k and all(set(t) == {"token", "logprob", "bytes"} for t in top)
    assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    assert top[0]["logprob"] >= e["logprob"] - 1e-6


async def test_chat_logprobs_and_token_ids(worker: EngineWorker, http: aiohttp.ClientSession,
                                           lm: LoadedModel) -> None:
    url = worker.url + "/v1/chat/completions"
    st, plain = await post(http, url, {"messages": CHAT, **GREEDY})
    assert st == 200 and plain["choices"][0]["logprobs"] is None and "prompt_token_ids" not in plain
    st, body = await post(http, url, {"messages": CHAT, **GREEDY, "logprobs": True, "top_logprobs": 3,
                                      "return_token_ids": True})
    assert st == 200, body
    choice = body["choices"][0]
    assert choice["message"]["content"] == plain["choices"][0]["message"]["content"]  # greedy: unchanged
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 6
    for e, tid in zip(content, choice["token_ids"], strict=True):
        check_entry(e, 3)
        assert e["token"] == lm.tokenizer.decode([tid]) and e["top_logprobs"][0]["token"] == e["token"]
    prompt_ids = body["prompt_token_ids"]
    assert prompt_ids == lm.tokenizer.apply_chat_template(CHAT)
    # the first entry: the log_softmax of the prompt's last logits
    ref = torch.log_softmax(last_logits(lm, prompt_ids), dim=-1)
    assert abs(content[0]["logprob"] - float(ref[choice["token_ids"][0]])) < 1e-4
    chunks = await sse(http, url, {"messages": CHAT, **GREEDY, "logprobs": True, "top_logprobs": 3,
                                   "return_token_ids": True, "stream": True})
    assert chunks[0]["prompt_token_ids"] == prompt_ids and "prompt_token_ids" not in chunks[1]
    streamed = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert streamed == content
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == choice["token_ids"]
    st, bare = await post(http, url, {"messages": CHAT, **GREEDY, "logprobs": True})
    assert st == 200 and all(e["top_logprobs"] == [] for e in bare["choices"][0]["logprobs"]["content"])


async def test_completion_logprobs_legacy_shape(worker: EngineWorker, http: aiohttp.ClientSession,
                                                lm: LoadedModel) -> None:
    url = worker.url + "/v1/completions"
    ids = prompt(4, 20)
    st, body = await post(http, url, {"prompt": ids, **GREEDY, "logprobs": 2, "return_token_ids": True})
    assert st == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 6
    assert lp["tokens"] == [lm.tokenizer.decode([t]) for t in choice["token_ids"]]
    offsets = [0]
    for s in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(s))
    assert lp["text_offset"] == offsets
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == v and len(top) <= 3  # the sampled token and the 2 most likely
        assert all(x <= top[tok] + 1e-6 for x in top.values())  # greedy: the sampled one is the best
    ref = torch.log_softmax(last_logits(lm, ids), dim=-1)
    assert abs(lp["token_logprobs"][0] - float(ref[choice["token_ids"][0]])) < 1e-4
    chunks = await sse(http, url, {"prompt": ids, **GREEDY, "logprobs": 2, "stream": True, "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [v for p in parts for v in p["token_logprobs"]] == lp["token_logprobs"]
    sent = 0
    for c in chunks:  # streamed offsets start at the text sent before their chunk, as vLLM's
        ch = c["choices"][0]
        if ch.get("logprobs"):
            assert ch["logprobs"]["text_offset"][0] == sent
        sent += len(ch["text"])


async def test_min_tokens_over_http(worker: EngineWorker, http: aiohttp.ClientSession) -> None:
    url = worker.url + "/v1/completions"
    ids = prompt(5, 30)
    st, free = await post(http, url, {"prompt": ids, **GREEDY, "max_tokens": 10})
    text = free["choices"][0]["text"]
    stop = text[:2]
    st, early = await post(http, url, {"prompt": ids, **GREEDY, "max_tokens": 10, "stop": stop})
    assert st == 200 and early["usage"]["completion_tokens"] < 6 and early["choices"][0]["finish_reason"] == "stop"
    st, held = await post(http, url, {"prompt": ids, **GREEDY, "max_tokens": 10, "stop": stop, "min_tokens": 6})
    assert st == 200 and held["usage"]["completion_tokens"] >= 6, held
    chat = worker.url + "/v1/chat/completions"
    st, body = await post(http, chat, {"messages": CHAT, "max_completion_tokens": 4, "min_tokens": 4})
    assert st == 200 and body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": "2"}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),  # not a completions field
    ("/v1/completions", {"min_tokens": 7}, "min_tokens"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/chat/completions", {"min_tokens": 2.5}, "min_tokens"),
    ("/v1/chat/completions", {"return_token_ids": "yes"}, "return_token_ids"),
])
async def test_bad_values_are_400(worker: EngineWorker, http: aiohttp.ClientSession, path: str,
                                  extra: dict[str, Any], param: str) -> None:
    base: dict[str, Any] = {"messages": CHAT} if "chat" in path else {"prompt": [5, 6, 7]}
    st, body = await post(http, worker.url + path, {**base, "max_tokens": 6, **extra})
    assert st == 400, body
    err = body["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
