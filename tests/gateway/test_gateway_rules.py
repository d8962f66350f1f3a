"""The gateway's rules that mutants of router/gateway.py, router/upstream/relay.py, router/fleet/pool.py
and router/intake/prepare.py showed unpinned (bench/notes/mutation.md): where a retry goes and how it
is priced and logged, what a failed or shed dispatch answers, the headers and format of
an answer, readiness, the model table, and a config reload.

Each test pins one rule; its docstring says which bug it catches.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL, _cfg, fleet, wait_until

from kvindex.events import BlockStored
from kvindex.keys import digest64
from router.fleet.fleetconfig import WorkerConfig

B = 16


async def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                ) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None), {k.lower(): v for k, v in r.headers.items()}


BODY = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 2}  # 2 full blocks + 8 tokens


def _cache(gw: Any, worker_id: str, tokens: list[int], blocks: int) -> None:
    """Make the index believe `worker_id` holds the first `blocks` blocks of `tokens` on GPU."""
    rt = gw.models.get(MODEL)
    ds = [digest64(k) for k in rt.keys.hasher.keys(tokens)[:blocks]]
    assert rt.index.apply(worker_id, [BlockStored(ds, None, tokens[: B * blocks], B, medium="GPU")]).stored == blocks


async def _explain(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/route/explain", json=body) as r:
        assert r.status == 200
        return await r.json()


@pytest.fixture
def request_log() -> Any:
    """The `request done` records of the gateway's request log."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "request done":
                records.append(record)

    h, lg = _Keep(), logging.getLogger("kvroute.request")
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    yield records
    lg.removeHandler(h)
    lg.setLevel(old)


async def test_the_answer_names_its_worker_and_the_predicted_ttft_in_milliseconds() -> None:
    """`x-kvroute-worker` names the worker that served, `x-kvroute-predicted-ttft-ms` the
    planner's prediction in milliseconds with three decimals (the replay harness reads
    both); the client's X-Request-Id is echoed. Catches a prediction dropped, sent in
    seconds, or the header naming another worker."""
    async with fleet([FakeWorker("a", DIGEST)]) as (_gw, url):
        st, _body, h = await _post(url, BODY, {"x-request-id": "req-42"})
        assert st == 200
        assert h["x-kvroute-worker"] == "a" and h["x-request-id"] == "req-42"
        ms = h["x-kvroute-predicted-ttft-ms"]
        assert len(ms.split(".")[1]) == 3
        # 40 prompt tokens at the fake's 35k tokens/s plus 3 ms overhead: a few milliseconds
        assert 3.0 < float(ms) < 50.0


async def test_every_tried_worker_failing_is_a_502_that_says_how_many_were_tried() -> None:
    """With `routing.retries: 1` a request failing on its worker is tried on exactly one
    more, and the 502 says two were tried; with no retries, one worker is tried and the
    message says so. Catches an off-by-one in the retry budget."""
    bad = [FakeWorker(w, DIGEST, fail_status=500) for w in ("a", "b", "c")]
    async with fleet(bad, _cfg(routing={"policy": "kv_cost", "retries": 1})) as (_gw, url):
        st, body, _ = await _post(url, BODY)
        assert st == 502 and "The 2 workers tried failed" in body["error"]["message"]
        assert sum(len(f.completions) for f in bad) == 2
    bad = [FakeWorker(w, DIGEST, fail_status=500) for w in ("a", "b")]
    async with fleet(bad, _cfg(routing={"policy": "kv_cost", "retries": 0})) as (_gw, url):
        st, body, _ = await _post(url, BODY)
        # one worker tried: no count, and the worker's own (sanitised) words are relayed
        assert st == 502 and body["error"]["message"] == \
            "The worker failed before answering (the worker said: injected 500); retry the request."
        assert sum(len(f.completions) for f in bad) == 1


async def test_ready_needs_a_worker_per_model_every_cache_indexed_and_no_stop() -> None:
    """`/ready` is 200 only when every model has a routable worker, no healthy worker's
    cache is still being indexed, and the gateway is not stopping; any one of the three
    makes it not ready. Catches the conditions joined with `or`, or one dropped."""
    async with fleet([FakeWorker("a", DIGEST)]) as (gw, _url):
        ok, body = gw.ready()
        assert ok and body["healthy_workers"] == {MODEL: 1} and body["indexing_workers"] == []
        gw.stopping = True
        ok, body = gw.ready()
        assert not ok and body["stopping"] is True
        gw.stopping = False
        indexed = gw.pool.indexed
        gw.pool.indexed = lambda w: False  # a worker whose republished cache is not in yet
        ok, body = gw.ready()
        assert not ok and body["indexing_workers"] == ["a"]
        gw.pool.indexed = indexed
        gw.pool.drain("a")
        ok, body = gw.ready()
        assert not ok and body["healthy_workers"] == {MODEL: 0}


