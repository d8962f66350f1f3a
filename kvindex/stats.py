"""Counters of event application, defined once.

`ApplyStats`'s fields are the counters: adding one is a one-line change that the
per-worker totals (`WorkerIndexStats`), their sums and ingestion's health report
(`kvindex.ingest`) all pick up, since they iterate over `COUNTERS`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter


@dataclass(slots=True)
class ApplyStats:
    """What one batch did (the index also sums these per worker).

    `stored` / `removed` count engine blocks named by events; `ignored` counts
    events of other KV-cache groups (hybrid models: only group 0 is indexed).
    `digests_verified` counts a trusted worker's chain-root events recomputed from
    their tokens, `digest_mismatches` those whose digests differed (docs/prefix-index.md).
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
