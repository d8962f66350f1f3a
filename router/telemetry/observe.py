"""After a request: metrics, the planner's calibration, prefetch use, key fidelity.

Both relays hand their `Result` here, so a request is measured the same way whether
our worker or a vLLM server answered it. What a worker reports (`usage`, and on our
workers the `kv` timings) is compared with what the gateway predicted.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from kvindex.index import PrefixMatch

from ..fleet.worker import PASS_THROUGH_KINDS, Worker
from ..planner.speedfit import Sample
from ..planner.types import Policy
from ..upstream.attempt import Attempt, Result
from ..upstream.prefetch import Prefetch
from .fidelity import KeyFidelity
from .fidelity import Sample as FidelitySample
from .metrics import GatewayMetrics
from .recorder import TraceRecorder
from .tracing import RequestTracer

log = logging.getLogger("kvroute.observe")
access = logging.getLogger("kvroute.request")


class Observer:
    def __init__(self, policy: Policy, metrics: GatewayMetrics, recorder: TraceRecorder | None,
                 fidelity: KeyFidelity, request_log: bool = False, tracer: RequestTracer | None = None,
                 policy_name: str = "") -> None:
        """`request_log`: one log line per request; `tracer`: a span per request (None: no traces)."""
        self.policy = policy
        self.metrics = metrics
        self.recorder = recorder
        self.fidelity = fidelity
        self.request_log = request_log
        self.tracer = tracer
        self.policy_name = policy_name

    def done(self, a: Attempt, res: Result, ok: bool) -> None:
        """Metrics, calibration, prefetch and fidelity accounting once the request is over."""
        prep, w = a.prep, a.worker
        m = self.metrics
        model = prep.model.id
        if res.t_first is not None:
            m.child(m.ttft, model).observe(res.t_first - prep.t_arrival)
        m.child(m.e2e, model).observe(time.monotonic() - prep.t_arrival)
        ct = res.completion_tokens
        if res.t_first is not None and ct > 1 and res.t_last > res.t_first:
            m.child(m.tpot, model).observe((res.t_last - res.t_first) / (ct - 1))
        m.child(m.prompt_tokens, model).inc(len(prep.ids))
        if res.cached_tokens is not None:
            m.child(m.cached_tokens, model).inc(res.cached_tokens)
        usage = res.usage or {}
        kv = usage.get("kv") if isinstance(usage.get("kv"), dict) else None
        match = a.rr.matches.get(w.id)
        if match is not None:
            for tier, n in match.per_tier().items():
                m.child(m.matched_tokens, tier.name).inc(n * prep.model.block_size)
        if res.t_first is not None:
            self._calibrate(a, res.t_first, kv)
            if ok:
                self._speed_sample(a, res)
        if a.prefetch is not None:
            self._prefetch_outcome(a.prefetch, w, kv)
        if ok:
            self._fidelity(a, res, match)
        if self.recorder is not None and ok:
            self.recorder.record(prep.t_arrival, prep.ids, prep.plan.scoped, ct)
        logged = self.request_log and access.isEnabledFor(logging.INFO)
        if logged or self.tracer is not None:
            kv = self._record(a, res, ok)
            if logged:
                access.info("request done" if ok else "request failed", extra={"kv": kv})
            if self.tracer is not None:
                self.tracer.request(prep.t_arrival, ok, kv)

    def _record(self, a: Attempt, res: Result, ok: bool) -> dict[str, Any]:
        """What the request log line and the trace span say about one request."""
        prep = a.prep
        ms = 1000.0
        revised = a.predicted_ttft()
        return {
            "request_id": prep.request_id, "response_id": prep.rid, "tenant": prep.tenant.id,
            "model": prep.model.id, "worker": a.worker.id, "policy": self.policy_name, "reason": a.reason,
            "tries": a.tries, "ok": ok, "stream": prep.stream,
            "prompt_tokens": len(prep.ids), "cached_tokens": res.cached_tokens,
            "completion_tokens": res.completion_tokens,
            "ttft_ms": None if res.t_first is None else round((res.t_first - prep.t_arrival) * ms, 2),
            "worker_ttft_ms": None if res.t_first is None else round((res.t_first - a.t_dispatch) * ms, 2),
            "predicted_ttft_ms": None if a.predicted is None else round(a.predicted * ms, 2),
            "predicted_revised_ttft_ms": None if revised is None else round(revised * ms, 2),
            "e2e_ms": round((time.monotonic() - prep.t_arrival) * ms, 2),
            "routing_ms": round((a.t_dispatch - prep.t_arrival) * ms, 3),
        }

    def _calibrate(self, a: Attempt, t_first: float, kv: dict[str, Any] | None) -> None:
        # The model predicts from dispatch on (queue + load + prefill); compare like with like.
        m, w, predicted = self.metrics, a.worker, a.predicted_ttft()
        measured = t_first - a.t_dispatch
        if predicted is not None and predicted > 0:
            m.child(m.ttft_ratio, w.id).observe(measured / predicted)
            m.child(m.ttft_abs_err, w.id).observe(abs(measured - predicted))
        try:
            self.policy.observe(w.id, predicted, measured, kv)
        except Exception:  # calibration must never fail a request
            log.exception("policy.observe failed")

    @staticmethod
    def _speed_sample(a: Attempt, res: Result) -> None:
        """A request that loaded nothing from below GPU measures its worker's speed, and with
        the queue predicted for it, how the worker's real wait follows that prediction
        (router/planner/speedfit.py)."""
        t = a.rec.ticket
        if t.ready_at is not None or res.cached_tokens is None or res.t_first is None:
            return
        if not t.clean and t.queue_s <= 0.0:
            return  # something was ahead that the model gave no wait: no term to measure it by
        n = res.prompt_tokens or len(a.prep.ids)
        queue = 0.0 if t.clean else t.queue_s
        a.worker.fleet.speed_sample(Sample(n - res.cached_tokens, res.cached_tokens, t.running,
                                           res.t_first - a.t_dispatch, queue))

    def _prefetch_outcome(self, pf: Prefetch, w: Worker, kv: dict[str, Any] | None) -> None:
        m = self.metrics
        used = kv.get("prefetched_tokens", 0) if kv else 0
        used = used if isinstance(used, int) else 0
        wasted = max(0, pf.requested_tokens - used)
        m.prefetch_used_tokens.inc(min(used, pf.requested_tokens))
        if wasted:
            m.prefetch_wasted_tokens.inc(wasted)
            cost = w.view.cost
            m.prefetch_wasted_bytes.inc(wasted * cost.block_bytes // max(1, cost.block_size))

    def _fidelity(self, a: Attempt, res: Result, match: PrefixMatch | None) -> None:
        """Compare the worker's token counts with the gateway's keys (router/telemetry/fidelity.py)."""
        theirs = res.prompt_tokens
        if theirs is None:
            return
        w, n = a.worker, len(a.prep.ids)
        # a difference under one worker block, or one index block for an engine with smaller
        # pages (SGLang caches any prefix, the index whole blocks), is rounding, not drift
        sample = FidelitySample(theirs - n, None, max(w.block_size, a.prep.model.block_size, 1))
        if w.kind in PASS_THROUGH_KINDS and res.cached_tokens is not None:
            bs = a.prep.model.block_size
            sample.cached_diff = res.cached_tokens - predicted_cached_tokens(match, bs, w.block_size, n)
            if sample.cached_diff >= sample.cached_tolerance:
                # More cached than predicted: a concurrent request's blocks whose events had
                # not arrived when this one was routed. Only the index as it is now, with
                # those events in, can tell event lag from a worker keyed differently.
                sample.cached_diff = min(sample.cached_diff, res.cached_tokens - predicted_cached_tokens(
                    self._match_now(a), bs, w.block_size, n))
        m = self.metrics
        if sample.prompt_diff:
            m.child(m.key_prompt_mismatch, w.id).inc()
        if sample.cached_diff is not None:
            m.child(m.key_cached_drift, w.id).observe(abs(sample.cached_diff))
        self.fidelity.record(w.id, sample)

    @staticmethod
    def _match_now(a: Attempt) -> PrefixMatch | None:
        """The index's match for this request's prompt on its worker at this moment."""
        plan, w = a.prep.plan, a.worker
        digests = plan.vllm_digests if plan.vllm_digests is not None else plan.digests
        cap = (len(a.prep.ids) - 1) // a.prep.model.block_size
        return a.prep.model.index.match(digests, (w.id,), include_draining=True, max_blocks=cap).get(w.id)


def predicted_cached_tokens(match: PrefixMatch | None, index_block: int, worker_block: int, prompt_tokens: int) -> int:
    """Tokens a vLLM or SGLang worker should report cached for this prompt, per the index: its leading
    matched blocks in whole engine blocks, and never the last prompt token (an engine
    always computes at least that one)."""
    if match is None or worker_block <= 0:
        return 0
    tokens = match.blocks * index_block
    usable = (prompt_tokens - 1) // worker_block * worker_block
    return min(tokens // worker_block * worker_block, usable)
