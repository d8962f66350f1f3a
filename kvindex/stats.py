"""Counters of event application, defined once.

`ApplyStats`'s fields are the counters: adding one is a one-line change that the
per-worker totals (`WorkerIndexStats`), their sums and ingestion's health report
(`kvindex.ingest`) all pick up, since they iterate over `COUNTERS`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter


@dataclass(slots=True)
class ApplyStats:
    """What one batch did (the index also sums these per worker).

    `stored` / `removed` count engine blocks of group 0 named by events,
    `group_stored` / `group_removed` those of the other KV-cache groups of hybrid
    models; `ignored` counts group events the index cannot model (no
    `kv_cache_spec_kind`, a group it has no spec for, too many groups),
    `group_spec_changes` a group whose kind, block size or window changed, and
    `group_overflows` a group emptied for growing past its bound (docs/kv-groups.md).
    `digests_verified` counts a trusted worker's chain-root events recomputed from
    their tokens, `digest_mismatches` those whose digests differed (docs/prefix-index.md).
    For a worker whose pages are smaller than the index block (kvindex/page_chain.py),
    `stored` / `removed` count pages, `partial_pages` pages shorter than its page size
    (they end no index block), `pages_evicted` pages its bounded page memory forgot and
    `unchained_pages` pages of a release whose page hashes do not chain (never credited).
    """

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_removed: int = 0
    orphans: int = 0
    unknown_medium: int = 0
    bad_events: int = 0
    ignored: int = 0
    digests_verified: int = 0
    digest_mismatches: int = 0
    group_stored: int = 0
    group_removed: int = 0
    group_spec_changes: int = 0
    group_overflows: int = 0
    partial_pages: int = 0
    pages_evicted: int = 0
    unchained_pages: int = 0

    def add(self, other: ApplyStats) -> None:
        """Add `other`'s counters to these."""
        for name, mine, theirs in zip(COUNTERS, _values(self), _values(other), strict=True):
            setattr(self, name, mine + theirs)

    def counters(self) -> dict[str, int]:
        """The counters by name, in definition order."""
        return dict(zip(COUNTERS, _values(self), strict=True))


COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(ApplyStats))
_values = attrgetter(*COUNTERS)


@dataclass(slots=True, kw_only=True)
class WorkerIndexStats(ApplyStats):
    """One worker's registration and its counters summed over every batch applied."""

    worker_id: str
    slot: int
    remote_group: str
    draining: bool
    blocks: dict[str, int]  # entries per tier name
    engine_map: int = 0  # engine hashes mapped to our digests
    trusted_digests: bool = False  # now: False from the start, or since a mismatch
    # Hybrid models (docs/kv-groups.md): group -> "kind/block size[/window=W]"; queries
    # where other groups cut what group 0 alone holds (and by how many blocks); queries
    # where full-attention groups held different leading runs (the groups disagree).
    kv_groups: dict[str, str] = field(default_factory=dict)
    group_cuts: int = 0
    group_cut_blocks: int = 0
    group_disagreements: int = 0
