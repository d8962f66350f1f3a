"""Prefill/decode disaggregation through the gateway (router/upstream/pair.py): the exact
two-request exchange with fake vLLM servers (prefill with a KV connector, decode), what
the client sees, prefill and decode failures, the bypass, roles in the pool and config."""
from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
import pytest
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL, _cfg, fleet, wait_until
from test_gateway_routing import PROMPT, _explain, _store

from router.fleet.fleetconfig import WorkerConfig

# What a vLLM prefill server's NIXL connector answers (spacing and key order its own: the
# decode worker must get exactly these bytes).
P_PARAMS = (b'{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [7, 8, 9],'
            b' "remote_engine_id": "eng-p", "remote_host": "10.0.0.5", "remote_port": 5600, "tp_size": 1}')
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _pd_cfg() -> Any:
    # vLLM workers report no speeds or links: the model's cost defaults price them
    models = [{"id": MODEL, "served_names": ["alias"], "tokenizer": "configs/assets/tiny-tokenizer",
               "max_context_tokens": 512,
               "cost": {"prefill_tokens_per_s": 20000.0, "decode_step_s": 0.01,
                        "links": {"PEER": {"read_Bps": 5e10, "latency_s": 1e-5}}}}]
    return _cfg(models=models, routing={"policy": "pd_cost", "retries": 1})


def _p(name: str = "p", **kw: Any) -> FakeWorker:
    return FakeWorker(name, DIGEST, kind="vllm", role="prefill", kv_transfer_answer=P_PARAMS, **kw)


def _d(name: str = "d", **kw: Any) -> FakeWorker:
    return FakeWorker(name, DIGEST, kind="vllm", role="decode", **kw)


async def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.read(), dict(r.headers)