def test_models_share_one_tokenizer_per_folder_and_get_only_their_shared_prefixes() -> None:
    """Building the model table: two models on the same tokenizer folder load it once; a
    shared prefix naming a model is added to that model only, one naming none to every
    model. Catches the per-model filter inverted or the tokenizer cache bypassed."""
    from router.config import build_config
    from router.gateway import _models

    tok = "configs/assets/tiny-tokenizer"
    cfg = build_config({
        "models": [{"id": "m1", "tokenizer": tok}, {"id": "m2", "tokenizer": tok}],
        "shared_prefixes": [{"name": "only-m1", "model": "m1", "token_ids": list(range(1, 40))},
                            {"name": "everyone", "token_ids": list(range(50, 90))}],
    }, environ={})
    table = _models(cfg)
    m1, m2 = table.get("m1"), table.get("m2")
    assert m1 is not None and m2 is not None
    assert m1.tokenizer is m2.tokenizer
    assert sorted(sp.name for sp in m1.keys.shared) == ["everyone", "only-m1"]
    assert [sp.name for sp in m2.keys.shared] == ["everyone"]


async def test_a_retry_goes_to_the_next_ranked_worker_and_is_logged_and_priced_as_such(request_log: Any) -> None:
    """The chosen worker (it holds the prompt's blocks) fails with a 500 before its first
    byte: the request is served by the next ranked worker, whose own estimate is the
    predicted TTFT sent back (not the failed worker's); the request log says `retry`,
    try 2; one retry is counted, and the failure feeds only the failed worker's breaker."""
    a, b = FakeWorker("a", DIGEST, fail_status=500), FakeWorker("b", DIGEST)
    async with fleet([a, b]) as (gw, url):
        _cache(gw, "a", BODY["prompt"], 2)
        ex = await _explain(url, BODY)
        assert ex["decision"]["worker_id"] == "a" and ex["decision"]["ranked"][:2] == ["a", "b"]
        t = {e["worker_id"]: e["t_ttft_s"] * 1000 for e in ex["workers"]}
        assert t["b"] > 1.1 * t["a"]  # the cache makes them tell apart
        st, _body, h = await _post(url, BODY)
        assert st == 200 and h["x-kvroute-worker"] == "b" and len(a.completions) == 1
        assert float(h["x-kvroute-predicted-ttft-ms"]) == pytest.approx(t["b"], rel=0.05)
        assert gw.metrics.retries.labels("before_first_byte")._value.get() == 1
        wa, wb = gw.pool.workers["a"], gw.pool.workers["b"]
        assert (wa.breaker.fails, wb.breaker.fails) == (1, 0)
    (rec,) = request_log
    kv = rec.kv  # type: ignore[attr-defined]
    assert (kv["worker"], kv["reason"], kv["tries"]) == ("b", "retry", 2)


async def test_a_cache_hit_counts_only_the_tokens_left_to_prefill() -> None:
    """While a request is in flight its worker's view counts the prefill the planner
    expects it to do: the prompt minus the blocks it holds (40 - 32 = 8 tokens here),
    not the whole prompt; a worker with nothing cached counts every token."""
    a = FakeWorker("a", DIGEST, first_delay_s=0.5)
    async with fleet([a], _cfg(routing={"policy": "kv_cost", "retries": 0})) as (gw, url):
        _cache(gw, "a", BODY["prompt"], 2)
        w = gw.pool.workers["a"]
        req = asyncio.ensure_future(_post(url, BODY))
        await wait_until(lambda: len(w.inflight) == 1, what="the request in flight")
        assert w.view.inflight_prefill_tokens == 40 - 2 * B
        assert (await req)[0] == 200
        other = {**BODY, "prompt": list(range(1000, 1040))}
        req = asyncio.ensure_future(_post(url, other))
        await wait_until(lambda: len(w.inflight) == 1, what="the second request in flight")
        assert w.view.inflight_prefill_tokens == 40
        assert (await req)[0] == 200


