"""Prefill/decode disaggregation: pricing every way to serve a request, and the pair decision.

Workers have a role (`WorkerView.role`): "prefill", "decode" or "both". For a request
(`N` prompt tokens, `M` = max_tokens, `B` = block size) the options are:

* **single** — a `both` worker `w` serves it whole:
  `TTFT = T_ttft(w)` (cost.py: queue + load/recompute + prefill, with its decode ride).
* **pair** (P prefill-capable, D decode-capable, P != D) — P computes the prompt (and the
  first token, as a vLLM prefill server does with max_tokens 1), the KV of the prompt's
  full blocks moves to D, D admits it and produces the first token the client sees:
  `TTFT = T_ttft(P) + T_transfer(P->D, blocks D lacks) + T_queue(D) + T_tail(D)`, where
  `T_transfer` is terms/kv_transfer.py over the pair's link (D's PEER link, calibrated
  like every link), `T_queue(D)` is load.py's wait at D and `T_tail(D)` the prefill of the
  tokens past the last full block on D (its cached context the whole prompt), with the
  decode ride of D's running requests.
* **bypass** (D decode-role) — D's own cache holds enough of the prompt (some of its
  prefix, and it would recompute at most `bypass_max_tokens`): it prefills the rest itself, no remote
  prefill: `TTFT = T_ttft(D)`.

Every option's decode side costs `TPOT(D) = decode_step_s(D)`, the step time D last
reported for its running batch (fleet.apply_report; 0 when unreported), so
`score = TTFT + (M - 1) * TPOT(D)`: the predicted time to the last token. `pd_cost`
takes the argmin; `pd_round_robin` and `pd_prefix` choose otherwise and are priced by the
same functions (their predictions and explain stay comparable).

What is not priced: prefills that arrive at a `both` worker later, while this request
decodes there (they lengthen its steps); the sender side of a transfer (P's NIC).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

from kvindex.tiers import Tier

from .base import RETRY_MIN_S, PolicyBase, check_int
from .cost import RequestContext, estimate_worker
from .load import at_cap, outstanding_requests, queue_seconds
from .terms.cut import usable_blocks
from .terms.decode_ride import decode_ride_seconds, running_decodes
from .terms.kv_transfer import PairLinks, kv_transfer_bytes, kv_transfer_seconds, transfer_link
from .types import Decision, Estimate, PDDecision, PDOption, RouteRequest, WorkerView

ROLES = ("prefill", "decode", "both")
# Alternatives kept in the record: the best of each kind, then the next best overall.
ALTERNATIVES_KEPT = 5
# A decode worker may prefill this many tokens itself (the bypass) by default.
BYPASS_MAX_TOKENS = 2048

Scales = Callable[[str], tuple[float, Mapping[Tier, float] | None]]


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown worker role {role!r}; choose one of: {', '.join(ROLES)}")
    return role


def can_prefill(w: WorkerView) -> bool:
    return w.role != "decode"


def can_decode(w: WorkerView) -> bool:
    return w.role != "prefill"


def disaggregated(workers: Sequence[WorkerView]) -> bool:
    """Whether any worker has a role other than `both`."""
    return any(w.role != "both" for w in workers)


def decode_seconds_per_token(w: WorkerView) -> float:
    """D's expected time per output token: the decode step it last reported."""
    s = w.cost.decode_step_s
    return s if s > 0.0 and math.isfinite(s) else 0.0


def _score(ttft: float, tpot: float, max_tokens: int) -> float:
    return ttft + max(0, max_tokens - 1) * tpot


def price_single(e: Estimate, w: WorkerView, max_tokens: int, kind: str = "single") -> PDOption:
    """One worker for both phases (`single`), or a decode worker's own prefill (`bypass`)."""
    tpot = decode_seconds_per_token(w)
    terms = {"queue": e.t_queue, "load": e.t_load, "prefill": e.t_prefill,
             "recompute_tokens": float(e.recompute_tokens), "tpot": tpot}
    return PDOption(kind=kind, decode_worker=w.worker_id, t_ttft=e.t_ttft, t_tpot=tpot,
                    score=_score(e.t_ttft, tpot, max_tokens), terms=terms, note=e.note)


