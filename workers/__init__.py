"""workers: the worker HTTP surface (one app for every engine), the simulated engine
(`workers/sim/`), the real torch engine (`workers/engine/`, later) and the KV-event publisher.

Never imports `router` (docs/design.md §3): router and workers meet only on the wire (docs/wire.md).
"""
from __future__ import annotations