async def test_a_worker_dying_after_its_first_chunk_is_a_worker_failed_error_either_way() -> None:
    """After the first chunk nothing can be retried: a non-streaming client gets a 502
    `worker_failed` (nothing was sent yet), a streaming one an SSE error event with that
    code before `[DONE]`; each counts once as a `stream` upstream error of that worker.
    Catches the error code or the metric's phase label changed."""
    dying = FakeWorker("a", DIGEST, die_after_chunks=1)
    async with fleet([dying]) as (gw, url):
        st, body, _ = await _post(url, {**BODY, "max_tokens": 4})
        assert st == 502 and body["error"]["code"] == "worker_failed"
        assert body["error"]["type"] == "upstream_error"
        assert gw.metrics.upstream_errors.labels("a", "stream")._value.get() == 1
        async with aiohttp.ClientSession() as s, \
                s.post(url + "/v1/completions", json={**BODY, "max_tokens": 4, "stream": True}) as r:
            assert r.status == 200
            events = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"worker_failed"' in events[-2]
        assert gw.metrics.upstream_errors.labels("a", "stream")._value.get() == 2


async def test_every_queue_full_sheds_with_the_policys_code_and_retry_after() -> None:
    """When every worker's waiting queue is at its `max_waiting`, the policy sheds: a 429
    whose code is the policy's reason (`shed_capped`) and whose Retry-After is its
    estimate (the report's 7.2 s queue, rounded up), not the gateway-wide default."""
    full = FakeWorker("a", DIGEST, load={"waiting_requests": 4, "max_waiting": 4, "est_queue_s": 7.2})
    async with fleet([full]) as (gw, url):
        await wait_until(lambda: gw.pool.workers["a"].view.max_waiting == 4, what="the load report")
        st, body, h = await _post(url, BODY)
        assert st == 429 and body["error"]["code"] == "shed_capped" and h["retry-after"] == "8"
        assert not full.completions
        assert gw.metrics.shed.labels("shed_capped")._value.get() == 1


async def test_a_connection_lost_before_the_first_chunk_is_retried_on_the_next_worker() -> None:
    """A worker that answers 200 and then drops the connection before any chunk has sent
    the client nothing: the request is retried on the next ranked worker and succeeds.
    Catches a lost connection treated as final (a 502) in the first-byte phase."""
    a, b = FakeWorker("a", DIGEST, die_after_chunks=0), FakeWorker("b", DIGEST)
    async with fleet([a, b]) as (gw, url):
        _cache(gw, "a", BODY["prompt"], 2)  # a is chosen first
        for stream in (False, True):
            async with aiohttp.ClientSession() as s, \
                    s.post(url + "/v1/completions", json={**BODY, "stream": stream}) as r:
                text = await r.text()
                assert r.status == 200 and r.headers["x-kvroute-worker"] == "b", text
                assert "error" not in text
        assert len(a.completions) == 2 and len(b.completions) == 2


async def test_the_client_gets_the_finish_reason_and_its_own_format() -> None:
    """A non-streaming answer carries the worker's finish reason (`length` here) and is
    JSON; a streamed one is an event stream whose last choice has it. Catches the finish
    reason dropped when the whole answer is built, or a stream sent as JSON."""
    async with fleet([FakeWorker("a", DIGEST)]) as (_gw, url):
        st, body, h = await _post(url, BODY)
        assert st == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["text"] == "t0 t1 " and h["content-type"].startswith("application/json")
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"


