"""What a policy sees and what it answers (the planner's contract).

The gateway fills these from live state (index matches, `/load` reports, its own
in-flight accounting); the offline simulator fills them from simulated engines.
Policies never touch I/O.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier


@dataclass(slots=True)
class Link:
    """A path KV can be loaded over into GPU memory (`bytes/read_Bps + latency_s`)."""

    read_Bps: float
    latency_s: float = 0.0


@dataclass(slots=True)
class CostParams:
    """A worker's speed coefficients: from its profile at first, calibrated online.

    Prefill of `n` new tokens after `c` cached ones takes
    `prefill_overhead_s + n / prefill_tokens_per_s + prefill_attn_s_per_token2 * n * (c + n / 2)`.
    """

    block_size: int
    block_bytes: int
    prefill_tokens_per_s: float
    prefill_attn_s_per_token2: float = 0.0
    prefill_overhead_s: float = 0.0
    decode_step_s: float = 0.0
    # The worker's step token budget (vLLM's max_num_batched_tokens; 8192 is its default on
    # large GPUs), shared by the running decodes and the prefill chunks of one step
    # (terms/coschedule.py).
    max_batched_tokens: int = 8192
    # What each request decoding on the worker adds to a newcomer's first token, as measured
    # (speedfit.py): on an engine whose server shares its cores with the running streams,
    # far more than the step's own decode share. 0 = not measured.
    ride_per_running_s: float = 0.0
    # How the worker's real wait follows the queue this model predicts for it (1 = as
    # predicted; speedfit.py measures it where requests queue).
    queue_scale: float = 1.0
    # Load links per tier below GPU (GPU itself costs nothing to "load").
    links: dict[Tier, Link] = field(default_factory=dict)


@dataclass(slots=True)
class WorkerView:
    """One worker as the planner sees it at decision time: its last load report (or the
    simulator's truth), the router's own in-flight accounting since, and its capabilities.
    None / 0 in an optional field means unknown (load.py and the terms fall back)."""

    worker_id: str
    cost: CostParams  # its speeds and tier links
    # --- from the last load report
    waiting_requests: int = 0  # requests queued, not started
    waiting_prefill_tokens: int = 0  # prompt tokens of those
    running_requests: int = 0  # requests started (prefilling or decoding)
    est_queue_s: float = 0.0  # the worker's own queue-wait estimate, when it gives one
    gpu_free_blocks: int = 0  # free GPU KV blocks
    gpu_capacity_blocks: int = 0  # all GPU KV blocks
    # Tokens per block of the two counts above (its engine block size); 0 = unknown (vLLM without cache_config_info).
    gpu_block_tokens: int = 0
    report_age_s: float = 0.0  # how old that report is
    # --- the router's own accounting (reports lag)
    inflight_requests: int = 0  # dispatched, not finished
    # Tokens to compute for those without a first token yet (their Estimate.recompute_tokens, else the prompt).
    inflight_prefill_tokens: int = 0
    # --- caps and capabilities
    max_waiting: int | None = None  # its waiting-queue cap (it answers 429 past it); None = none
    supports_prefetch: bool = True  # raises blocks toward GPU before the request arrives
    supports_peer_pull: bool = False  # can pull blocks from another worker (the PEER tier)
    url: str = ""  # where it serves
    # --- optional, more precise inputs
    running_prefill_tokens: int = 0  # from the report: prefill tokens still to compute for running requests
    # Requests dispatched after the last report was taken (None = not tracked: T_queue then guesses the overlap).
    inflight_since_report_requests: int | None = None
    inflight_since_report_prefill_tokens: int | None = None  # their prefill tokens (None as above)
    # KV tokens of its in-flight requests (prompt + generated), for decode load and memory; None = GPU blocks in use.
    active_kv_tokens: int | None = None
    # `(ready_s, prefill_s)` per in-flight request still loading KV from below GPU (terms/interference.py).
    inflight_loads: Sequence[tuple[float, float]] = ()
    # `(start_s, prefill_tokens)` per in-flight request predicted not to have started (terms/coschedule.py).
    inflight_starts: Sequence[tuple[float, int]] = ()
    # --- where `cost`'s speeds come from
    # False while they are only the router's defaults: kv_cost then routes by cache affinity and load.
    speeds_known: bool = True
    speeds_fitted: bool = False  # a SpeedFit measured them (calibration then leaves them be)
    # --- prefill/decode disaggregation (pd.py): "prefill" computes prompts only (their KV
    # then moves to a decode worker), "decode" takes requests whose KV was moved to it (or
    # that it holds enough of: the bypass), "both" serves requests whole (the default).
    role: str = "both"


@dataclass(slots=True)
class RouteRequest:
    """A request as routing needs it: sizes, block digests, and index matches."""

    prompt_tokens: int
    digests: Sequence[int]  # digest64 of each full block, in order
    matches: Mapping[str, PrefixMatch]  # worker_id -> leading blocks held (absent = none)
    max_tokens: int = 256
    now: float = 0.0
    request_id: str = ""


@dataclass(slots=True, kw_only=True)
class Estimate:
    """The per-worker breakdown that `/admin/route/explain` shows (built by keyword)."""

    worker_id: str
    # Leading blocks per tier (PEER: pullable from another worker).
    matched_blocks: dict[Tier, int] = field(default_factory=dict)
    # Of those, the blocks 1..k loaded per tier (k: the cut, `load_blocks`); the rest is recomputed.
    load_blocks_by_tier: dict[Tier, int] = field(default_factory=dict)
    # Of those, what can be raised toward GPU while the request is queued.
    prefetch_blocks: dict[Tier, int] = field(default_factory=dict)
    recompute_tokens: int
    t_queue: float
    t_load: float = 0.0  # load time left on the critical path after prefetch overlap
    t_load_total: float = 0.0  # load time if nothing were prefetched
    t_prefill: float
    t_ttft: float
    eligible: bool = True
    note: str = ""
    peer_source: str | None = None  # worker to pull PEER blocks from
    load: float = 0.0  # outstanding requests (what the bounded-load guard and tie-breaks compare)
    # Delay this request would impose on requests already loading on the worker (seconds,
    # summed over them; terms/interference.py), and what kv_cost ranks by:
    # t_ttft + INTERFERENCE_WEIGHT * t_interference (None = t_ttft: not computed).
    t_interference: float = 0.0
    score: float | None = None
    # Of t_interference: the part from requests not started yet whose step it would share
    # (terms/coschedule.py); the rest is the delay to requests still loading.
    t_coschedule: float = 0.0
    # Decode time its new GPU blocks would wait for on a worker past its KV capacity
    # (terms/memory.py); kv_cost adds MEMORY_WEIGHT x this to the score.
    t_memory: float = 0.0

    @property
    def load_blocks(self) -> int:
        """The cut k: blocks 1..k are loaded (from the tiers of `load_blocks_by_tier`), the rest recomputed."""
        return sum(self.load_blocks_by_tier.values())


def by_score(e: Estimate) -> float:
    """What kv_cost ranks an estimate by: its score, or t_ttft where none was computed."""
    s = e.score
    return e.t_ttft if s is None else s


@dataclass(slots=True)
class Decision:
    """A policy's answer. `worker_id` None means: shed (no eligible worker / SLO)."""

    worker_id: str | None
    policy: str
    reason: str
    predicted_ttft: float | None = None
    # Per-worker breakdowns: kv_cost/kv_cost_true_state list the workers they evaluated (all that could
    # win, tie or be the retry target; every worker with their all_estimates attribute set,
    # as router.planner.explain does); the baselines none (explain fills them).
    estimates: list[Estimate] = field(default_factory=list)
    # What to ask the chosen worker to raise toward GPU before the request arrives.
    prefetch_blocks: int = 0  # leading blocks [0, prefetch_upto) to raise, 0 = none
    prefetch_from_peer: str | None = None
    ranked: list[str] = field(default_factory=list)  # fallback order for one retry
    # When shed (worker_id None): suggested wait before retrying, for a 429's Retry-After
    # (the gateway rounds it up to whole seconds).
    retry_after_s: float | None = None
    # Tokens the chosen worker is predicted to compute (the rest it loads): what the
    # gateway should count as that worker's in-flight prefill tokens until first token.
    recompute_tokens: int | None = None
    # Prefill/decode disaggregation (the pd_* policies, pd.py): when set, `worker_id` is the
    # decode worker and this one computes the prompt first (max_tokens 1), after which the
    # prompt's KV moves to `worker_id`; None = `worker_id` serves both phases. `pd` is the
    # pair decision's record (every option priced; what explain shows).
    prefill_worker_id: str | None = None
    pd: PDDecision | None = None


@dataclass(slots=True, kw_only=True)
class PDOption:
    """One way to serve a request under prefill/decode disaggregation, priced (pd.py).

    `kind`: "single" (one `both` worker for both phases), "pair" (prefill on
    `prefill_worker`, KV moved to `decode_worker`), "bypass" (the decode worker holds
    enough of the prompt and prefills the rest itself: no remote prefill). `terms` holds
    every term in seconds (and `transfer_bytes`), by name."""

    kind: str
    decode_worker: str
    prefill_worker: str | None = None
    t_ttft: float
    t_tpot: float  # the decode worker's expected time per output token
    score: float  # what pd_cost ranks by: t_ttft + (max_tokens - 1) * t_tpot
    terms: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "prefill_worker": self.prefill_worker, "decode_worker": self.decode_worker,
                "t_ttft": self.t_ttft, "t_tpot": self.t_tpot, "score": self.score, "terms": dict(self.terms),
                "note": self.note}


@dataclass(slots=True, kw_only=True)
class PDDecision:
    """A pair decision: the chosen option, the best alternatives (each with its score) and
    why they lost, for /admin/route/explain."""

    chosen: PDOption
    alternatives: list[PDOption] = field(default_factory=list)
    why: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"chosen": self.chosen.to_dict(), "alternatives": [o.to_dict() for o in self.alternatives],
                "why": self.why}


class Policy(Protocol):
    """A routing policy. May keep its own state (a round-robin cursor, a ring)."""

    name: str

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        """Pick a worker among `workers` (already filtered to healthy, routable ones)."""
        ...

    def observe(
        self, worker_id: str, predicted_ttft: float | None, actual_ttft: float, kv: Mapping[str, object] | None
    ) -> None:
        """Feedback after a request's first token (calibration); may do nothing."""
        ...
