"""The planner: cost model and routing policies. Pure (no I/O, no web framework),
so the offline simulator runs the very same code as the gateway."""
from __future__ import annotations
