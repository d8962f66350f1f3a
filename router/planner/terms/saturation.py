"""Saturation stickiness: under overload, keep a request where its prompt's KV already sits.

When no worker can give a first token soon, queue estimates are seconds off, and
greedy TTFT routing sent follow-ups away from the worker holding their conversation,
taking fresh blocks elsewhere. Within a band of the best score, the worker holding the
most of the prompt itself wins instead (the other saturation rule is terms/memory.py;
docs/planner.md, "Saturation").
"""
from __future__ import annotations

from collections.abc import Sequence

from kvindex.tiers import Tier

from ..types import Estimate, by_score


def held_blocks(e: Estimate, local_tiers: bool) -> int:
    """Leading blocks of the prompt this worker holds itself (not what it would pull):
    on GPU, and with `local_tiers` in its CPU and DISK tiers too."""
    m = e.matched_blocks
    n = m.get(Tier.GPU, 0)
    if local_tiers:
        n += m.get(Tier.CPU, 0) + m.get(Tier.DISK, 0)
    return n


def sticky_pick(
    pool: Sequence[Estimate],
    best: Estimate,
    chosen: Estimate,
    band: float,
    abs_s: float,
    slo: float | None,
    local_tiers: bool,
) -> Estimate | None:
    """The worker within `band` (relative) plus `abs_s` of the best score that holds the
    most of the prompt, meeting the SLO when one is set; None when none holds more than
    the best and the tie-break's pick (`chosen`). Equal holdings go to the lower score."""
    bound = by_score(best) * (1.0 + band) + abs_s
    pick, top = None, max(held_blocks(best, local_tiers), held_blocks(chosen, local_tiers))
    for e in pool:
        if by_score(e) > bound or (slo is not None and e.t_ttft > slo):
            continue
        h = held_blocks(e, local_tiers)
        if h > top or (h == top and pick is not None and by_score(e) < by_score(pick)):
            pick, top = e, h
    return pick