def price_pair(
    ctx: RequestContext, ep: Estimate, p: WorkerView, d: WorkerView, max_tokens: int, *,
    pair_links: PairLinks | None = None, link_scale: float = 1.0, prefill_scale_d: float = 1.0,
) -> PDOption:
    """Prefill on `p` (its estimate `ep`), KV of the blocks `d` lacks moved to `d`, first token on `d`."""
    c = d.cost
    B = c.block_size
    n = ctx.prompt_tokens
    moved_blocks = usable_blocks(n, ctx.n_blocks, B)
    m = ctx.matches.get(d.worker_id)
    held = 0
    if m is not None and m.runs and m.runs[0][0] is Tier.GPU:
        held = min(m.runs[0][1], moved_blocks)  # D's leading GPU run needs no transfer
    tokens = (moved_blocks - held) * B
    link = transfer_link(p, d, pair_links)
    t_tx = kv_transfer_seconds(tokens, c, link, link_scale)
    q_d = queue_seconds(d, c, prefill_scale_d)
    tail = max(1, n - moved_blocks * B)
    cached = n - tail
    t_tail = 0.0
    if c.prefill_tokens_per_s > 0.0:
        t_tail = (c.prefill_overhead_s + tail / c.prefill_tokens_per_s
                  + c.prefill_attn_s_per_token2 * tail * (cached + tail * 0.5)) * prefill_scale_d
        t_tail += decode_ride_seconds(c, tail, running_decodes(d))
    else:
        t_tail = math.inf
    tpot = decode_seconds_per_token(d)
    ttft = ep.t_ttft + t_tx + q_d + t_tail
    terms = {"prefill_queue": ep.t_queue, "prefill_load": ep.t_load, "prefill_compute": ep.t_prefill,
             "prefill_ttft": ep.t_ttft, "prefill_recompute_tokens": float(ep.recompute_tokens),
             "transfer": t_tx, "transfer_tokens": float(tokens), "transfer_bytes": kv_transfer_bytes(tokens, c),
             "decode_queue": q_d, "decode_tail": t_tail, "decode_tail_tokens": float(tail), "tpot": tpot}
    note = ep.note if ep.note else ("no link to move the KV over" if link is None else "")
    return PDOption(kind="pair", prefill_worker=p.worker_id, decode_worker=d.worker_id, t_ttft=ttft, t_tpot=tpot,
                    score=_score(ttft, tpot, max_tokens), terms=terms, note=note)


def price_options(
    ctx: RequestContext, workers: Sequence[WorkerView], estimates: Mapping[str, Estimate], max_tokens: int, *,
    bypass_max_tokens: int = BYPASS_MAX_TOKENS, scales: Scales | None = None, pair_links: PairLinks | None = None,
) -> list[PDOption]:
    """Every option (module doc) among open workers (not at their waiting cap, eligible
    estimate), in worker order: singles and bypasses first, then pairs."""
    open_ = [w for w in workers if not at_cap(w) and estimates[w.worker_id].eligible]
    out: list[PDOption] = []
    for w in open_:
        e = estimates[w.worker_id]
        if w.role == "both":
            out.append(price_single(e, w, max_tokens))
        elif w.role == "decode" and e.recompute_tokens <= bypass_max_tokens and sum(e.matched_blocks.values()) > 0:
            out.append(price_single(e, w, max_tokens, "bypass"))
    for p in open_:
        if not can_prefill(p):
            continue
        for d in open_:
            if d is p or not can_decode(d) or (p.role == "both" and d.role == "both"):
                continue  # two `both` workers: the single option of each already covers them
            ps, ls = scales(d.worker_id) if scales is not None else (1.0, None)
            lk = ls.get(Tier.PEER, 1.0) if ls else 1.0
            out.append(price_pair(ctx, estimates[p.worker_id], p, d, max_tokens, pair_links=pair_links,
                                  link_scale=lk, prefill_scale_d=ps))
    return out


def _label(o: PDOption) -> str:
    return f"{o.prefill_worker}->{o.decode_worker}" if o.kind == "pair" else f"{o.kind} {o.decode_worker}"


