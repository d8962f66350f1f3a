"""HTTP replay against a tiny OpenAI-compatible server started in the test."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from loadtest.replay import PREDICTED_HEADER, WORKER_HEADER, ReplayConfig, Replayer
from loadtest.results import ResultsWriter, read_runs
from loadtest.summary import summarize
from loadtest.tokens import TokenSynth
from loadtest.trace import Trace, TraceError, TraceRequest
from loadtest.tracefiles import MOONCAKE_SLICE

TTFT_S = 0.03
TOKEN_GAP_S = 0.005


class FakeServer:
    """Streams `max_tokens` tokens after TTFT_S; 400s prompts over 5000 tokens; records bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.active = 0
        self.max_active = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        prompt = body.get("prompt")
        if prompt is None:
            prompt = body["messages"][0]["content"].split()
        if len(prompt) > 5000:
            return web.json_response(
                {"error": {"message": "prompt too long", "type": "invalid_request_error", "param": "prompt",
                           "code": None}},
                status=400,
            )
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", WORKER_HEADER: "w7",
                                               PREDICTED_HEADER: "25.0"})
            await resp.prepare(request)
            await asyncio.sleep(TTFT_S)
            chat = "messages" in body
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(TOKEN_GAP_S)
                choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                await resp.write(b"data: " + msgspec.json.encode({"choices": [choice]}) + b"\n\n")
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": body["max_tokens"],
                "prompt_tokens_details": {"cached_tokens": 512},
                "kv": {"loaded_tokens": {"GPU": 256, "CPU": 256}, "recomputed_tokens": len(prompt) - 512,
                       "prefetched_tokens": 256, "queue_ms": 1.0, "load_ms": 2.0, "prefill_ms": 3.0},
            }
            await resp.write(b"data: " + msgspec.json.encode({"choices": [], "usage": usage}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.active -= 1


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, FakeServer]]:
    fake = FakeServer()
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.completions)
    app.router.add_post("/v1/chat/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", fake
    finally:
        await runner.cleanup()


def _trace() -> Trace:
    reqs = [TraceRequest(i, i * 0.02, 600 + 50 * i, 4, (0, 1 + i)) for i in range(8)]
    reqs.append(TraceRequest(8, 0.16, 6000, 4, tuple(range(100, 112))))  # too long for the server
    return Trace("t", 512, reqs)


async def test_replay_open_loop_results(server: tuple[str, FakeServer], tmp_path: Path) -> None:
    url, fake = server
    trace = _trace()
    synth = TokenSynth.for_trace(trace)
    out = tmp_path / "r.jsonl"
    with ResultsWriter(out) as w:
        results = await Replayer(trace, synth, ReplayConfig(url=url + "/v1", progress=False), label="fake",
                                 writer=w).run()
    assert [r.index for r in results] == list(range(9))
    ok = results[:8]
    for r in ok:
        assert r.ok, r
        assert r.ttft_s is not None and r.ttft_s >= TTFT_S * 0.9
        assert r.tpot_s is not None and r.tpot_s >= TOKEN_GAP_S * 0.8
        assert r.e2e_s is not None and r.e2e_s >= r.ttft_s
        assert r.output_tokens == 4 and r.cached_tokens == 512
        assert r.loaded_tokens == {"GPU": 256, "CPU": 256} and r.recomputed_tokens == r.prompt_tokens - 512
        assert r.worker == "w7" and r.predicted_ttft_s == pytest.approx(0.025)
    # open loop: sends follow the schedule (never before their time), not the completions
    # (they overlap, where one at a time would never have two in flight)
    assert all(r.start_s >= r.arrival_s - 0.001 for r in ok)
    assert fake.max_active >= 2
    bad = results[8]
    assert bad.status == 400 and bad.error == "prompt too long" and not bad.ok
    # token ids were sent, exactly the synthesised ones, with ignore_eos
    body = next(b for b in fake.bodies if len(b["prompt"]) == 600)
    assert body["prompt"] == synth.token_list(trace.requests[0]) and body["ignore_eos"] is True
    assert body["max_tokens"] == 4 and body["model"] == "fake-model" and body["stream"] is True
    runs = read_runs(out)
    assert len(runs) == 1 and len(runs[0].results) == 9 and runs[0].meta.duration_s > 0
    s = summarize(runs[0])
    assert s.ok == 8 and s.errors == {"400": 1}
    assert s.hit_rate["CPU"] > 0 and 0 < s.recompute_avoided < 1


async def test_concurrency_bound_is_client_queueing(server: tuple[str, FakeServer]) -> None:
    url, fake = server
    reqs = [TraceRequest(i, 0.0, 100, 3, (i,)) for i in range(5)]
    trace = Trace("burst", 512, reqs)
    cfg = ReplayConfig(url=url, concurrency=1, progress=False, model="m")
    results = await Replayer(trace, TokenSynth.for_trace(trace), cfg).run()
    assert fake.max_active == 1
    assert all(r.ok for r in results)
    queued = sorted(r.client_queue_s for r in results)
    assert queued[0] < 0.02 and queued[-1] >= 4 * TTFT_S  # the last one waited for four others


async def test_chat_endpoint_and_limits(server: tuple[str, FakeServer]) -> None:
    url, fake = server
    trace = _trace()
    cfg = ReplayConfig(url=url, endpoint="chat", progress=False, limit=3, speed=10.0)
    results = await Replayer(trace, TokenSynth.for_trace(trace), cfg).run()
    assert len(results) == 3 and all(r.ok for r in results)
    assert all("messages" in b for b in fake.bodies)
    assert len(fake.bodies[0]["messages"][0]["content"].split()) == 600
    cfg2 = ReplayConfig(url=url, progress=False, duration_s=0.05, model="m")
    results2 = await Replayer(trace, TokenSynth.for_trace(trace), cfg2).run()
    assert [r.index for r in results2] == [0, 1, 2]


async def test_unreachable_server_is_an_error_not_a_hang() -> None:
    from loadtest.ports import free_port

    port = free_port()
    trace = Trace("t", 512, [TraceRequest(0, 0.0, 10, 2, (0,))])
    cfg = ReplayConfig(url=f"http://127.0.0.1:{port}", model="m", progress=False)
    results = await Replayer(trace, TokenSynth.for_trace(trace), cfg).run()
    assert results[0].status == 0 and "Connect" in (results[0].error or "")
    with pytest.raises(TraceError, match="pass --model"):
        await Replayer(trace, TokenSynth.for_trace(trace), ReplayConfig(url=f"http://127.0.0.1:{port}",
                                                                        progress=False)).run()


def test_config_validation() -> None:
    with pytest.raises(TraceError):
        ReplayConfig(url="ftp://x")
    with pytest.raises(TraceError):
        ReplayConfig(endpoint="embeddings")
    with pytest.raises(TraceError):
        ReplayConfig(concurrency=0)


@pytest.mark.slow
def test_compare_offline_vs_http_end_to_end(tmp_path: Path) -> None:
    """The `compare` command on a tiny slice: sim cluster + gateway subprocesses, both runs complete."""
    from loadtest.compare import CompareConfig, run_compare
    from loadtest.results import read_runs
    from loadtest.traces import load_trace

    trace = load_trace(MOONCAKE_SLICE).window(limit=20)
    cfg = CompareConfig(policies=["round_robin"], workers=2, tolerance=10.0, offline_seeds=3, http_runs=2)
    assert run_compare(trace, cfg, tmp_path)
    runs = {r.meta.run: r for r in read_runs(tmp_path / "results.jsonl")}
    assert set(runs) == {"sim:round_robin", "http:round_robin", "http:round_robin#2"}
    assert all(r.ok for r in runs["http:round_robin"].results + runs["http:round_robin#2"].results)
    assert len(runs["sim:round_robin"].meta.params["transport"]["seed_p50_s"]) == 3
    assert (tmp_path / "report.md").read_text().count("PASS round_robin") == 1


def test_offline_side_takes_the_median_draw_of_the_transport() -> None:
    from loadtest.compare import CompareConfig, offline_median_run
    from loadtest.summary import summarize
    from loadtest.tokens import TokenSynth
    from loadtest.traces import load_trace

    trace = load_trace(MOONCAKE_SLICE).window(limit=40)
    cfg = CompareConfig(workers=2, offline_seeds=5)
    synth = TokenSynth.for_trace(trace, vocab_size=cfg.vocab_size, seed=cfg.seed)
    run, p50s = offline_median_run(trace, cfg, "round_robin", synth)
    assert len(p50s) == 5 and len(set(p50s)) > 1  # the jitter draws differ
    assert summarize(run).ttft["p50"] == sorted(p50s)[2]
    assert run.meta.params["transport"]["name"] == "local-http"
    assert run.meta.params["router"]["transport_seed"] == run.meta.params["transport"]["seed"]
    pure, one = offline_median_run(trace, CompareConfig(workers=2, transport="none"), "round_robin", synth)
    assert len(one) == 1  # no jitter: deterministic, one draw
    with pytest.raises(TraceError, match="unknown transport"):
        CompareConfig(transport="pigeon")
    with pytest.raises(TraceError):
        CompareConfig(http_runs=0)


def test_compare_gives_both_sides_the_same_gateway_queue() -> None:
    from loadtest.compare import CompareConfig, _gateway_config, offline_run
    from loadtest.tokens import TokenSynth
    from loadtest.traces import load_trace
    from router.config import build_config

    cfg = CompareConfig(workers=2, transport="none", hold_target_s=0.5, gateway_order="spf", max_hold_s=3.0)
    conf = _gateway_config(cfg, "kv_cost", ["http://127.0.0.1:1"], 9)
    gq = build_config(conf, environ={}).routing.gateway_queue
    assert (gq.hold_target_s, gq.order, gq.max_hold_s) == (0.5, "spf", 3.0)
    trace = load_trace(MOONCAKE_SLICE).window(limit=10)
    run = offline_run(trace, cfg, "kv_cost", TokenSynth.for_trace(trace, vocab_size=cfg.vocab_size, seed=0))
    r = run.meta.params["router"]
    assert (r["hold_target_s"], r["gateway_order"], r["max_hold_s"]) == (0.5, "spf", 3.0)
    off = _gateway_config(CompareConfig(workers=2), "kv_cost", ["http://127.0.0.1:1"], 9)
    assert build_config(off, environ={}).routing.gateway_queue.hold_target_s is None


async def test_replay_against_a_simulated_worker() -> None:
    """Our own worker's stream and usage (with the `kv` extension) parse; a repeated
    prefix comes back as cached tokens, exactly as the trace shares it."""
    from workers.cluster import SimCluster
    from workers.sim.testing import make_profile

    prof = make_profile(block_size=16, gpu_blocks=4096, max_num_batched_tokens=2048)
    c = SimCluster(1, prof)
    await c.start()
    try:
        url = c.workers[0].url
        reqs = [TraceRequest(0, 0.0, 700, 3, (0, 1)), TraceRequest(1, 0.3, 900, 3, (0, 2))]
        trace = Trace("sim", 512, reqs)
        cfg = ReplayConfig(url=url, model=prof.model, progress=False)
        results = await Replayer(trace, TokenSynth.for_trace(trace), cfg).run()
    finally:
        await c.stop()
    assert all(r.ok for r in results), [r.error for r in results]
    a, b = results
    assert a.output_tokens == 3 and a.tpot_s is not None and a.recomputed_tokens == 700 - a.cached_tokens
    assert b.cached_tokens == 512 and b.loaded_tokens.get("GPU") == 512  # the shared 512-token block
    assert b.queue_ms is not None and b.prefill_ms is not None


def test_cli_replay_writes_results_and_report(tmp_path: Path) -> None:
    """`loadtest.cli replay` end to end (the server runs on its own loop in a thread)."""
    import threading

    from loadtest.cli import main
    from loadtest.mooncake import dump_mooncake

    fake = FakeServer()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, object] = {}

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/v1/models", fake.models)
        app.router.add_post("/v1/completions", fake.completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        box["runner"] = runner
        started.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    t.start()
    assert started.wait(10)
    try:
        trace_file = tmp_path / "t.jsonl"
        dump_mooncake(_trace(), trace_file)
        out = tmp_path / "out"
        rc = main(["replay", "--trace", str(trace_file), "--url", f"http://127.0.0.1:{box['port']}",
                   "--limit", "4", "--speed", "4", "--out", str(out), "--no-progress"])
        assert rc == 0
        runs = read_runs(out / "results.jsonl")
        assert len(runs) == 1 and len(runs[0].results) == 4 and all(r.ok for r in runs[0].results)
        assert (out / "report.md").exists() and (out / "ttft_cdf.png").exists()
        assert main(["replay", "--trace", str(trace_file), "--url", "ftp://nope", "--out", str(out)]) == 2
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


def test_compare_can_recheck_the_offline_side_against_earlier_http_runs(tmp_path: Path) -> None:
    """`--http-from`: the HTTP runs of an earlier compare are reused as they are. Fed an
    "HTTP" run that is the offline run itself, the comparison must come out exact."""
    from msgspec.structs import replace as sreplace

    from loadtest.compare import CompareConfig, offline_run, run_compare
    from loadtest.results import ResultsWriter, read_runs
    from loadtest.tokens import TokenSynth
    from loadtest.traces import load_trace

    trace = load_trace(MOONCAKE_SLICE).window(limit=20)
    cfg = CompareConfig(policies=["round_robin"], workers=2, transport="none")
    synth = TokenSynth.for_trace(trace, vocab_size=cfg.vocab_size, seed=cfg.seed)
    run = offline_run(trace, cfg, "round_robin", synth)
    earlier = tmp_path / "earlier.jsonl"
    with ResultsWriter(earlier) as w:
        w.write_run(sreplace(run.meta, run="http:round_robin", mode="replay"),
                    [sreplace(r, run="http:round_robin") for r in run.results])
    out = tmp_path / "again"
    assert run_compare(trace, cfg, out, http_from=earlier)
    assert "difference 0.0%" in (out / "report.md").read_text()
    assert {r.meta.run for r in read_runs(out / "results.jsonl")} == {"sim:round_robin", "http:round_robin"}
    with pytest.raises(TraceError, match="no run 'http:kv_cost'"):
        run_compare(trace, CompareConfig(policies=["kv_cost"], workers=2, transport="none"), out, http_from=earlier)
    with pytest.raises(TraceError, match="must not be"):
        run_compare(trace, cfg, out, http_from=out / "results.jsonl")


def test_compare_cluster_workers_can_pull_from_each_other(tmp_path: Path) -> None:
    """The HTTP side's workers advertise `peer_pull`, as the offline fleet has peer links:
    otherwise the gateway never plans a peer pull and the two sides reuse different KV."""
    import json
    import urllib.request

    from loadtest.compare import CompareConfig, _start_cluster, _stop

    proc, urls = _start_cluster(CompareConfig(workers=2), tmp_path / "cluster.log")
    try:
        assert len(urls) == 2
        for url in urls:
            with urllib.request.urlopen(url + "/info", timeout=10) as r:
                caps = json.loads(r.read())["capabilities"]
            assert "peer_pull" in caps and "prefetch" in caps
    finally:
        _stop(proc)
