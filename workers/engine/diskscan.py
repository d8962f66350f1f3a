"""A restart over an existing DISK directory: what the store holds, published again.

Only whole chains are published: a block whose parent is held nowhere would name a parent
no subscriber knows, so it is discarded as an orphan, as are records whose metadata this
engine cannot read.
"""
from __future__ import annotations

import logging

from kvindex.tiers import Tier
from workers.blockmeta import BlockMeta, stored_events

from .blockio import BadMeta, decode_meta
from .tierstate import Held, TierState

log = logging.getLogger(__name__)


def publish_disk_scan(st: TierState) -> None:
    """Publish the DISK store's intact chains and discard the rest. Takes the lock."""
    assert st.disk is not None
    found: dict[bytes, tuple[BlockMeta, str | None]] = {}
    raws: dict[bytes, bytes] = {}
    bad: list[bytes] = []
    for key, raw in st.disk.scan():
        try:
            found[key] = decode_meta(raw, st.bs)
            raws[key] = raw
        except BadMeta:
            bad.append(key)
    reach: dict[bytes, bool] = {}
    keep = [k for k in found if _reachable(k, found, reach)]
    bad += [k for k in found if not reach[k]]
    with st.lock:
        for k in keep:
            st.disk_keys[k] = Held(found[k][1], raws[k])
        if keep:
            st.blocks.events.extend(stored_events(Tier.DISK, keep, {k: found[k][0] for k in keep}, st.bs))
    if bad:
        st.stats.bad_meta += len(bad) - sum(1 for k in bad if k in found)
        st.disk.discard(bad)
    if keep:
        log.info("DISK tier: %d blocks found at start, %d discarded", len(keep), len(bad))


def _reachable(k: bytes, found: dict[bytes, tuple[BlockMeta, str | None]], reach: dict[bytes, bool]) -> bool:
    """Does the chain from `k` up to a root lie wholly in `found`? Memoised in `reach`
    for every block on the way."""
    path: list[bytes] = []
    ok = False
    while True:
        if k in reach:
            ok = reach[k]
            break
        m = found.get(k)
        if m is None:
            break
        path.append(k)
        parent = m[0].parent
        if parent is None:
            ok = True
            break
        k = parent
    for p in path:
        reach[p] = ok
    return ok
