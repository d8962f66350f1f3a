"""loadtest: how users prove the router pays for itself (docs/design.md §4.5, §9).

Trace loaders (Mooncake, Azure, BurstGPT, our own recordings), deterministic token
synthesis that keeps a trace's prefix sharing exact at any fleet block size,
open-loop HTTP replay, the offline discrete-event simulator (simulated engines on a
virtual clock + the planner's very policies), the seed scenarios, and reports.

May import kvindex, router.planner and workers.sim only (docs/design.md §3).
"""
from __future__ import annotations