async def test_the_two_request_exchange_as_vllm_expects_it() -> None:
    p, d = _p(), _d()
    async with fleet([p, d], _pd_cfg()) as (gw, url):
        observed: list[tuple[str, float | None, float]] = []
        real_observe = gw.policy.observe

        def spy(wid: str, predicted: float | None, actual: float, kv: Any) -> None:
            observed.append((wid, predicted, actual))
            real_observe(wid, predicted, actual, kv)

        gw.policy.observe = spy
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 5})
        ex_prefill = ex["decision"]["pd"]["chosen"]["terms"]["prefill_ttft"]
        client_body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True, "temperature": 0.5,
                       "min_tokens": 2, "stream_options": {"include_usage": True}, "seed": 7}
        status, body, hdrs = await _post(url, client_body)
        assert status == 200, body
        # request 1 to P: the client's fields, one token, no stream, a remote decode asked for
        assert len(p.completions) == 1 and not d.bodies[1:]
        r1 = p.completions[0]
        assert r1["kv_transfer_params"] == REMOTE_DECODE
        assert r1["max_tokens"] == 1 and r1["stream"] is False
        assert "stream_options" not in r1 and "min_tokens" not in r1
        assert r1["prompt"] == PROMPT and r1["temperature"] == 0.5 and r1["seed"] == 7 and r1["model"] == MODEL
        # request 2 to D: the client's body with P's kv_transfer_params, byte for byte
        assert len(d.completions) == 1
        r2 = d.completions[0]
        assert b'"kv_transfer_params":' + P_PARAMS in d.bodies[0]
        assert r2["stream"] is True and r2["max_tokens"] == 5 and r2["min_tokens"] == 2
        assert r2["prompt"] == PROMPT and r2["temperature"] == 0.5 and r2["seed"] == 7
        assert r2["stream_options"]["include_usage"] is True
        # the client reads D's stream: its five tokens, D's usage
        events = [e[6:] for e in body.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [msgspec.json.decode(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "t0 t1 t2 t3 t4 "
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        # who prefilled, who decoded, how much KV moved (the prompt's 20 full blocks)
        assert hdrs["x-kvroute-prefill-worker"] == "p" and hdrs["x-kvroute-decode-worker"] == "d"
        assert hdrs["x-kvroute-worker"] == "d" and hdrs["x-kvroute-kv-moved-tokens"] == str(16 * 20)
        assert gw.metrics.pd_served.labels("pair")._value.get() == 1
        # the prefill leg calibrates P against the pair's prefill term; D's leg has no prediction
        assert [(o[0], o[1] is None) for o in observed] == [("p", False), ("d", True)]
        assert observed[0][1] == pytest.approx(ex_prefill) and observed[0][2] > 0


async def test_a_whole_answer_and_max_completion_tokens() -> None:
    p, d = _p(), _d()
    async with fleet([p, d], _pd_cfg()) as (gw, url):
        status, body, hdrs = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                               "max_completion_tokens": 3})
        assert status == 200, body
        r1, r2 = p.completions[0], d.completions[0]
        assert r1["max_tokens"] == 1 and r1["max_completion_tokens"] == 1 and r1["stream"] is False
        assert r2["max_completion_tokens"] == 3 and not r2.get("stream")
        assert msgspec.json.decode(body)["choices"][0]["text"] == "t0 t1 t2 "
        assert hdrs["x-kvroute-decode-worker"] == "d"


async def test_a_failing_prefill_worker_is_replaced_by_the_next_option() -> None:
    # p1 fails; p2 (priced the same, listed second) prefills; the client never sees p1's failure
    p1 = _p("p1", fail_status=500)
    p2 = _p("p2")
    d = _d()
    async with fleet([p1, p2, d], _pd_cfg()) as (gw, url):
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert ex["decision"]["pd"]["chosen"]["prefill_worker"] == "p1"
        status, body, hdrs = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert status == 200, body
        assert len(p1.completions) == 1 and len(p2.completions) == 1 and len(d.completions) == 1
        assert hdrs["x-kvroute-prefill-worker"] == "p2" and hdrs["x-kvroute-decode-worker"] == "d"
        assert b'"kv_transfer_params":' + P_PARAMS in d.bodies[0]


async def test_a_decode_worker_failing_before_its_first_byte_is_replaced_with_the_same_parameters() -> None:
    p, d1 = _p(), _d("d1", fail_status=500)
    d2 = _d("d2")  # priced as d1, listed second
    async with fleet([p, d1, d2], _pd_cfg()) as (gw, url):
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert ex["decision"]["pd"]["chosen"]["decode_worker"] == "d1"
        status, body, hdrs = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
        assert status == 200, body
        assert len(p.completions) == 1  # one prefill: its blocks serve the second decode worker
        assert b'"kv_transfer_params":' + P_PARAMS in d1.bodies[0]
        assert b'"kv_transfer_params":' + P_PARAMS in d2.bodies[0]
        assert hdrs["x-kvroute-decode-worker"] == "d2" and hdrs["x-kvroute-prefill-worker"] == "p"


async def test_no_decode_worker_left_after_the_prefill_is_a_clear_502() -> None:
    p, d = _p(), _d(fail_status=500)
    async with fleet([p, d], _pd_cfg()) as (gw, url):
        status, body, _ = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
        assert status == 502
        err = msgspec.json.decode(body)["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert "decode side failed after the prompt was prefilled on p" in err["message"]
        assert len(p.completions) == 1 and len(d.completions) == 1


async def test_decode_failing_mid_stream_ends_the_stream_with_an_error_event() -> None:
    p, d = _p(), _d(die_after_chunks=2)
    async with fleet([p, d], _pd_cfg()) as (gw, url):
        status, body, hdrs = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True})
        assert status == 200 and hdrs["x-kvroute-decode-worker"] == "d"
        text = body.decode()
        assert "t0 " in text and '"error"' in text and len(p.completions) == 1


async def test_bypass_a_decode_worker_holding_the_prefix_serves_it_without_a_remote_prefill() -> None:
    p, d = _p(), _d()
    async with fleet([p, d], _pd_cfg()) as (gw, url):
        _store(gw, "d", PROMPT, "GPU", 20)
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        pd = ex["decision"]["pd"]
        assert pd["chosen"]["kind"] == "bypass" and pd["chosen"]["decode_worker"] == "d"
        assert ex["decision"]["prefill_worker_id"] is None
        assert any(o["kind"] == "pair" for o in pd["alternatives"]) and "bypass d" in pd["why"]
        assert "transfer" in next(o for o in pd["alternatives"] if o["kind"] == "pair")["terms"]
        status, body, hdrs = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert status == 200, body
        assert not p.completions and len(d.completions) == 1
        assert "kv_transfer_params" not in d.completions[0]
        assert hdrs["x-kvroute-worker"] == "d" and "x-kvroute-prefill-worker" not in hdrs
        assert gw.metrics.pd_served.labels("bypass")._value.get() == 1


