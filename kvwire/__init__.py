"""kvwire: the typed HTTP contract between workers and the gateway.

`router/` and `workers/` never import each other (docs/design.md §3); both import these
structs, so a field added on one side is seen by the other, by the simulator and by
the type checker. Imports nothing of the project. The prose contract is docs/wire.md.
"""
from __future__ import annotations

from .info import EventsInfo, NamespaceInfo, WorkerInfo
from .load import BlockCounts, LoadReport, Speeds, TierLink

__all__ = ["BlockCounts", "EventsInfo", "LoadReport", "NamespaceInfo", "Speeds", "TierLink", "WorkerInfo"]
