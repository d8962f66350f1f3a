"""A prefill/decode pair in the simulation, served in two legs as the gateway serves it
(router/upstream/pair.py): the prompt on the prefill worker with max_tokens 1, then the
decode worker pulling its KV over its PEER link and answering. Split from simulate.py,
whose event loop calls these with the running Simulation."""
from __future__ import annotations

from typing import TYPE_CHECKING

from workers.sim import SimRequest
from workers.sim.engine import BadRequest, PrefetchQueueFull, QueueFull, Usage

if TYPE_CHECKING:
    from .simulate import Simulation, _Pending

_PD_TRANSFER_DEADLINE_S = 60.0  # a decode worker's pull of the prompt's KV gives up after this



def prefill_leg(self: Simulation, p: _Pending, now: float) -> None:
    """A pair decision: the prompt goes to the prefill worker with max_tokens 1 (as vLLM's
    prefill servers are driven); when it finishes, the decode worker pulls the prompt's
    KV from it over its PEER link (`_decode_leg`). The HTTP path's send delay is not
    modelled for either leg."""
    a = p.routed
    assert a is not None and a.d.pd is not None and a.d.prefill_worker_id is not None
    pw, dw = a.d.prefill_worker_id, a.d.worker_id
    assert dw is not None
    if pw not in self.router.workers or dw not in self.router.workers:
        return self._fail(p, now, 503, "pair worker gone", "shed")
    req, terms = p.req, a.d.pd.chosen.terms
    p.prefill_worker, p.worker = pw, dw
    p.predicted = p.predicted_at_dispatch = a.d.predicted_ttft
    est_p = self.router.estimate_for(a.d, pw)
    rec = self.router.dispatched(pw, int(terms["prefill_recompute_tokens"]), req.input_length + 1, now, est_p)
    pred_p = terms["prefill_ttft"]

    def first(t: float, u: Usage) -> None:
        self.router.first_token(rec)
        self.router.observe(pw, pred_p, t - rec.t_dispatch, u.to_dict()["kv"])

    def finish(t: float, u: Usage) -> None:
        self.router.finished(rec)
        if self._pending.get(p.rid) is p:
            decode_leg(self, p, t)

    def error(t: float, msg: str) -> None:
        self.router.finished(rec)
        if self._pending.get(p.rid) is p:
            self._fail(p, t, 500, msg)

    sreq = SimRequest(p.rid + "/prefill", req.input_length, 1, keys=a.keys, token_ids=a.tokens,
                      cache_salt=req.cache_salt, lora=req.lora,
                      on_first_token=first, on_finish=finish, on_error=error)
    try:
        self.router.workers[pw].engine.submit(sreq, now)
    except (QueueFull, BadRequest) as e:
        self.router.finished(rec)
        self._reschedule(pw)
        return self._fail(p, now, e.status if isinstance(e, BadRequest) else 429, f"prefill {pw}: {e.message}")
    self.router.accepted(rec, now)
    self._reschedule(pw)

def decode_leg(self: Simulation, p: _Pending, now: float) -> None:
    """The prefill worker is done: the decode worker pulls the prompt's full blocks from
    it (a prefetch over its PEER link, serialised with its other transfers), and the
    request is submitted there at once; the engine waits for the blocks in flight as for
    any load. The client's first token is the decode worker's."""
    a, pw, dw = p.routed, p.prefill_worker, p.worker
    assert a is not None and pw is not None and dw is not None
    src, dst = self.router.workers.get(pw), self.router.workers.get(dw)
    if dst is None:
        return self._fail(p, now, 0, f"worker {dw} failed")
    if src is not None and a.keys:
        try:
            self.counters["pd_transfer_blocks"] += dst.engine.prefetch(
                a.keys, now, now + _PD_TRANSFER_DEADLINE_S, "x-" + p.rid, src.engine)
        except (PrefetchQueueFull, BadRequest):  # no transfer: the decode worker recomputes
            self.counters["pd_transfer_refused"] += 1
    req = p.req
    tail = a.d.recompute_tokens if a.d.recompute_tokens is not None else req.input_length
    rec = dst.fleet.dispatched(now, tail, req.input_length + req.output_length, None)
    p.rec = rec
    self._by_ticket[rec] = p
    if not self._submit(p, now):
        self._fail(p, now, 429, a.last_err or f"decode worker {dw} refused")

