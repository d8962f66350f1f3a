"""T_transfer: moving a prompt's KV from a prefill worker to a decode worker (pd.py).

`bytes = tokens * block_bytes / block_size` (the KV bytes per token of the model, from
the cost params: `block_bytes` is one index block of every layer's K and V), moved over
the pair's link in `latency_s + bytes / read_Bps`.

The link: a per-pair entry when the caller has one (`pair_links[(src, dst)]`), else the
decode worker's PEER link (`CostParams.links[Tier.PEER]`): the path a P->D transfer
takes is the one a peer pull into that worker takes (its NIC, reading another worker's
GPU memory). Learned like every other speed: that link comes from the worker's `/load`
report (`tier_links`, folded in by fleet.apply_report), and the calibrator scales it by
what the decode worker reports afterwards (`usage.kv` loaded PEER tokens and load
milliseconds), so `scale` is the decode worker's calibrated PEER link scale
(`PolicyBase.scales(decode worker)[1][Tier.PEER]`, 1.0 when none).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from kvindex.tiers import Tier

from ..types import CostParams, Link, WorkerView

PairLinks = Mapping[tuple[str, str], Link]


def kv_bytes_per_token(cost: CostParams) -> float:
    """KV bytes one token occupies (every layer's K and V), from the block geometry."""
    if cost.block_size <= 0 or cost.block_bytes <= 0:
        return math.nan
    return cost.block_bytes / cost.block_size


def kv_transfer_bytes(tokens: int, cost: CostParams) -> float:
    """Bytes of `tokens` tokens' KV."""
    return max(0, tokens) * kv_bytes_per_token(cost)


# A pair nobody described (a vLLM fleet with no `cost:` says nothing of its connector's
# link): priced as a 10-gigabit-class path, so a disaggregated fleet is routed at all; a
# stated link (the worker's PEER link, or the pair's own) replaces it, and the decode
# worker's calibrated PEER scale corrects it where the worker reports its loads.
UNKNOWN_PAIR_LINK = Link(read_Bps=1.25e9, latency_s=1e-3)


def transfer_link(src: WorkerView, dst: WorkerView, pair_links: PairLinks | None = None) -> Link:
    """The link KV moves over from `src` to `dst`: the pair's own entry, else `dst`'s PEER
    link, else UNKNOWN_PAIR_LINK."""
    if pair_links:
        link = pair_links.get((src.worker_id, dst.worker_id))
        if link is not None:
            return link
    return dst.cost.links.get(Tier.PEER) or UNKNOWN_PAIR_LINK


def kv_transfer_seconds(tokens: int, cost: CostParams, link: Link | None, scale: float = 1.0) -> float:
    """Time to move `tokens` tokens' KV over `link`: `(latency + bytes / bandwidth) * scale`.
    Nothing to move costs nothing; no usable link (or bad geometry) is infinite."""
    if tokens <= 0:
        return 0.0
    if link is None or not link.read_Bps > 0.0:
        return math.inf
    nbytes = kv_transfer_bytes(tokens, cost)
    if not math.isfinite(nbytes):
        return math.inf
    return (link.latency_s + nbytes / link.read_Bps) * scale
