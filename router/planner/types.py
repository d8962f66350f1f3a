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
    # (cost.coschedule_seconds).
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
    """One worker as the planner sees it at decision time."""

    worker_id: str
    cost: CostParams
    # From the last load report (or the simulator's truth).
    waiting_requests: int = 0
    waiting_prefill_tokens: int = 0
    running_requests: int = 0
    est_queue_s: float = 0.0  # the worker's own estimate, when it gives one
    gpu_free_blocks: int = 0
    gpu_capacity_blocks: int = 0
    # Tokens per block of those two counts (the worker's engine block size); 0 = unknown
    # (vLLM's metrics give a usage fraction, on a made-up scale without cache_config_info):
    # no GPU-memory pricing then (cost.memory_seconds).
    gpu_block_tokens: int = 0
    report_age_s: float = 0.0
    # The router's own accounting since that report (reports lag).
    inflight_requests: int = 0  # dispatched, not finished
    # dispatched, first token not yet seen: the tokens the worker must compute for them
    # (the chosen Estimate.recompute_tokens when the policy gave one, else prompt tokens)
    inflight_prefill_tokens: int = 0
    # Caps and capabilities.
    max_waiting: int | None = None
    supports_prefetch: bool = True
    supports_peer_pull: bool = False
    url: str = ""
    # Optional, more precise inputs (None/0 = unknown; router/planner/load.py falls back).
    running_prefill_tokens: int = 0  # /load: prefill tokens still to compute for running requests
    # Dispatched AFTER the last report was taken (so the report cannot know them); when the
    # gateway tracks these, T_queue adds them to the aged report instead of guessing overlap.
    inflight_since_report_requests: int | None = None
    inflight_since_report_prefill_tokens: int | None = None
    # KV tokens held by this router's in-flight requests (prompt + generated so far), for the
    # Dynamo-style decode-load term; None falls back to the GPU blocks in use.
    active_kv_tokens: int | None = None
    # The router's in-flight requests on this worker that load KV from below GPU
    # (Estimate.t_load_total > 0) and have no first token yet: one `(ready_s, prefill_s)`
    # each, the seconds from now until its load is predicted to land and its prefill to
    # start (dispatch + its Estimate's t_queue + t_load, minus the time elapsed; may be
    # slightly negative: predicted landed, no first token seen yet) and its predicted
    # prefill seconds (Estimate.t_prefill). A newcomer that starts prefilling before such a
    # request's load lands takes the step budget ahead of it (the engine serves prefills in
    # the order they started), so kv_cost/kv_cost_true_state charge it that delay
    # (cost.interference_delays). Empty = none known (the term is then 0).
    inflight_loads: Sequence[tuple[float, float]] = ()
    # The router's in-flight requests on this worker predicted not to have started their
    # prefill yet and small enough to finish in their first step: one `(start_s,
    # prefill_tokens)` each (seconds from now until the predicted start, which may be
    # slightly negative; tokens to compute). A newcomer admitted in the same step takes the
    # budget they leave, and the step (so their first token) lasts its chunk longer
    # (cost.coschedule_seconds). Empty = none known.
    inflight_starts: Sequence[tuple[float, int]] = ()
    # Where `cost`'s speeds come from: False while they are only the router's defaults (a
    # vLLM server with no `cost:` not yet measured): kv_cost then routes by cache affinity
    # and load. `speeds_fitted`: a SpeedFit measured them (calibration then leaves them be).
    speeds_known: bool = True
    speeds_fitted: bool = False


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
    # summed over them; cost.interference_delays), and what kv_cost ranks by:
    # t_ttft + INTERFERENCE_WEIGHT * t_interference (None = t_ttft: not computed).
    t_interference: float = 0.0
    score: float | None = None
    # Of t_interference: the part from requests not started yet whose step it would share
    # (cost.coschedule_seconds); the rest is the delay to requests still loading.
    t_coschedule: float = 0.0
    # Decode time its new GPU blocks would wait for on a worker past its KV capacity
    # (cost.memory_seconds); kv_cost adds MEMORY_WEIGHT x this to the score.
    t_memory: float = 0.0

    @property
    def load_blocks(self) -> int:
        """The cut k: blocks 1..k are loaded (from the tiers of `load_blocks_by_tier`), the rest recomputed."""
        return sum(self.load_blocks_by_tier.values())


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
