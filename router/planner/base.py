"""What every policy shares: parameter checks, caps and shedding, calibration, prediction.

Every policy skips workers whose waiting queue is at `max_waiting` (they would answer
429) and sheds (Decision.worker_id None, `retry_after_s` set) when all are. Every
policy feeds `observe()` to a Calibrator and reports a predicted TTFT for the worker
it picked (the cost model pricing what that worker will really do; the baselines plan
no prefetch and no peer pull), so predicted-vs-actual is comparable across policies.

`Decision.reason` is a short fixed label per outcome (metrics use it as a label);
the per-worker detail is in `Decision.estimates`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvindex.tiers import Tier

from .calibration import Calibrator
from .cost import RequestContext, estimate_worker
from .load import at_cap, queue_seconds
from .terms.decode_ride import running_decodes
from .types import CostParams, Decision, RouteRequest, WorkerView

# The prefill scale every policy calibrates with: this quantile of the recent observed /
# predicted prefill ratios (calibration.py: a reported prefill also holds the chunks of
# the requests it shared steps with, which the queue term already prices). A constant,
# not a setting: the EWMA it replaced read predictions 20-30% high (docs/planner.md,
# "Online calibration").
PREFILL_QUANTILE = 0.2
# Add each worker's median TTFT residual to its predictions: a constant, not a setting
# (docs/planner.md, "Online calibration": the misses it absorbs).
TTFT_OFFSET = True
RETRY_MIN_S = 0.5
RETRY_MAX_S = 60.0


def check_number(
    name: str, value: object, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> float:
    """A finite real parameter within bounds, else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"parameter {name!r} must be a finite number, got {value!r}")
    v = float(value)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"parameter {name!r} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and v > hi:
        raise ValueError(f"parameter {name!r} must be <= {hi}, got {value!r}")
    return v


def check_int(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"parameter {name!r} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"parameter {name!r} must be in [{lo}, {hi}], got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"parameter {name!r} must be true or false, got {value!r}")
    return value


def clamp_retry(seconds: float) -> float:
    if not math.isfinite(seconds):
        return RETRY_MAX_S
    return min(RETRY_MAX_S, max(RETRY_MIN_S, seconds))


class PolicyBase:
    """Calibration, caps and shedding for the concrete policies."""

    name: ClassVar[str] = ""

    def __init__(self, *, calibrate: bool = True, prefill_quantile: float | None = PREFILL_QUANTILE,
                 ttft_offset: bool = TTFT_OFFSET) -> None:
        self.calibrate = check_bool("calibrate", calibrate)
        if prefill_quantile is not None:
            check_number("prefill_quantile", prefill_quantile, lo=0.0, hi=1.0)
        self.calibrator = Calibrator(prefill_quantile=prefill_quantile,
                                     ttft_offset=check_bool("ttft_offset", ttft_offset))
        # Per worker: the CostParams its last prediction used and its running requests then
        # (the decodes a prefill's steps carried), for calibrating against them.
        self._last_cost: dict[str, tuple[CostParams, int]] = {}

    def observe(
        self, worker_id: str, predicted_ttft: float | None, actual_ttft: float, kv: Mapping[str, object] | None
    ) -> None:
        """Feed the calibrator with what the worker reported (usage.kv) after its first token."""
        base, decodes = self._last_cost.get(worker_id, (None, 0))
        self.calibrator.observe(worker_id, base, predicted_ttft, actual_ttft, kv, decodes)

    def scales(self, worker_id: str) -> tuple[float, dict[Tier, float] | None]:
        """This worker's calibration (prefill scale, link scales); neutral when off."""
        if not self.calibrate:
            return 1.0, None
        return self.calibrator.factors(worker_id)

    def _remember(self, w: WorkerView) -> None:
        """Keep the CostParams a prediction for `w` used, for calibrating against it."""
        self._last_cost[w.worker_id] = (w.cost, running_decodes(w))
        self.calibrator.set_fitted(w.worker_id, w.speeds_fitted)
        self._bound_last()

    def _bound_last(self) -> None:
        while len(self._last_cost) > self.calibrator.max_workers:
            del self._last_cost[next(iter(self._last_cost))]

    @staticmethod
    def _split_capped(workers: Sequence[WorkerView]) -> list[WorkerView]:
        return [w for w in workers if not at_cap(w)]

    def _shed_capped(self, workers: Sequence[WorkerView]) -> Decision:
        if not workers:
            return Decision(None, self.name, "no_workers", retry_after_s=RETRY_MIN_S * 2)
        wait = min(queue_seconds(w) for w in workers)
        return Decision(None, self.name, "shed_capped", retry_after_s=clamp_retry(wait))

    def _decide(self, req: RouteRequest, chosen: WorkerView, ranked: list[str], reason: str) -> Decision:
        """A baseline's pick, with the cost model's TTFT for it (no prefetch, no peer pull planned)."""
        ctx = RequestContext.build(req, (chosen,))
        ps, ls = self.scales(chosen.worker_id)
        self._remember(chosen)
        e = estimate_worker(ctx, chosen, False, False, False, ps, ls)
        return Decision(
            chosen.worker_id,
            self.name,
            reason,
            predicted_ttft=e.t_ttft,
            ranked=ranked,
            recompute_tokens=e.recompute_tokens,
        )
