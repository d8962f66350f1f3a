"""kv_cost's fixed constants, and the one object that may change them.

Each of these was a `routing.params` setting; none had a case where a fleet should run
another value, so each is now the value docs/planner.md ("Settings") gives with its
reason. Tests, ablations and bench/bench_decision.py need other values: they pass a
`KVCostTuning` as the policy's private `_tuning` argument, which make_policy, the
config and the simulator's `--param` never accept. `REMOVED` tells a config that still
names one what became of it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .base import PREFILL_QUANTILE, TTFT_OFFSET, check_bool, check_int, check_number
from .terms.coschedule import COSCHEDULE_SLACK_S

# Near-tie window, relative: none measured; ties go to the less loaded (planner.md, kv_cost step 3).
TIE_MARGIN = 0.03
# Near-tie window, absolute seconds: none measured; same rule as TIE_MARGIN.
TIE_ABS_S = 0.001
# Requests over the bounded-load limit still allowed: none measured (planner.md, kv_cost step 2).
BALANCE_SLACK = 2.0
# Fewest blocks below GPU worth a prefetch of local tiers: none measured; 1 = always.
MIN_PREFETCH_BLOCKS = 1
# Weight of the delay caused to requests still loading: 1 = their TTFTs at face value (planner.md, Interference).
INTERFERENCE_WEIGHT = 1.0
# How long after its predicted landing a load still counts: a coin flip margin (planner.md, Interference).
INTERFERENCE_SLACK_S = 0.05
# Weight of the delay caused to requests sharing a step: 0, measured not to pay (planner.md, Co-scheduling).
COSCHEDULE_WEIGHT = 0.0
# Stickiness band in saturation: 0.3 beat 0.15 and 0.5 (planner.md, Saturation).
SATURATION_BAND = 0.3
# Stickiness band, absolute seconds: none measured.
SATURATION_ABS_S = 0.0
# Saturated = no worker's TTFT bound under this: none measured (planner.md, Saturation).
SATURATION_QUEUE_S = 2.0
# Own CPU and DISK copies count as held: GPU-only was worse (planner.md, Saturation).
SATURATION_LOCAL_TIERS = True
# Weight of the GPU-memory wait: 30 beat 1, 3 and 10 (planner.md, Saturation).
MEMORY_WEIGHT = 30.0
# KV past this fraction of GPU capacity waits: none measured; 1 = the capacity.
MEMORY_BOUND = 1.0


@dataclass(frozen=True, slots=True)
class KVCostTuning:
    """The constants above as one value; `DEFAULT` is what every routed fleet runs.

    `saturation_band` None turns stickiness off and `memory_weight` 0 the memory term
    (each alone: the policy's `saturation` setting turns both off together)."""

    tie_margin: float = TIE_MARGIN
    tie_abs_s: float = TIE_ABS_S
    balance_slack: float = BALANCE_SLACK
    min_prefetch_blocks: int = MIN_PREFETCH_BLOCKS
    interference_weight: float = INTERFERENCE_WEIGHT
    interference_slack_s: float = INTERFERENCE_SLACK_S
    coschedule_weight: float = COSCHEDULE_WEIGHT
    coschedule_slack_s: float = COSCHEDULE_SLACK_S
    saturation_band: float | None = SATURATION_BAND
    saturation_abs_s: float = SATURATION_ABS_S
    saturation_queue_s: float = SATURATION_QUEUE_S
    saturation_local_tiers: bool = SATURATION_LOCAL_TIERS
    memory_weight: float = MEMORY_WEIGHT
    memory_bound: float = MEMORY_BOUND
    prefill_quantile: float | None = PREFILL_QUANTILE
    ttft_offset: bool = TTFT_OFFSET

    def __post_init__(self) -> None:
        self._check_rules()
        self._check_saturation()

    def _check_rules(self) -> None:
        """Tie window, bounded load, prefetch and the interference terms."""
        check_number("tie_margin", self.tie_margin, lo=0.0, hi=1.0)
        check_number("tie_abs_s", self.tie_abs_s, lo=0.0, hi=10.0)
        check_number("balance_slack", self.balance_slack, lo=0.0)
        check_int("min_prefetch_blocks", self.min_prefetch_blocks, lo=1)
        check_number("interference_weight", self.interference_weight, lo=0.0, hi=100.0)
        check_number("interference_slack_s", self.interference_slack_s, lo=0.0, hi=10.0)
        check_number("coschedule_weight", self.coschedule_weight, lo=0.0, hi=100.0)
        check_number("coschedule_slack_s", self.coschedule_slack_s, lo=0.0, hi=10.0)
        if self.prefill_quantile is not None:
            check_number("prefill_quantile", self.prefill_quantile, lo=0.0, hi=1.0)
        check_bool("ttft_offset", self.ttft_offset)

    def _check_saturation(self) -> None:
        """The two saturation rules: stickiness and GPU memory."""
        if self.saturation_band is not None:
            check_number("saturation_band", self.saturation_band, lo=0.0, hi=10.0)
        check_number("saturation_abs_s", self.saturation_abs_s, lo=0.0, hi=100.0)
        check_number("saturation_queue_s", self.saturation_queue_s, lo=0.0)
        check_bool("saturation_local_tiers", self.saturation_local_tiers)
        check_number("memory_weight", self.memory_weight, lo=0.0, hi=1000.0)
        check_number("memory_bound", self.memory_bound, lo=0.0, hi=10.0, lo_open=True)


DEFAULT = KVCostTuning()

_SEE = 'docs/planner.md, "Settings"'
_OFF = "`saturation: false` turns both saturation rules off"


def _constant(name: str) -> str:
    return f"it is the fixed constant {name.upper()} = {getattr(DEFAULT, name)!r} ({_SEE})"


# Former settings -> what became of them: why a config naming one is refused.
REMOVED: dict[str, str] = {
    **{f.name: _constant(f.name) for f in fields(KVCostTuning)},
    "saturation_band": f"{_constant('saturation_band')}, and {_OFF}",
    "memory_weight": f"{_constant('memory_weight')}, and {_OFF}",
    "all_estimates": "/admin/route/explain evaluates every worker itself (an output, not a routing choice)",
}
