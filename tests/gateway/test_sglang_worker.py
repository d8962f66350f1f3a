"""`kind: sglang` workers: config, load from SGLang's `/metrics`, and a fake SGLang server
whose KV events (SGLang's structs, pages of one token, published over ZMQ as SGLang's
publisher does) make a repeated prompt go to it. SGLang itself is not installed here: the
events are built to its structs (tests/support/sglang_fixtures.py), the metrics to its collector's
gauge names."""
from __future__ import annotations

import asyncio
import socket
from array import array

import pydantic
import pytest
import zmq
import zmq.asyncio
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL, _cfg, client, fleet, wait_until
from sglang_fixtures import encode_batch, stored_pages

from kvindex.events import seq_to_bytes
from router.fleet.dp_ranks import RANK_HEADER, expand_ranks, rank_headers
from router.fleet.fleetconfig import WorkerConfig
from router.fleet.sglang_load import parse_sglang_metrics, sglang_report

# As SGLang's collector writes them: HELP/TYPE, labels model_name, engine_type and the
# scheduler's ranks; the tensor-parallel ranks of one DP rank report the same figures.
_METRICS = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 5.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="1"} 5.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 5000.0
sglang:num_used_tokens{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2500.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.25
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 3.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:num_queue_reqs_total not this one
sglang:num_queue_reqs_total{model_name="m"} 99.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
sglang:cache_hit_rate{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.7
"""


def test_sglang_metrics_give_queue_and_pool() -> None:
    whole = parse_sglang_metrics(_METRICS)
    assert (whole.waiting_requests, whole.running_requests) == (3, 7)  # TP ranks not double-counted
    r0, r1 = parse_sglang_metrics(_METRICS, "0"), parse_sglang_metrics(_METRICS, "1")
    assert (r0.waiting_requests, r0.running_requests, r0.token_usage, r0.pool_tokens) == (3, 5, 0.5, 10_000)
    assert (r1.waiting_requests, r1.running_requests, r1.token_usage, r1.pool_tokens) == (0, 2, 0.25, 10_000)
    rep = sglang_report(r0, 8)
    assert rep.waiting_requests == 3 and rep.running_requests == 5
    g = rep.blocks["GPU"]
    assert (g.used, g.free, g.capacity) == (625, 625, 1250)  # pages of 8 tokens
    # an unlabelled server: every rank shares its figures; no usage: no blocks
    plain = "sglang:num_queue_reqs 2.0\nsglang:num_running_reqs 4.0\n"
    assert parse_sglang_metrics(plain, "1").waiting_requests == 2
    assert sglang_report(parse_sglang_metrics(plain), 1).blocks == {}
    with pytest.raises(ValueError, match="enable-metrics"):
        parse_sglang_metrics("vllm:num_requests_waiting 1.0\n")


def test_sglang_config() -> None:
    wc = WorkerConfig(id="s", url="http://10.0.0.5:30000", kind="sglang", data_parallel_size=2,
                      events={"endpoint": "tcp://10.0.0.5:5557"})
    assert wc.block_size == 1  # SGLang's default --page-size
    ranks = expand_ranks(wc)
    assert [r.events.endpoint for r in ranks if r.events] == ["tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"]
    assert [rank_headers(r) for r in ranks] == [{RANK_HEADER: "0"}, {RANK_HEADER: "1"}]
    assert WorkerConfig(id="s", url="http://h:1", kind="sglang", block_size=64).block_size == 64
    # SGLang publishes under an empty topic unless told otherwise: subscribe to every topic
    assert [r.events.topic for r in ranks if r.events] == ["", ""]
    named = WorkerConfig(id="s", url="http://h:1", kind="sglang", events={"endpoint": "tcp://h:5", "topic": "kv"})
    assert named.events is not None and named.events.topic == "kv"
    vllm = WorkerConfig(id="v", url="http://h:1", kind="vllm", events={"endpoint": "tcp://h:5"})
    assert vllm.events is not None and vllm.events.topic == "kv" and vllm.block_size is None
    with pytest.raises(pydantic.ValidationError, match="vllm or sglang"):
        WorkerConfig(id="k", url="http://h:1", kind="kvroute", data_parallel_size=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_repeated_prompt_goes_to_the_sglang_worker_holding_it() -> None:
    """Two SGLang servers (page size 1); s1's events say it holds the prompt: the prompt is
    sent to s1, the client's body unchanged, and the load comes from its /metrics."""
    ports = {w: _free_port() for w in ("s0", "s1")}
    fakes = {w: FakeWorker(w, DIGEST, kind="sglang") for w in ports}
    prompt = [7] * 24 + list(range(100, 200))
    async with serve_fake(fakes["s0"]), serve_fake(fakes["s1"]):
        cfg = _cfg()
        cfg.workers = [WorkerConfig(id=w, url=f.url, kind="sglang", model=MODEL,
                                    events={"endpoint": f"tcp://127.0.0.1:{ports[w]}", "bind": True},
                                    cost={"prefill_tokens_per_s": 2000.0, "prefill_overhead_s": 0.001})
                       for w, f in fakes.items()]
        async with fleet([], cfg) as (gw, url):
            await wait_until(lambda: len(gw.pool.routable(MODEL)) == 2, 10.0, "both SGLang workers registered")
            rt = gw.models.get(MODEL)
            digests = rt.key_plan(array("I", prompt), "", None).digests
            assert len(digests) == 7
            ctx = zmq.asyncio.Context()
            pub = ctx.socket(zmq.PUB)
            try:
                pub.connect(f"tcp://127.0.0.1:{ports['s1']}")  # SGLang connects to a tcp://host:port endpoint
                payload = encode_batch(stored_pages(prompt, 1), dp_rank=0)
                for seq in range(500):  # a PUB drops what it sends before the subscription arrives
                    await pub.send_multipart([b"", seq_to_bytes(seq), payload])
                    await asyncio.sleep(0.01)
                    if rt.index.match(digests, ["s1"]):
                        break
            finally:
                pub.close(0)
                ctx.term()
            m = rt.index.match(digests, ["s1", "s0"])
            assert set(m) == {"s1"} and m["s1"].blocks == 7
            await wait_until(lambda: gw.pool.workers["s1"].view.gpu_capacity_blocks == 8192, 10.0,
                             "its load read from SGLang's /metrics")
            c = client(url)
            for _ in range(3):
                raw = await c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1,
                                                                   extra_body={"regex": "[a-z]+"})
                assert raw.headers["x-kvroute-worker"] == "s1"
            sent = fakes["s1"].completions[-1]
            assert sent["prompt"] == prompt and sent["regex"] == "[a-z]+"  # SGLang's own field, forwarded
            assert not fakes["s0"].completions


def test_cached_tokens_of_a_page_granular_engine_are_checked_per_index_block() -> None:
    """SGLang (with `--enable-cache-report`) reports cached tokens at page granularity (one
    token by default), the index in whole blocks: less than a block apart is rounding; an
    engine that keeps reporting less than the index holds is flagged mis-keyed."""
    from types import SimpleNamespace

    from kvindex.events import EventDecoder
    from kvindex.index import PrefixIndex
    from kvindex.keys import BlockHasher, Namespace, digests64
    from router.telemetry.fidelity import WINDOW, KeyFidelity
    from router.telemetry.metrics import GatewayMetrics
    from router.telemetry.observe import Observer

    ns = Namespace("m", block_size=16)
    index = PrefixIndex(16)
    index.add_worker("s", ns.digest, 1)
    prompt = list(range(1000, 1150))  # 150 tokens: 9 whole blocks and 6 tokens
    index.apply("s", EventDecoder().decode(encode_batch(stored_pages(prompt, 1, coalesce=True))))
    ds = digests64(BlockHasher(ns.digest, 16).keys(prompt))
    obs = Observer(SimpleNamespace(), GatewayMetrics(), None, KeyFidelity())  # type: ignore[arg-type]
    prep = SimpleNamespace(ids=prompt, plan=SimpleNamespace(digests=ds, vllm_digests=None),
                           model=SimpleNamespace(block_size=16, index=index))
    a = SimpleNamespace(prep=prep, worker=SimpleNamespace(id="s", kind="sglang", block_size=1))
    match = index.match(ds)["s"]
    assert match.blocks == 9
    for _ in range(WINDOW):  # SGLang served 149 of 150 tokens from cache; the index knows 144
        obs._fidelity(a, SimpleNamespace(prompt_tokens=150, cached_tokens=149), match)  # type: ignore[arg-type]
    wf = obs.fidelity.workers["s"]
    assert wf.cached_mismatches == 0 and not wf.mis_keyed
    # it keeps reporting one block cached while the index says 144: mis-keyed (SGLang leaves
    # prompt_tokens_details out when nothing was cached, so 0 never comes)
    for _ in range(WINDOW):
        obs._fidelity(a, SimpleNamespace(prompt_tokens=150, cached_tokens=16), match)  # type: ignore[arg-type]
    assert wf.cached_mismatches == WINDOW and wf.mis_keyed


async def test_a_field_our_engines_lack_goes_only_to_the_sglang_worker() -> None:
    """In a mixed fleet, a request with a field our engines do not implement is a pass-through
    request: it goes to the SGLang worker (as to a vLLM one), never a 400."""
    ours = FakeWorker("k0", DIGEST)
    sg = FakeWorker("s0", DIGEST, kind="sglang")
    async with fleet([ours, sg]) as (gw, url):
        await wait_until(lambda: len(gw.pool.routable(MODEL)) == 2, 10.0, "both workers registered")
        c = client(url)
        for _ in range(4):
            raw = await c.completions.with_raw_response.create(model=MODEL, prompt="Hello there", max_tokens=1,
                                                               extra_body={"response_format": {"type": "json_object"}})
            assert raw.headers["x-kvroute-worker"] == "s0"
        assert sg.completions[-1]["response_format"] == {"type": "json_object"} and not ours.completions
