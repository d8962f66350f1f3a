"""A vLLM server's data-parallel ranks (router/fleet/dp_ranks.py): each rank a worker of
its own, indexed from its own event stream and pinned by `X-data-parallel-rank`."""
from __future__ import annotations

import asyncio
import socket
import time
from array import array
from typing import Any

import pydantic
import pytest
import zmq
import zmq.asyncio
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL, _cfg, client, fleet, wait_until

from kvindex.events import BlockStored, EventEncoder, seq_to_bytes
from router.fleet.dp_ranks import RANK_HEADER, expand_ranks, rank_headers
from router.fleet.fleetconfig import WorkerConfig
from router.fleet.vllm_load import parse_vllm_metrics


def test_a_dp_server_becomes_one_worker_per_rank() -> None:
    wc = WorkerConfig(id="v", url="http://10.0.0.5:8000", kind="vllm", data_parallel_size=3,
                      events={"endpoint": "tcp://10.0.0.5:5557", "replay_endpoint": "tcp://10.0.0.5:5600"})
    ranks = expand_ranks(wc)
    assert [r.id for r in ranks] == ["v.dp0", "v.dp1", "v.dp2"]
    assert [r.data_parallel_rank for r in ranks] == [0, 1, 2] and {r.url for r in ranks} == {wc.url}
    assert [r.events.endpoint for r in ranks if r.events] == ["tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558",
                                                              "tcp://10.0.0.5:5559"]
    assert [r.events.replay_endpoint for r in ranks if r.events] == ["tcp://10.0.0.5:5600", "tcp://10.0.0.5:5601",
                                                                     "tcp://10.0.0.5:5602"]
    assert [rank_headers(r) for r in ranks] == [{RANK_HEADER: "0"}, {RANK_HEADER: "1"}, {RANK_HEADER: "2"}]
    inproc = WorkerConfig(id="v", url="http://h:1", kind="vllm", data_parallel_size=2,
                          events={"endpoint": "inproc://kv"})
    assert [r.events.endpoint for r in expand_ranks(inproc) if r.events] == ["inproc://kv", "inproc://kv_dp1"]
    one = WorkerConfig(id="v", url="http://h:1", kind="vllm")
    assert expand_ranks(one) == [one] and rank_headers(one) == {}
    given = WorkerConfig(id="v-r1", url="http://h:1", kind="vllm", data_parallel_size=2, data_parallel_rank=1)
    assert expand_ranks(given) == [given] and rank_headers(given) == {RANK_HEADER: "1"}


@pytest.mark.parametrize("fields,says", [
    ({"kind": "vllm", "data_parallel_size": 2, "data_parallel_rank": 2}, "not below"),
    ({"kind": "kvroute", "data_parallel_size": 2}, "kind: vllm"),
    ({"kind": "vllm", "data_parallel_size": 2, "events": {"endpoint": "ipc:///tmp/kv"}}, "its own entry"),
    ({"kind": "vllm", "data_parallel_size": 0}, "greater than or equal to 1"),
])
def test_bad_rank_settings_fail_when_the_config_is_read(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(pydantic.ValidationError) as ei:
        WorkerConfig(id="v", url="http://h:1", **fields)
    assert says in str(ei.value)


_METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{engine="1",num_gpu_blocks="100"} 1.0
"""


def test_each_rank_reads_its_own_engines_load() -> None:
    r0, r1 = parse_vllm_metrics(_METRICS, "0"), parse_vllm_metrics(_METRICS, "1")
    assert (r0.waiting_requests, r0.running_requests, r0.kv_usage, r0.gpu_blocks) == (3, 5, 0.5, 100)
    assert (r1.waiting_requests, r1.running_requests, r1.kv_usage, r1.gpu_blocks) == (0, 1, 0.25, 100)
    whole = parse_vllm_metrics(_METRICS)
    assert (whole.waiting_requests, whole.running_requests, whole.gpu_blocks) == (3, 6, 200)
    # a server that does not label its engines: every rank shares the server's figure
    plain = "vllm:num_requests_waiting 2.0\nvllm:num_requests_running 4.0\n"
    assert parse_vllm_metrics(plain, "1").waiting_requests == 2


def _two_free_ports() -> int:
    """P such that P and P + 1 are free (rank r's events arrive on P + r)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


async def test_a_prompt_goes_to_the_rank_holding_its_prefix() -> None:
    """Rank 1's events say it holds prompt A, rank 0's that it holds prompt B: each
    prompt is sent to the server with the header of the rank that holds it, and the
    admin API lists both ranks as workers."""
    port = _two_free_ports()
    v = FakeWorker("v", DIGEST, kind="vllm")
    prompts = {1: [7] * 40 + list(range(100, 228)), 0: [9] * 40 + list(range(300, 428))}
    async with serve_fake(v):
        cfg = _cfg()
        cfg.workers = [WorkerConfig(id="v", url=v.url, kind="vllm", model=MODEL, block_size=32, data_parallel_size=2,
                                    events={"endpoint": f"tcp://127.0.0.1:{port}", "bind": True},
                                    # a stated speed (the fake answers at once): the cache decides
                                    cost={"prefill_tokens_per_s": 2000.0, "prefill_overhead_s": 0.001})]
        async with fleet([], cfg) as (gw, url):
            await wait_until(lambda: len(gw.pool.routable(MODEL)) == 2, 10.0, "both ranks registered")
            assert set(gw.pool.workers) == {"v.dp0", "v.dp1"}
            rt = gw.models.get(MODEL)
            ctx = zmq.asyncio.Context()
            pubs = {r: ctx.socket(zmq.PUB) for r in (0, 1)}
            try:
                for r, pub in pubs.items():
                    pub.connect(f"tcp://127.0.0.1:{port + r}")
                for r, pub in pubs.items():
                    toks = prompts[r]
                    n = len(toks) // 32
                    ev = BlockStored(list(range(1000 * (r + 1), 1000 * (r + 1) + n)), None, toks[: 32 * n], 32,
                                     medium="GPU")
                    payload = EventEncoder().encode(time.time(), [ev], data_parallel_rank=r)
                    digests = rt.key_plan(array("I", toks), "", None).digests
                    for seq in range(500):  # a PUB drops what it sends before the subscription arrives
                        await pub.send_multipart([b"kv", seq_to_bytes(seq), payload])
                        await asyncio.sleep(0.01)
                        if rt.index.match(digests, [f"v.dp{r}"]):
                            break
                    assert rt.index.match(digests, [f"v.dp{r}"]) and not rt.index.match(digests, [f"v.dp{1 - r}"])
            finally:
                for pub in pubs.values():
                    pub.close(0)
                ctx.term()
            c = client(url)
            for r in (1, 0, 1, 0):
                raw = await c.completions.with_raw_response.create(model=MODEL, prompt=prompts[r], max_tokens=1)
                assert raw.headers["x-kvroute-worker"] == f"v.dp{r}"
                assert v.completion_headers[-1].get(RANK_HEADER.lower()) == str(r)
