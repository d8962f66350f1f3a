"""The simulated engine (docs/design.md §3): a vLLM-like worker with tiered KV, on a real
clock behind the HTTP app (driver.py) or on a virtual clock inside the offline
simulator (engine.py, used as a library). Never imports torch or workers.engine.
Layout and model: docs/sim-engine.md."""
from __future__ import annotations

from .engine import PeerSource, SimEngine, SimRequest
from .profile import SimProfile, load_profile
from .remote import RemoteStore

__all__ = ["SimEngine", "SimRequest", "SimProfile", "RemoteStore", "PeerSource", "load_profile"]
