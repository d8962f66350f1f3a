"""A simulated fleet: N SimEngines from one profile, remote groups, and tier switches.

`--tiers` switches tiers off by removing them from the profile, so the engines
really lack them (no capacity, no link) and the planner sees no link for them:

    gpu                 GPU prefix cache only (the no-offload baseline)
    gpu,cpu             + host DRAM
    gpu,cpu,disk        + local SSD
    gpu,cpu,disk,remote + the group-shared store
    all                 everything the profile has (also the PEER link for peer pulls)

PEER (pulling KV from another worker's memory) is kept only by `all` or an explicit
`peer` item, since it is the network path, not a storage tier.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvindex.events import KVEvent
from workers.sim import RemoteStore, SimEngine, SimProfile, load_profile

from .trace import TraceError

TIER_PRESETS: dict[str, frozenset[str]] = {
    "gpu": frozenset({"gpu"}),
    "gpu,cpu": frozenset({"gpu", "cpu"}),
    "gpu,cpu,disk": frozenset({"gpu", "cpu", "disk"}),
    "gpu,cpu,disk,remote": frozenset({"gpu", "cpu", "disk", "remote"}),
    "all": frozenset({"gpu", "cpu", "disk", "remote", "peer"}),
}
TIER_SWEEP: tuple[str, ...] = ("gpu", "gpu,cpu", "gpu,cpu,disk", "all")
_ITEMS = ("gpu", "cpu", "disk", "remote", "peer")


def parse_tiers(spec: str) -> frozenset[str]:
    """`gpu,cpu,...` or a preset name → the set of enabled tier names (gpu always on)."""
    s = spec.strip().lower()
    if s in TIER_PRESETS:
        return TIER_PRESETS[s]
    items = frozenset(x.strip() for x in s.split(",") if x.strip())
    bad = sorted(items - set(_ITEMS))
    if bad or "gpu" not in items:
        raise TraceError(
            f"bad --tiers {spec!r}: use a comma list of {', '.join(_ITEMS)} including gpu, or one of "
            f"{', '.join(TIER_PRESETS)}"
        )
    return items


def tiers_label(enabled: frozenset[str]) -> str:
    for name, items in TIER_PRESETS.items():
        if items == enabled:
            return name
    return ",".join(x for x in _ITEMS if x in enabled)


def profile_with_tiers(profile: SimProfile, enabled: frozenset[str]) -> SimProfile:
    return replace(
        profile,
        cpu=profile.cpu if "cpu" in enabled else None,
        disk=profile.disk if "disk" in enabled else None,
        remote=profile.remote if "remote" in enabled else None,
        peer=profile.peer if "peer" in enabled else None,
    )


@dataclass(slots=True)
class FleetSpec:
    workers: int = 8
    profile: str | SimProfile = "h200-llama3.1-8b"
    tiers: str = "all"
    block_size: int | None = None  # None: the profile's
    remote_groups: int = 1  # workers are dealt round-robin into this many REMOTE groups
    max_waiting: int | None = None  # None: the profile's
    # Prefill/decode disaggregation: (prefill workers, decode workers), the first ones
    # prefill-role, the rest decode-role (their sum is `workers`); None: every worker `both`.
    pd: tuple[int, int] | None = None
    # The P->D link's bandwidth (bytes/s): the profile's PEER link read bandwidth, which a
    # decode worker pulls the prompt's KV over; None: the profile's.
    pd_link_Bps: float | None = None
    # Data-parallel servers (loadtest/dp_fleet.py): `workers` servers of `dp` ranks each,
    # routed per rank ("rank") or per server through its own balancer ("server").
    dp: int = 1
    dp_routing: str = "rank"

    def role(self, i: int) -> str:
        """The role of the i-th worker."""
        if self.pd is None:
            return "both"
        return "prefill" if i < self.pd[0] else "decode"

    def resolved_profile(self) -> SimProfile:
        base = load_profile(self.profile) if isinstance(self.profile, str) else self.profile
        if self.pd_link_Bps is not None:
            if not self.pd_link_Bps > 0 or base.peer is None:
                raise TraceError("pd_link_Bps must be positive, on a profile with a peer link")
            base = replace(base, peer=replace(base.peer, read_Bps=float(self.pd_link_Bps)))
        p = profile_with_tiers(base, parse_tiers(self.tiers))
        if self.pd is not None and p.peer is None:
            raise TraceError("a disaggregated fleet (pd) moves KV over the PEER link: keep `peer` in --tiers")
        if self.block_size is not None and self.block_size != p.block_size:
            if self.block_size <= 0:
                raise TraceError("block_size must be positive")
            p = p.with_block_size(self.block_size)
        return p


class Fleet:
    """The engines and their shared remote stores; workers can join and leave."""

    def __init__(
        self,
        spec: FleetSpec,
        on_events: Callable[[str], Callable[[list[KVEvent]], None] | None] | None = None,
    ) -> None:
        if not 1 <= spec.workers <= 1024:
            raise TraceError("workers must be in 1..1024")
        if spec.remote_groups < 1:
            raise TraceError("remote_groups must be >= 1")
        if spec.pd is not None and (min(spec.pd) < 1 or sum(spec.pd) != spec.workers):
            raise TraceError(f"pd {spec.pd[0]}:{spec.pd[1]} needs at least one worker of each role, "
                             f"{spec.workers} in all")
        self.spec = spec
        self.profile = spec.resolved_profile()
        self.block_size = self.profile.block_size
        self._on_events = on_events
        self.remotes: list[RemoteStore] = []
        if self.profile.remote is not None:
            cap = self.profile.tier_blocks(self.profile.remote)
            self.remotes = [RemoteStore(f"rg{g}", cap, self.block_size) for g in range(spec.remote_groups)]
        self.engines: dict[str, SimEngine] = {}
        self._next = 0
        for _ in range(spec.workers):
            self.add()

    def add(self, worker_id: str | None = None, profile: SimProfile | None = None) -> SimEngine:
        wid = worker_id or f"w{self._next}"
        if wid in self.engines:
            raise TraceError(f"worker {wid!r} already exists")
        remote = self.remotes[self._next % len(self.remotes)] if self.remotes else None
        self._next += 1
        cb = self._on_events(wid) if self._on_events is not None else None
        eng = SimEngine(
            wid, profile or self.profile, remote=remote, on_events=cb, max_waiting=self.spec.max_waiting,
            role=self.spec.role(self._next - 1),
        )
        self.engines[wid] = eng
        return eng

    def all_engines(self) -> list[SimEngine]:
        """Every engine serving now (their stats add up to the fleet's)."""
        return list(self.engines.values())

    def remove(self, worker_id: str) -> SimEngine:
        eng = self.engines.pop(worker_id, None)
        if eng is None:
            raise TraceError(f"unknown worker {worker_id!r}")
        return eng
