"""The request pipeline: auth → validate → tokenize → keys → route → prefetch → proxy → observe.

`Gateway` owns everything a request touches (models with their tokenizers, hashers and
indexes; the worker pool; the policy; the pooled HTTP session; metrics; the trace
recorder) and exposes the endpoints' logic, independent of the ASGI plumbing in
router/app.py (which supplies an `Out` to write the response to).

Every request ends with a response or an explicit error: `ApiError`s become OpenAI
error bodies; a worker failing before its first chunk is replaced once by the next
best (Decision.ranked); after the first chunk the client gets an SSE error event and
[DONE] (streaming) or a 502 (non-streaming: nothing was sent yet); a client that goes
away cancels the handler, which closes the upstream connection (the worker cancels the
request) and cancels the request's prefetch.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
import time
from array import array
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec
from prometheus_client.core import GaugeMetricFamily
from yarl import URL

from kvindex.tiers import Tier

from .config import Config
from .errors import ApiError, bad_request, model_not_found, rate_limited, unavailable, upstream_failed
from .ingest_adapter import PoolIngest
from .metrics import GatewayMetrics
from .model import KeyPlan, ModelRuntime, ModelTable
from .planner.explain import explain as explain_decision
from .planner.registry import make_policy, policy_params
from .planner.types import Decision, Estimate, RouteRequest
from .pool import Inflight, State, Worker, WorkerPool
from .proxy import UpstreamError, open_stream
from .recorder import TraceRecorder
from .responses import (
    SSE_DONE,
    chat_chunk,
    chat_first_chunk,
    chat_response,
    client_usage,
    comp_chunk,
    comp_response,
    sse_error,
    usage_chunk,
)
from .schema import (
    ChatRequest,
    CompletionRequest,
    decode_chat,
    decode_completion,
    requested_max_tokens,
    up_chunk_decoder,
    validate_chat,
    validate_completion,
)
from .tenancy import Tenancy, Tenant
from .tokenize import Tokenization, Tokenizer, TokenizerError

log = logging.getLogger("kvroute.gateway")
_enc = msgspec.json.Encoder()
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]


class Out(Protocol):
    """Where a response goes (the ASGI send, in router/app.py)."""

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    async def body(self, data: bytes, more: bool = False) -> None: ...


@dataclass(slots=True)
class Prepared:
    """A validated, tokenized, keyed request, ready to route."""

    rid: str
    chat: bool
    tenant: Tenant
    model: ModelRuntime
    model_name: str  # as the client asked
    ids: array
    plan: KeyPlan
    max_tokens: int
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]
    cache_salt: str | None
    t_arrival: float
    created: int


@dataclass(slots=True)
class Prefetch:
    """One /kv/prefetch sent for a request (cancelled if the request never uses it)."""

    pid: str
    worker: Worker
    requested_tokens: int
    peer: bool = False  # raises blocks from another worker (source_peer)
    task: asyncio.Task[bool] | None = None
    accepted: bool = False


@dataclass(slots=True)
class _Result:
    text: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    chunks: int = 0
    t_first: float = 0.0
    t_last: float = 0.0


class Gateway:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.metrics = GatewayMetrics()
        self.tenancy = Tenancy(cfg)
        self.models = ModelTable()
        toks: dict[str, Tokenizer] = {}
        for m in cfg.models:
            key = str(m.tokenizer.resolve())
            tok = toks.get(key)
            if tok is None:
                tok = toks[key] = Tokenizer(m.tokenizer)
            self.models.add(ModelRuntime(m, tok))
        for sp in cfg.shared_prefixes:
            for rt in self.models.by_id.values():
                if sp.model is None or self.models.get(sp.model) is rt:
                    rt.add_shared_prefix(sp)
        params = dict(cfg.routing.params)
        if cfg.routing.max_ttft_s is not None and "max_ttft_s" in policy_params(cfg.routing.policy):
            params.setdefault("max_ttft_s", cfg.routing.max_ttft_s)
        self.policy = make_policy(cfg.routing.policy, **params)
        self.policy_name = cfg.routing.policy
        self.tokenization = Tokenization()
        # request ids: unique, not secret; seeded once so a request costs no getrandom syscall
        self._rid_rng = random.Random(os.urandom(16))
        tr = cfg.observability.trace
        self.recorder = TraceRecorder(tr.path, tr.salt, tr.block_tokens, tr.max_ids) if tr.enabled else None
        self.session: aiohttp.ClientSession | None = None
        self.pool: WorkerPool | None = None
        self.ingest: PoolIngest | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self._upstream_timeout = aiohttp.ClientTimeout(
            total=cfg.pool.request_timeout_s, connect=cfg.pool.connect_timeout_s
        )
        self._prefetch_timeout = aiohttp.ClientTimeout(total=2.0, connect=cfg.pool.connect_timeout_s)
        self.metrics.add_state_collector(self._collect_state)
        self.started = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if not self.cfg.admin_token and not self.tenancy.auth_enabled:
            log.warning("no admin_token and no tenants: the admin API is open to anyone who can reach %s:%d",
                        self.cfg.listen.host, self.cfg.listen.port)

        conn = aiohttp.TCPConnector(
            limit=self.cfg.pool.max_connections, limit_per_host=0, keepalive_timeout=30.0, enable_cleanup_closed=True
        )
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        self.ingest = PoolIngest()
        self.pool = WorkerPool(
            self.cfg.pool,
            dict(self.models.by_id),
            self.session,
            ingest=self.ingest,
            worker_max_inflight=self.cfg.limits.worker_max_inflight,
            on_state=self._on_worker_state,
            on_refused=lambda w, code: self.metrics.worker_refused.labels(w.id, code).inc(),
        )
        for wc in self.cfg.workers:
            self.pool.add(wc)
        self.started = True

    async def close(self) -> None:
        for t in list(self._bg):
            t.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        if self.pool is not None:
            await self.pool.close()
        if self.ingest is not None:
            await self.ingest.close()
        if self.session is not None:
            await self.session.close()
        self.tokenization.close()
        if self.recorder is not None:
            self.recorder.close()

    def _on_worker_state(self, w: Worker, state: State) -> None:
        self.metrics.child(self.metrics.worker_transitions, w.id, state.value).inc()
        if state is State.UNHEALTHY:
            self.policy_forget(w.id)

    def policy_forget(self, worker_id: str) -> None:
        cal = getattr(self.policy, "calibrator", None)
        if cal is not None and hasattr(cal, "forget"):
            cal.forget(worker_id)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        return t

    def ready(self) -> tuple[bool, dict[str, Any]]:
        assert self.pool is not None
        per_model = {m: len(self.pool.routable(m)) for m in self.models.by_id}
        return all(per_model.values()), {"healthy_workers": per_model, "tokenizers_loaded": True}

    # ------------------------------------------------------------------ prepare

    async def prepare(self, chat: bool, body: bytes, headers: Mapping[str, str], tenant: Tenant | None = None) -> Prepared:
        t0 = time.monotonic()
        if tenant is None:
            tenant = self.tenancy.authenticate(headers)
        lim = self.cfg.limits
        req: ChatRequest | CompletionRequest
        if chat:
            req = decode_chat(body)
            model = self.models.get(req.model)
            msgs = validate_chat(req, lim.max_stop_sequences, lim.max_messages)
            if model is None:
                raise model_not_found(req.model)
        else:
            req = decode_completion(body)
            model = self.models.get(req.model)
            if model is None:
                raise model_not_found(req.model)
            prompt = validate_completion(req, lim.max_stop_sequences, model.tokenizer.vocab_size)
        tok = model.tokenizer
        tt = time.perf_counter()
        try:
            if chat:
                text = tok.render_chat(msgs)
                ids = await self.tokenization.encode_text(tok, text, False)
            elif isinstance(prompt, str):
                ids = await self.tokenization.encode_text(tok, prompt, True)
            else:
                ids = prompt
        except TokenizerError as e:
            raise bad_request(str(e), "messages" if chat else "prompt") from None
        self.metrics.child(self.metrics.tokenize, model.id).observe(time.perf_counter() - tt)
        n = len(ids)
        ctx = model.max_context
        max_prompt = min(lim.max_prompt_tokens or ctx, ctx)
        if n == 0:
            raise bad_request("The prompt is empty after tokenization.", "prompt")
        if n >= max_prompt:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens and prompts are limited to "
                f"{max_prompt - 1} tokens; your prompt has {n} tokens.",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        mt = requested_max_tokens(req)
        if mt is None:
            mt = min(lim.default_max_tokens, ctx - n)
        elif n + mt > ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens. However, you requested {n + mt} tokens "
                f"({n} in the prompt, {mt} for the completion). Please reduce the prompt or the completion length.",
                "max_tokens",
                "context_length_exceeded",
            )
        plan = model.key_plan(ids, tenant.salt, req.cache_salt)
        sampling: dict[str, Any] = {}
        for k in ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "ignore_eos"):
            v = getattr(req, k)
            if v is not None:
                sampling[k] = v
        include_usage = bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
        rid = ("chatcmpl-" if chat else "cmpl-") + "%024x" % self._rid_rng.getrandbits(96)
        return Prepared(
            rid, chat, tenant, model, req.model, ids, plan, mt, req.stream, include_usage, sampling,
            req.cache_salt, t0, int(time.time()),
        )

    # ------------------------------------------------------------------ route

    def _candidates(self, model: ModelRuntime) -> list[Worker]:
        assert self.pool is not None
        workers = self.pool.routable(model.id)
        if not workers:
            self.metrics.child(self.metrics.shed, "no_healthy_worker").inc()
            raise unavailable(f"No healthy worker serves model {model.id!r} right now.", 1.0)
        open_ = [w for w in workers if w.max_inflight is None or len(w.inflight) < w.max_inflight]
        if not open_:
            self.metrics.child(self.metrics.shed, "worker_caps").inc()
            raise rate_limited("Every worker of this model is at its in-flight cap.", self.cfg.routing.default_retry_after_s, "worker_caps")
        return open_

    def _route_request(self, prep: Prepared, workers: list[Worker]) -> RouteRequest:
        model = prep.model
        now = time.monotonic()
        assert self.pool is not None
        self.pool.refresh_ages(workers, now)
        plan = prep.plan
        matches = model.index.match(plan.digests)
        if plan.vllm_digests is not None:
            vids = [w.id for w in workers if w.kind == "vllm"]
            if vids:
                matches.update(model.index.match(plan.vllm_digests, vids))
        return RouteRequest(len(prep.ids), plan.digests, matches, prep.max_tokens, now, prep.rid)

    def decide(self, prep: Prepared) -> tuple[Decision, RouteRequest]:
        workers = self._candidates(prep.model)
        rr = self._route_request(prep, workers)
        t = time.perf_counter()
        d = self.policy.choose(rr, [w.view for w in workers])
        m = self.metrics
        m.child(m.decision, self.policy_name).observe(time.perf_counter() - t)
        m.child(m.choices, self.policy_name, d.reason).inc()
        return d, rr

    def explain(self, prep: Prepared) -> dict[str, Any]:
        """What routing would do for this request now (nothing is sent, nothing changes)."""
        workers = self._candidates(prep.model)
        rr = self._route_request(prep, workers)
        d = explain_decision(self.policy, rr, [w.view for w in workers])
        bs = prep.model.block_size
        return {
            "model": prep.model.id,
            "policy": self.policy_name,
            "prompt_tokens": len(prep.ids),
            "full_blocks": len(prep.plan.digests),
            "block_size": bs,
            "shared_prefix_blocks": prep.plan.shared_blocks,
            "salted": prep.plan.wire_salt is not None,
            "decision": {
                "worker_id": d.worker_id,
                "reason": d.reason,
                "predicted_ttft_s": d.predicted_ttft,
                "prefetch_blocks": d.prefetch_blocks,
                "prefetch_from_peer": d.prefetch_from_peer,
                "ranked": d.ranked,
                "retry_after_s": d.retry_after_s,
            },
            "matches": {wid: {"blocks": m.blocks, "runs": [[t.name, n] for t, n in m.runs]} for wid, m in rr.matches.items()},
            "workers": [_estimate_dict(e) for e in d.estimates],
        }

    # ------------------------------------------------------------------ serve

    async def complete(self, prep: Prepared, out: Out) -> int:
        """Route and proxy one prepared request; returns the HTTP status sent."""
        self.tenancy.acquire(prep.tenant)
        try:
            return await self._dispatch(prep, out)
        finally:
            self.tenancy.release(prep.tenant)
            self.tenancy.remember_salt(prep.tenant, prep.cache_salt)

    async def _dispatch(self, prep: Prepared, out: Out) -> int:
        assert self.pool is not None
        m = self.metrics
        d, rr = self.decide(prep)
        if d.worker_id is None:
            m.child(m.shed, d.reason).inc()
            retry = d.retry_after_s or self.cfg.routing.default_retry_after_s
            if d.reason == "no_workers":
                raise unavailable("No eligible worker for this request.", retry)
            raise rate_limited(f"All workers are too busy for this request ({d.reason}); retry later.", retry, d.reason)
        order = [d.worker_id] + [w for w in d.ranked if w != d.worker_id][: self.cfg.routing.retries]
        estimates = {e.worker_id: e for e in d.estimates} if d.estimates else {}
        last: UpstreamError | None = None
        tried = 0
        for wid in order:
            w = self.pool.workers.get(wid)
            if w is None or w.state is not State.HEALTHY:
                continue
            if tried >= 1 + self.cfg.routing.retries:
                break
            if tried:
                m.child(m.retries, "before_first_byte").inc()
            tried += 1
            est = estimates.get(wid)
            predicted = d.predicted_ttft if wid == d.worker_id else (est.t_ttft if est else None)
            pf = self._send_prefetch(prep, d, w, rr, est) if wid == d.worker_id else None
            prefill = est.recompute_tokens if est is not None and est.eligible else len(prep.ids)
            rec = self.pool.dispatched(w, prefill, len(prep.ids) + prep.max_tokens, est)
            try:
                if pf is not None and pf.task is not None:
                    if pf.peer:
                        # A peer pull is known to the worker only through the prefetch: let
                        # it be accepted first (never wait long).
                        await asyncio.wait({pf.task}, timeout=self.cfg.routing.prefetch.ack_timeout_s)
                    else:
                        # Local tiers: one loop turn puts the prefetch on the wire before the
                        # request; waiting for its 202 would only add a round trip to TTFT.
                        await asyncio.sleep(0)
                return await self._proxy(prep, w, rec, out, predicted, pf, rr)
            except asyncio.CancelledError:  # the client left
                self.metrics.disconnects.inc()
                if not rec.prefilled:
                    self._cancel_prefetch(pf)
                raise
            except UpstreamError as e:
                m.child(m.upstream_errors, w.id, e.phase).inc()
                self._cancel_prefetch(pf)
                if e.phase != "status" or e.fatal:
                    self.pool.report_failure(w, str(e), e.fatal)
                if not e.retryable:
                    raise (e.api_error or upstream_failed(str(e))) from None
                last = e
                log.warning("request %s: worker %s failed before the first byte: %s", prep.rid, w.id, e)
            finally:
                self.pool.finished(rec)
        if last is not None and last.api_error is not None and last.api_error.status == 429:
            m.child(m.shed, "worker_429").inc()
            raise last.api_error
        if last is None:
            raise unavailable("No healthy worker could take this request.", 1.0)
        raise upstream_failed(f"The worker failed before answering and the retry failed too: {last}")

    def _upstream_payload(self, prep: Prepared, w: Worker) -> bytes:
        body: dict[str, Any] = {
            "model": (w.info or {}).get("model") or prep.model.id,
            "prompt": prep.ids.tolist(),
            "max_tokens": prep.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body.update(prep.sampling)
        salt = prep.plan.wire_salt
        if salt:
            body["cache_salt"] = salt
        if w.kind == "kvroute":
            body["kv"] = {"shared_prefix_blocks": prep.plan.shared_blocks, "request_id": prep.rid}
        return _enc.encode(body)

    async def _proxy(
        self, prep: Prepared, w: Worker, rec: Inflight, out: Out, predicted: float | None, pf: Prefetch | None, rr: RouteRequest
    ) -> int:
        assert self.session is not None and self.pool is not None
        t_dispatch = time.monotonic()
        url = w.completions_url
        if url is None:
            url = w.completions_url = URL(w.url + "/v1/completions")
        up = await open_stream(self.session, url, self._upstream_payload(prep, w), w.id, self._upstream_timeout)
        self.pool.accepted(rec)
        batches = up.batches()
        res = _Result()
        render = (chat_chunk if prep.chat else comp_chunk) if prep.stream else None
        try:
            try:
                first_batch = await batches.__anext__()
            except StopAsyncIteration:
                raise UpstreamError(f"worker {w.id} ended the stream without any chunk", True, phase="first") from None
            except UpstreamError as e:
                e.retryable, e.phase = True, "first"
                raise
            res.t_first = time.monotonic()
            self.pool.first_token(rec)
            w.served += 1
            err, parts = self._absorb(res, first_batch, prep, render)
            if err is not None and not res.text:
                raise UpstreamError(f"worker {w.id} sent an error: {err}", True, phase="first")
            ttft = res.t_first - prep.t_arrival
            m = self.metrics
            # which worker served, and what the planner expected (loadtest/replay.py reads these)
            route_hdrs = [(b"x-kvroute-worker", w.id.encode())]
            if predicted is not None:
                route_hdrs.append((b"x-kvroute-predicted-ttft-ms", b"%.3f" % (predicted * 1000)))
            # Fewest client writes (each socket send is a large share of a request's CPU
            # here): the batch that ends at [DONE] goes out with the usage chunk and [DONE]
            # in one write; a stream complete in its first read is headers + one write.
            hdrs = (SSE_HEADERS if prep.stream else JSON_HEADERS) + route_hdrs
            started = False
            if prep.stream:
                if prep.chat:
                    parts.insert(0, chat_first_chunk(prep.rid, prep.created, prep.model_name))
                if err is not None or not up.done:
                    await out.start(200, hdrs)
                    started = True
                    if parts:
                        await out.body(b"".join(parts), True)
                        parts = []
            try:
                if err is None:
                    async for batch in batches:
                        err, parts = self._absorb(res, batch, prep, render)
                        if err is not None:
                            break
                        if parts and not up.done:
                            await out.body(b"".join(parts), True)
                            parts = []
                if err is not None:
                    if parts:
                        await out.body(b"".join(parts), True)
                    raise UpstreamError(f"worker {w.id} reported an error mid-stream: {err}", False, phase="stream")
            except UpstreamError as e:
                m.child(m.upstream_errors, w.id, "stream").inc()
                log.warning("request %s: worker %s failed after the first byte: %s", prep.rid, w.id, e)
                if prep.stream:
                    if not started:
                        await out.start(200, hdrs)
                    await out.body(sse_error(str(e), "upstream_error", "worker_failed", prep.rid) + SSE_DONE)
                    self._finish(prep, w, res, predicted, ttft, pf, rr, False, t_dispatch)
                    return 200
                raise ApiError(502, f"The worker failed while generating: {e}", "upstream_error", None, "worker_failed") from None
            completion_tokens = _completion_tokens(res)
            usage = client_usage(res.usage, len(prep.ids), completion_tokens)
            if prep.stream:
                if prep.include_usage:
                    parts.append(usage_chunk(prep.chat, prep.rid, prep.created, prep.model_name, usage))
                parts.append(SSE_DONE)
                if not started:
                    await out.start(200, hdrs)
                await out.body(b"".join(parts))
            else:
                build = chat_response if prep.chat else comp_response
                payload = build(prep.rid, prep.created, prep.model_name, "".join(res.text), res.finish, usage)
                await out.start(200, hdrs)
                await out.body(payload)
            self._finish(prep, w, res, predicted, ttft, pf, rr, True, t_dispatch)
            return 200
        finally:
            up.close()

    def _absorb(self, res: _Result, batch: list[bytes], prep: Prepared, render: Any) -> tuple[str | None, list[bytes]]:
        """Fold upstream chunks into the result; returns (error message or None, client SSE parts).

        `render` (chat_chunk / comp_chunk, None for a non-streaming client) turns each
        choice into the client's chunk; the caller writes the parts in one go.
        """
        parts: list[bytes] = []
        now = time.monotonic()
        for data in batch:
            try:
                c = up_chunk_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return f"malformed chunk: {e}", parts
            if c.error is not None:
                return str(c.error.get("message") or c.error), parts
            res.chunks += 1
            res.t_last = now
            for ch in c.choices:
                if ch.text:
                    res.text.append(ch.text)
                if ch.finish_reason is not None:
                    res.finish = ch.finish_reason
                if render is not None and (ch.text or ch.finish_reason is not None):
                    parts.append(render(prep.rid, prep.created, prep.model_name, ch.text, ch.finish_reason))
            if c.usage is not None:
                res.usage = c.usage
        return None, parts

    def _finish(
        self,
        prep: Prepared,
        w: Worker,
        res: _Result,
        predicted: float | None,
        ttft: float,
        pf: Prefetch | None,
        rr: RouteRequest,
        ok: bool,
        t_dispatch: float,
    ) -> None:
        m = self.metrics
        model = prep.model.id
        now = time.monotonic()
        m.child(m.ttft, model).observe(ttft)
        m.child(m.e2e, model).observe(now - prep.t_arrival)
        ct = _completion_tokens(res)
        if ct > 1 and res.t_last > res.t_first:
            m.child(m.tpot, model).observe((res.t_last - res.t_first) / (ct - 1))
        m.child(m.prompt_tokens, model).inc(len(prep.ids))
        usage = res.usage or {}
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            m.child(m.cached_tokens, model).inc(details["cached_tokens"])
        kv = usage.get("kv") if isinstance(usage.get("kv"), dict) else None
        match = rr.matches.get(w.id)
        if match is not None:
            bs = prep.model.block_size
            for tier, n in match.per_tier().items():
                m.child(m.matched_tokens, tier.name).inc(n * bs)
        # The model predicts from dispatch on (queue + load + prefill); compare like with like.
        measured = res.t_first - t_dispatch
        if predicted is not None and predicted > 0:
            m.child(m.ttft_ratio, w.id).observe(measured / predicted)
            m.child(m.ttft_abs_err, w.id).observe(abs(measured - predicted))
        try:
            self.policy.observe(w.id, predicted, measured, kv)
        except Exception:  # calibration must never fail a request
            log.exception("policy.observe failed")
        if pf is not None:
            used = kv.get("prefetched_tokens", 0) if kv else 0
            used = used if isinstance(used, int) else 0
            wasted = max(0, pf.requested_tokens - used)
            m.prefetch_used_tokens.inc(min(used, pf.requested_tokens))
            if wasted:
                m.prefetch_wasted_tokens.inc(wasted)
                cost = w.view.cost
                m.prefetch_wasted_bytes.inc(wasted * cost.block_bytes // max(1, cost.block_size))
        if self.recorder is not None and ok:
            self.recorder.record(prep.t_arrival, prep.ids, prep.plan.scoped, ct)

    # ------------------------------------------------------------------ prefetch

    def _send_prefetch(self, prep: Prepared, d: Decision, w: Worker, rr: RouteRequest, est: Estimate | None) -> Prefetch | None:
        pc = self.cfg.routing.prefetch
        k = d.prefetch_blocks
        if not pc.enabled or k < pc.min_blocks or not w.view.supports_prefetch:
            return None
        match = rr.matches.get(w.id)
        start = 0
        if match is not None and match.runs and match.runs[0][0] is Tier.GPU:
            start = min(match.runs[0][1], k)
        if k - start < pc.min_blocks:
            return None
        keys = prep.plan.keys[start:k]
        queue_s = est.t_queue if est is not None else 0.0
        deadline_ms = int(1000 * max(pc.min_deadline_s, queue_s + pc.margin_s))
        body: dict[str, Any] = {
            "prefetch_id": "p-" + prep.rid,
            "keys_b64": base64.b64encode(b"".join(keys)).decode(),
            "deadline_ms": deadline_ms,
            "source_peer": None,
        }
        if d.prefetch_from_peer:
            assert self.pool is not None
            peer = self.pool.workers.get(d.prefetch_from_peer)
            if peer is not None:
                body["source_peer"] = {"url": peer.url, "worker_id": peer.id}
        pf = Prefetch(body["prefetch_id"], w, len(keys) * prep.model.block_size, body["source_peer"] is not None)
        pf.task = self._spawn(self._post_prefetch(pf, _enc.encode(body)))
        self.metrics.prefetch_sent.inc()
        self.metrics.prefetch_requested_tokens.inc(pf.requested_tokens)
        return pf

    async def _post_prefetch(self, pf: Prefetch, payload: bytes) -> bool:
        assert self.session is not None
        try:
            async with self.session.post(
                pf.worker.url + "/kv/prefetch", data=payload, headers={"content-type": "application/json"},
                timeout=self._prefetch_timeout,
            ) as r:
                await r.read()
                pf.accepted = r.status == 202 or r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pf.accepted = False
        if not pf.accepted:
            self.metrics.prefetch_failed.inc()
        return pf.accepted

    def _cancel_prefetch(self, pf: Prefetch | None) -> None:
        if pf is None:
            return
        self.metrics.prefetch_cancelled.inc()
        self._spawn(self._delete_prefetch(pf))

    async def _delete_prefetch(self, pf: Prefetch) -> None:
        assert self.session is not None
        if pf.task is not None and not pf.task.done():
            try:
                await asyncio.wait_for(asyncio.shield(pf.task), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass
        if not pf.accepted:
            return
        try:
            async with self.session.delete(pf.worker.url + "/kv/prefetch/" + pf.pid, timeout=self._prefetch_timeout) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass

    # ------------------------------------------------------------------ admin

    async def purge_tenant(self, tenant_id: str) -> dict[str, Any]:
        assert self.pool is not None and self.session is not None
        t = self.tenancy.tenants.get(tenant_id)
        if t is None:
            raise ApiError(404, f"Unknown tenant {tenant_id!r}.", "invalid_request_error", "tenant", "not_found")
        salts = self.tenancy.wire_salts(t)
        if not salts:
            raise bad_request(f"Tenant {tenant_id!r} has no isolation salt; there is nothing of its own to purge.")
        results: dict[str, Any] = {}

        async def one(w: Worker) -> None:
            total = 0
            errors = []
            for s in salts:
                try:
                    async with self.session.post(  # type: ignore[union-attr]
                        w.url + "/kv/purge", data=_enc.encode({"cache_salt": s}),
                        headers={"content-type": "application/json"}, timeout=self._prefetch_timeout,
                    ) as r:
                        body = await r.read()
                        if r.status == 200:
                            total += int(msgspec.json.decode(body).get("purged_blocks", 0))
                        else:
                            errors.append(f"HTTP {r.status}")
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, msgspec.DecodeError, AttributeError) as e:
                    errors.append(type(e).__name__)
            results[w.id] = {"purged_blocks": total, "errors": errors}

        targets = [w for w in self.pool.workers.values() if w.kind == "kvroute" and w.state in (State.HEALTHY, State.DRAINING)]
        await asyncio.gather(*(one(w) for w in targets))
        return {"tenant": tenant_id, "wire_salts": len(salts), "workers": results,
                "note": "request cache_salts unknown to this process (before its start or evicted) are not covered"}

    def index_stats(self) -> dict[str, Any]:
        out = {}
        for rt in self.models.by_id.values():
            out[rt.id] = {
                "blocks": len(rt.index),
                "entries": rt.index.entries(),
                "workers": [asdict(s) for s in rt.index.worker_stats()],
            }
        if self.ingest is not None:
            out["_ingest"] = self.ingest.health()
        return out

    def _collect_state(self) -> list[GaugeMetricFamily]:
        """Scrape-time gauges read from the live objects (nothing updates them per request)."""
        if self.pool is None:
            return []
        health = GaugeMetricFamily("kvroute_worker_healthy", "1 if the worker is routable", labels=["worker", "model"])
        state = GaugeMetricFamily("kvroute_worker_state", "Worker state (1 for its current state)", labels=["worker", "state"])
        inflight = GaugeMetricFamily("kvroute_worker_inflight", "Router-tracked in-flight requests", labels=["worker"])
        for w in self.pool.workers.values():
            health.add_metric([w.id, w.model.id], 1.0 if w.state is State.HEALTHY else 0.0)
            state.add_metric([w.id, w.state.value], 1.0)
            inflight.add_metric([w.id], float(len(w.inflight)))
        blocks = GaugeMetricFamily("kvroute_index_blocks", "Distinct blocks in the prefix index", labels=["model"])
        entries = GaugeMetricFamily("kvroute_index_entries", "(block, worker, tier) index entries", labels=["model"])
        for rt in self.models.by_id.values():
            blocks.add_metric([rt.id], float(len(rt.index)))
            entries.add_metric([rt.id], float(rt.index.entries()))
        fams = [health, state, inflight, blocks, entries]
        cache = GaugeMetricFamily("kvroute_tokenize_cache_tokens", "Tokens held by the prefix-tokenization cache", labels=["model"])
        hits = GaugeMetricFamily("kvroute_tokenize_cache_hit_tokens", "Tokens served from the tokenization cache", labels=["model"])
        for rt in self.models.by_id.values():
            cache.add_metric([rt.id], float(rt.tokenizer.cache.tokens))
            hits.add_metric([rt.id], float(rt.tokenizer.cache.stats.hit_tokens))
        fams += [cache, hits]
        if self.ingest is not None:
            fams += list(self.ingest.metric_families())
        return fams


def _completion_tokens(res: _Result) -> int:
    u = res.usage
    if u is not None and isinstance(u.get("completion_tokens"), int):
        return u["completion_tokens"]
    return res.chunks


def _estimate_dict(e: Estimate) -> dict[str, Any]:
    return {
        "worker_id": e.worker_id,
        "eligible": e.eligible,
        "note": e.note,
        "matched_blocks": {t.name: n for t, n in e.matched_blocks.items()},
        "load_blocks": e.load_blocks,
        "load_blocks_by_tier": {t.name: n for t, n in e.load_blocks_by_tier.items()},
        "prefetch_blocks": {t.name: n for t, n in e.prefetch_blocks.items()},
        "recompute_tokens": e.recompute_tokens,
        "t_queue_s": e.t_queue,
        "t_load_s": e.t_load,
        "t_load_total_s": e.t_load_total,
        "t_prefill_s": e.t_prefill,
        "t_ttft_s": e.t_ttft,
        "load": e.load,
        "peer_source": e.peer_source,
    }

