"""Gateway building blocks without HTTP: tenancy salts, shared prefixes, key plans, the trace
recorder, vLLM /metrics parsing, request validation."""
from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvindex.keys import BlockHasher, Namespace, digests64
from router.api.errors import ApiError
from router.api.schema import check_chat, check_completion, decode_chat, decode_completion, decode_request, ours_problem
from router.config import build_config
from router.fleet.vllm_load import parse_vllm_metrics
from router.intake.model import ModelRuntime
from router.intake.tenancy import Tenancy
from router.intake.tokenize import Tokenizer
from router.telemetry.recorder import TraceRecorder

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "configs/assets/tiny-tokenizer"
SYSTEM = "You are a helpful assistant. " * 20


def _model(**cfg_over: object) -> ModelRuntime:
    cfg = build_config({"models": [{"id": "m", "tokenizer": str(TOK)}], **cfg_over}, ROOT, environ={})
    rt = ModelRuntime(cfg.models[0], Tokenizer(TOK))
    for sp in cfg.shared_prefixes:
        rt.add_shared_prefix(sp)
    return rt


def _chat_ids(rt: ModelRuntime, user: str) -> array:
    tok = rt.tokenizer
    return tok.encode_text(
        tok.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]), False
    )


def test_tenants_are_isolated_and_keys_match_the_workers_computation() -> None:
    cfg = build_config({"models": [{"id": "m", "tokenizer": str(TOK)}],
                        "tenants": [{"id": "a", "api_keys": ["sk-aaaaaaaa"]},
                                    {"id": "b", "api_keys": ["sk-bbbbbbbb"], "salt": "B"}]},
                       ROOT, environ={})
    ten = Tenancy(cfg)
    a = ten.authenticate({"authorization": "Bearer sk-aaaaaaaa"})
    b = ten.authenticate({"authorization": "Bearer sk-bbbbbbbb"})
    assert a.id == "a" and b.salt == "B" and a.salt and a.salt != b.salt
    with pytest.raises(ApiError) as ei:
        ten.authenticate({})
    assert ei.value.status == 401
    rt = _model()
    ids = _chat_ids(rt, "same question")
    pa, pb = rt.key_plan(ids, a.salt, None), rt.key_plan(ids, b.salt, None)
    assert not set(pa.digests) & set(pb.digests)  # no shared block across tenants
    assert pa.wire_salt and pa.wire_salt.startswith("t:") and a.salt not in pa.wire_salt
    # docs/wire.md: the worker scopes with cache_salt=<received> and no tenant salt -> the same keys
    worker_ns = Namespace("m", kv_dtype="auto").scoped(cache_salt=pa.wire_salt)
    wk = BlockHasher.for_namespace(worker_ns).keys_for(ids.tolist(), worker_ns)
    assert digests64(wk) == pa.digests
    # a request cache_salt changes keys within a tenant too
    assert rt.key_plan(ids, a.salt, "c1").digests[0] != pa.digests[0]


def test_declared_shared_prefix_stays_shared_across_tenants() -> None:
    rt = _model(shared_prefixes=[{"name": "sys", "messages": [{"role": "system", "content": SYSTEM}]}])
    sp = rt.keys.shared[0]
    assert sp.blocks == len(sp.ids) // 16 and sp.blocks >= 5
    ids = _chat_ids(rt, "tenant question")
    pa, pb = rt.key_plan(ids, "salt-a", None), rt.key_plan(ids, "salt-b", None)
    assert pa.shared_blocks == sp.blocks
    k = sp.blocks
    assert pa.digests[:k] == pb.digests[:k]  # the public system prompt: one cache for all
    assert not set(pa.digests[k:]) & set(pb.digests[k:])  # the rest stays isolated
    assert pa.digests[:k] == rt.key_plan(ids, "", None).digests[:k]
    other = rt.tokenizer.encode_text(rt.tokenizer.render_chat([{"role": "user", "content": "no system"}]), False)
    assert rt.key_plan(other, "salt-a", None).shared_blocks == 0
    # vLLM workers salt from block 0 (they do not know kv.shared_prefix_blocks)
    rt.keys.has_vllm_workers = True
    pv = rt.key_plan(ids, "salt-a", None)
    assert pv.vllm_digests is not None and pv.vllm_digests[0] != pv.digests[0]


def test_tenant_wire_salts_for_purge() -> None:
    cfg = build_config({"models": [{"id": "m", "tokenizer": str(TOK)}],
                        "tenants": [{"id": "a", "api_keys": ["sk-aaaaaaaa"]}]}, ROOT, environ={})
    ten = Tenancy(cfg, max_salts_per_tenant=2)
    t = ten.tenants["a"]
    for cs in ("x", "y", "z", None):
        ten.remember_salt(t, cs)
    salts = ten.wire_salts(t)
    assert len(salts) == 3  # tenant-only + the 2 most recent request salts (bounded)
    ns = Namespace("any").scoped(tenant_salt=t.salt, cache_salt="z")
    assert ns.wire_salt in salts and Namespace("q").scoped(tenant_salt=t.salt).wire_salt in salts