def record(chosen: PDOption, options: Sequence[PDOption], reason: str) -> PDDecision:
    """The decision record: the chosen option, the best alternative of each other kind and
    the next best overall (at most ALTERNATIVES_KEPT), and why they lost."""
    rest = sorted((o for o in options if o is not chosen), key=lambda o: o.score)
    alts: list[PDOption] = []
    for kind in ("single", "pair", "bypass"):
        best = next((o for o in rest if o.kind == kind), None)
        if best is not None:
            alts.append(best)
    for o in rest:
        if len(alts) >= ALTERNATIVES_KEPT:
            break
        if o not in alts:
            alts.append(o)
    alts.sort(key=lambda o: o.score)
    why = [f"{reason}: {_label(chosen)} score {chosen.score:.4f}s (TTFT {chosen.t_ttft:.4f}s)"]
    for o in alts:
        if math.isfinite(o.score):
            why.append(f"{_label(o)} +{o.score - chosen.score:.4f}s (TTFT {o.t_ttft:.4f}s)")
        else:
            why.append(f"{_label(o)} unusable{': ' + o.note if o.note else ''}")
    return PDDecision(chosen=chosen, alternatives=alts, why="; ".join(why))


class PairPolicyBase(PolicyBase):
    """What the pair policies share: per-worker estimates with their calibration, every
    option priced, the Decision built from the chosen option. A subclass picks (`_pick`).

    The Decision: `worker_id` the decode worker (the one whose stream the client reads),
    `prefill_worker_id` the prefill worker of a pair (None otherwise), `pd` the record,
    `ranked` the decode-capable workers by their best option (a retry of a single or a
    bypass; a pair is not retried elsewhere), `recompute_tokens` what the decode worker
    computes (for a pair, the tokens past the last full block)."""

    name: ClassVar[str] = ""

    def __init__(self, *, bypass_max_tokens: int = BYPASS_MAX_TOKENS, calibrate: bool = True) -> None:
        super().__init__(calibrate=calibrate)
        self.bypass_max_tokens = check_int("bypass_max_tokens", bypass_max_tokens, lo=0)
        self.pair_links: PairLinks | None = None  # per-pair links when the deployment knows them

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        for w in workers:
            check_role(w.role)
        if not workers:
            return self._shed_capped(workers)
        if not any(can_decode(w) for w in workers):  # nothing can answer: unavailable, not busy
            return Decision(None, self.name, "no_workers", retry_after_s=RETRY_MIN_S * 2)
        ctx = RequestContext.build(req, workers)
        estimates: dict[str, Estimate] = {}
        for w in workers:
            ps, ls = self.scales(w.worker_id)
            self._remember(w)
            e = estimate_worker(ctx, w, False, False, False, ps, ls)
            e.load = outstanding_requests(w)
            estimates[w.worker_id] = e
        options = price_options(ctx, workers, estimates, req.max_tokens, bypass_max_tokens=self.bypass_max_tokens,
                                scales=self.scales, pair_links=self.pair_links)
        usable = [o for o in options if math.isfinite(o.score)]
        if not usable:
            d = self._shed_capped(workers)
            d.estimates = list(estimates.values())
            return d
        chosen, reason = self._pick(req, ctx, workers, usable)
        pd = record(chosen, usable, reason)
        recompute = estimates[chosen.decode_worker].recompute_tokens
        if chosen.kind == "pair":
            recompute = int(chosen.terms["decode_tail_tokens"])
        ranked = [chosen.decode_worker]
        for o in sorted(usable, key=lambda o: o.score):
            if o.decode_worker not in ranked:
                ranked.append(o.decode_worker)
        return Decision(chosen.decode_worker, self.name, reason, predicted_ttft=chosen.t_ttft,
                        estimates=[estimates[w.worker_id] for w in workers], ranked=ranked,
                        recompute_tokens=recompute, prefill_worker_id=chosen.prefill_worker, pd=pd)

    def _pick(self, req: RouteRequest, ctx: RequestContext, workers: Sequence[WorkerView],
              options: list[PDOption]) -> tuple[PDOption, str]:
        raise NotImplementedError