async def test_explain_shows_the_pair_with_its_terms_and_the_alternatives() -> None:
    async with fleet([_p(), _d(), FakeWorker("b", DIGEST, kind="vllm")], _pd_cfg()) as (gw, url):
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        pd = ex["decision"]["pd"]
        kinds = {pd["chosen"]["kind"]} | {o["kind"] for o in pd["alternatives"]}
        assert kinds == {"single", "pair"}
        pair = pd["chosen"] if pd["chosen"]["kind"] == "pair" else next(
            o for o in pd["alternatives"] if o["kind"] == "pair")
        assert {"prefill_ttft", "transfer", "transfer_tokens", "decode_queue", "decode_tail", "tpot"} <= set(
            pair["terms"])
        assert pd["why"] and ex["policy"] == "pd_cost"


async def test_roles_in_admin_workers_and_their_validation() -> None:
    async with fleet([_p(), _d(), FakeWorker("b", DIGEST, kind="vllm")], _pd_cfg()) as (gw, url):
        async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as r:
            data = await r.json()
        rows = data["workers"] if isinstance(data, dict) else data
        assert {w["id"]: w["role"] for w in rows} == {"p": "prefill", "d": "decode", "b": "both"}
        assert gw.pool.workers["p"].view.role == "prefill" and gw.pool.workers["b"].view.role == "both"
    assert WorkerConfig(id="x", url="http://127.0.0.1:1").role == "both"
    with pytest.raises(ValueError, match="unknown worker role 'prefil'"):
        WorkerConfig(id="x", url="http://127.0.0.1:1", role="prefil")


async def test_our_workers_get_the_same_exchange_through_the_relay() -> None:
    p = FakeWorker("p", DIGEST, role="prefill", kv_transfer_answer=P_PARAMS)
    d = FakeWorker("d", DIGEST, role="decode")
    async with fleet([p, d], _pd_cfg()) as (gw, url):
        status, body, hdrs = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True})
        assert status == 200, body
        r1, r2 = p.completions[0], d.completions[0]
        assert r1["kv_transfer_params"] == REMOTE_DECODE and r1["prompt"] == PROMPT
        assert r1["max_tokens"] == 1 and r1["stream"] is False and "stream_options" not in r1
        assert r1["kv"]["request_id"] == r2["kv"]["request_id"]
        assert b'"kv_transfer_params":' + P_PARAMS in d.bodies[0]
        assert r2["max_tokens"] == 3 and r2["stream"] is True and r2["prompt"] == PROMPT
        assert "t0 t1 t2 " in "".join(
            msgspec.json.decode(e[6:])["choices"][0]["text"] for e in body.decode().split("\n\n")
            if e.startswith("data: {") and msgspec.json.decode(e[6:])["choices"])
        assert hdrs["x-kvroute-prefill-worker"] == "p" and hdrs["x-kvroute-kv-moved-tokens"] == str(16 * 20)


async def test_a_failing_prefill_worker_falls_back_to_one_worker_serving_alone() -> None:
    # b (role both) prefills ten times slower, so the pair p->d wins; p failing leaves b's single option
    p, d = _p(fail_status=503), _d()
    b = FakeWorker("b", DIGEST, kind="vllm")
    cfg = _pd_cfg()
    async with serve_fake(b), fleet([p, d], cfg) as (gw, url):
        await gw.reload(cfg.model_copy(update={"workers": [*cfg.workers, WorkerConfig(
            id="b", url=b.url, model=MODEL, kind="vllm", cost={"prefill_tokens_per_s": 2000.0})]}))
        await wait_until(lambda: "b" in gw.pool.workers and gw.pool.workers["b"].state.value == "healthy", 10.0,
                         "b joined")
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        pd = ex["decision"]["pd"]
        assert pd["chosen"]["kind"] == "pair" and pd["chosen"]["prefill_worker"] == "p"
        assert any(o["kind"] == "single" and o["decode_worker"] == "b" for o in pd["alternatives"])
        status, body, hdrs = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert status == 200, body
        assert len(p.completions) == 1 and not d.completions and len(b.completions) == 1
        assert "kv_transfer_params" not in b.completions[0] and b.completions[0]["max_tokens"] == 4
        assert hdrs["x-kvroute-worker"] == "b" and "x-kvroute-prefill-worker" not in hdrs
        assert gw.metrics.pd_served.labels("single")._value.get() == 1


async def test_the_prefill_workers_own_4xx_reaches_the_client() -> None:
    p, d = _p(fail_status=400, fail_message="This model's maximum context length is 512 tokens"), _d()
    async with fleet([p, d], _pd_cfg()) as (gw, url):
        status, body, _ = await _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert status == 400 and b"maximum context length" in body
        assert len(p.completions) == 1 and not d.completions