@dataclass
class QuietStartWorker(FakeWorker):
    """Streams a first chunk with no text (a token that decodes to nothing yet), then "x"."""

    async def _complete(self, req: dict[str, Any], reply: Any, send: Any, receive: Any, chat: bool) -> None:
        self.completions.append(req)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for text, finish in (("", None), ("x", "stop")):
            chunk = {"id": "x", "object": "text_completion", "created": 0, "model": self.model,
                     "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
            await asyncio.sleep(0.1)  # the empty chunk arrives alone, as the gateway's first read
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def test_a_first_chunk_without_text_is_not_an_error() -> None:
    """A first chunk carrying no text (nor an error) is a normal start: the answer is the
    text that follows. Catches "no text yet" taken for a failed first chunk."""
    async with fleet([QuietStartWorker("a", DIGEST)], _cfg(routing={"policy": "kv_cost", "retries": 0})) as (_gw, url):
        st, body, _ = await _post(url, BODY)
        assert st == 200, body
        assert body["choices"][0]["text"] == "x" and body["choices"][0]["finish_reason"] == "stop"


async def test_a_reload_applies_the_worker_list_and_names_what_needs_a_restart() -> None:
    """`Gateway.reload` (SIGHUP, tested in-process here): the new worker list applies at
    once (added and removed workers in the answer), the sections that changed otherwise
    are listed as needing a restart and do not apply; the running config keeps its
    routing section and takes the new workers."""
    a, b = FakeWorker("a", DIGEST), FakeWorker("b", DIGEST)
    async with fleet([a]) as (gw, url), serve_fake(b):
        new = _cfg(routing={"policy": "round_robin", "retries": 1})
        new.workers = [WorkerConfig(id="b", url=b.url, model=MODEL)]
        diff = await gw.reload(new)
        assert (diff["added"], diff["removed"], diff["restart_needed"]) == (["b"], ["a"], ["routing"])
        assert sorted(gw.pool.workers) == ["b"] and [w.id for w in gw.cfg.workers] == ["b"]
        assert gw.cfg.routing.policy == "kv_cost" and gw.policy_name == "kv_cost"
        await wait_until(lambda: [w.id for w in gw.pool.routable(MODEL)] == ["b"], what="b registered")
        st, _body, h = await _post(url, BODY)
        assert st == 200 and h["x-kvroute-worker"] == "b"
        diff = await gw.reload(gw.cfg.model_copy())  # nothing changed: nothing to say
        assert (diff["added"], diff["removed"], diff["restart_needed"]) == ([], [], [])


@pytest.mark.parametrize(("status", "retried"), [(408, True), (429, True), (503, True), (500, True), (400, False),
                                                 (409, False)])
async def test_which_worker_statuses_are_retried_on_the_next_worker(status: int, retried: bool) -> None:
    """Before its first byte a worker's 408, 429, 503 or any 5xx sends the request to the
    next ranked worker; another 4xx is the client's fault and is relayed (as a 400).
    Catches a retryable status dropped from (or another added to) the list."""
    a, b = FakeWorker("a", DIGEST, fail_status=status), FakeWorker("b", DIGEST)
    async with fleet([a, b]) as (gw, url):
        _cache(gw, "a", BODY["prompt"], 2)  # a is chosen first
        st, _body, h = await _post(url, BODY)
        assert len(a.completions) == 1
        if retried:
            assert st == 200 and h["x-kvroute-worker"] == "b"
        else:
            assert st == 400 and not b.completions


async def test_answers_carry_openai_ids_and_each_served_request_counts_once() -> None:
    """Completion ids start `cmpl-`, chat ids `chatcmpl-` (as OpenAI's; clients key on
    them), and each request a worker served adds one to its `served` count (the admin
    view's). Catches a changed id prefix or a served count that does not add up."""
    async with fleet([FakeWorker("a", DIGEST)]) as (gw, url):
        ids = []
        for _ in range(2):
            st, body, _ = await _post(url, BODY)
            assert st == 200
            ids.append(body["id"])
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
            chat = await r.json()
        assert all(i.startswith("cmpl-") for i in ids) and ids[0] != ids[1]
        assert chat["id"].startswith("chatcmpl-")
        assert gw.pool.workers["a"].served == 3 and gw.pool.workers["a"].summary()["served"] == 3


@pytest.mark.parametrize("revise", [True, False])
async def test_a_later_dispatch_revises_the_prediction_sent_back_and_logged(request_log: Any, revise: bool) -> None:
    """Each dispatch runs the worker's `revise_ahead` (routing.revise_predictions): what it
    adds to an earlier request's ticket reaches that request's predicted-TTFT header (sent
    with its first token) and its log line; the prediction as first made is logged beside
    it. Here the second request is made to delay the first by one second. Catches the
    revision not run, not read, or run with the switch off."""
    from router.planner.fleet import FleetWorker

    a = FakeWorker("a", DIGEST, first_delay_s=0.4)
    calls: list[int] = []
    real = FleetWorker.revise_ahead

    def delay_the_first(self: FleetWorker, est: Any, now: float, knobs: Any) -> list[Any]:
        calls.append(len(self.ledger.live))
        out = real(self, est, now, knobs)
        for t in self.ledger.live:  # the request in flight
            t.revised_s += 1.0
        return out

    cfg = _cfg(routing={"policy": "kv_cost", "retries": 0, "revise_predictions": revise})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FleetWorker, "revise_ahead", delay_the_first)
        async with fleet([a], cfg) as (gw, url):
            first = asyncio.ensure_future(_post(url, BODY))
            w = gw.pool.workers["a"]
            await wait_until(lambda: len(w.inflight) == 1, what="first request in flight")
            st2, _b2, h2 = await _post(url, {**BODY, "prompt": list(range(300, 340))})
            st1, _b1, h1 = await first
    assert st1 == st2 == 200
    assert calls == ([0, 1] if revise else [])
    p1, p2 = float(h1["x-kvroute-predicted-ttft-ms"]), float(h2["x-kvroute-predicted-ttft-ms"])
    assert (p1 > 1000.0) is revise and p2 < 1000.0
    logged = sorted((r.kv for r in request_log), key=lambda kv: kv["predicted_revised_ttft_ms"])
    assert logged[-1]["predicted_revised_ttft_ms"] == pytest.approx(
        logged[-1]["predicted_ttft_ms"] + (1000.0 if revise else 0.0), abs=0.02)