def test_recorder_writes_mooncake_lines_without_content(tmp_path: Path) -> None:
    rt = _model()
    path = tmp_path / "trace.jsonl"
    rec = TraceRecorder(path, salt="rec-salt", block_tokens=64)
    base = array("I", range(1, 200))
    longer = array("I", list(base) + [7] * 100)
    ns = rt.keys.scoped("", "", 0)
    rec.record(rec._t0 + 0.5, base, ns, 10)
    rec.record(rec._t0 + 1.25, longer, ns, 3)
    rec.record(rec._t0 + 2.0, base, rt.keys.scoped("tenant-x", "", 0), 1)
    rec.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [ln["timestamp"] for ln in lines] == [500, 1250, 2000]
    assert lines[0]["input_length"] == 199 and lines[0]["output_length"] == 10
    assert lines[0]["hash_ids"] == [0, 1, 2, 3]  # ceil(199 / 64) ids, first appearance order
    assert lines[1]["hash_ids"][:3] == [0, 1, 2] and len(lines[1]["hash_ids"]) == 5  # shared full blocks
    assert lines[1]["hash_ids"][3] != 3  # 4th block differs (partial vs full)
    assert not set(lines[2]["hash_ids"]) & set(lines[0]["hash_ids"])  # another tenant: other ids
    assert "1, 2, 3" not in path.read_text()
    again = TraceRecorder(tmp_path / "t2.jsonl", salt="other-salt", block_tokens=64)
    assert again.hash_ids(base, ns) == [0, 1, 2, 3]  # structure, not values, is what is kept


def test_vllm_metrics_parse() -> None:
    text = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""
    v = parse_vllm_metrics(text)
    assert (v.waiting_requests, v.running_requests, v.kv_usage, v.gpu_blocks) == (3, 7, 0.25, None)
    info = text + (
        '# TYPE vllm:cache_config_info gauge\n'
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="661"} 1.0\n'
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="339"} 1.0\n'
    )
    assert parse_vllm_metrics(info).gpu_blocks == 1000  # two engines behind one server add up
    assert parse_vllm_metrics(info.replace('"661"', '"None"').replace('"339"', '"None"')).gpu_blocks is None
    old = text.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_vllm_metrics(old).kv_usage == 0.25
    with pytest.raises(ValueError):
        parse_vllm_metrics("# nothing here\nfoo 1\n")


def _raw_and_req(body: bytes, chat: bool) -> tuple[dict[str, Any], Any]:
    return decode_request(body, chat)


def test_validation_messages_name_params() -> None:
    r = decode_chat(b'{"model": "m", "messages": [{"role": "user", "content": '
                    b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}')
    assert check_chat(r, 100) == [{"role": "user", "content": "ab"}]
    raw, r = _raw_and_req(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', True)
    assert check_chat(r, 100) == [{"role": "user", "content": ""}]  # keyed without the image
    e = ours_problem(raw, r, 4)
    assert e is not None and e.param == "messages[0].content[0]" and e.code == "unsupported_content"
    with pytest.raises(ApiError) as ei:
        decode_chat(b'{"model": "m", "messages": [], "max_tokens": "ten"}')
    assert ei.value.param == "max_tokens"
    raw, r = _raw_and_req(b'{"model": "m", "prompt": ["a", "b"]}', False)
    assert check_completion(r, 100) == "a"  # a batch is keyed by its first prompt ...
    e = ours_problem(raw, r, 4)
    assert e is not None and "Batched" in e.message  # ... and only pass-through workers take it
    assert list(check_completion(decode_completion(b'{"model": "m", "prompt": [[1, 2]]}'), 100)) == [1, 2]
    for bad in (b"[1, -2]", b"[1, 2.5]", b'[1, "x"]', b"[1, 100]", b"[]"):
        with pytest.raises(ApiError):
            check_completion(decode_completion(b'{"model": "m", "prompt": ' + bad + b"}"), 100)
    raw, r = _raw_and_req(b'{"model": "m", "prompt": "x", "stop": ["a","b","c","d","e"]}', False)
    e = ours_problem(raw, r, 4)
    assert e is not None and e.param == "stop"


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}), ("logit_bias", {"5": 10}), ("top_k", 40),
    ("repetition_penalty", 1.2), ("n", 2), ("logprobs", True), ("tools", [{"type": "function"}]),
    ("guided_json", {"type": "object"}), ("lora", "a"), ("priority", 1), ("presence_penalty", 0.5),
])
def test_fields_our_workers_lack_are_named_never_dropped(field: str, value: Any) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    raw, r = _raw_and_req(msgspec.json.encode(body), True)
    e = ours_problem(raw, r, 4)
    assert e is not None and e.param == field and e.code == "unsupported_parameter" and field in e.message


@pytest.mark.parametrize("field,value", [("n", 1), ("logprobs", False), ("top_k", -1), ("user", "u"),
                                         ("presence_penalty", 0), ("repetition_penalty", 1.0), ("temperature", 0.5)])
def test_neutral_values_ask_for_nothing(field: str, value: Any) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    raw, r = _raw_and_req(msgspec.json.encode(body), True)
    assert ours_problem(raw, r, 4) is None


def test_add_special_tokens_is_neutral_at_each_endpoints_own_default() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    comp = {"model": "m", "prompt": "hi"}
    for body, chat_route, value, ok in ((chat, True, False, True), (chat, True, True, False),
                                        (comp, False, True, True), (comp, False, False, False)):
        raw, r = _raw_and_req(msgspec.json.encode({**body, "add_special_tokens": value}), chat_route)
        e = ours_problem(raw, r, 4)
        assert (e is None) is ok and (ok or e.param == "add_special_tokens")
