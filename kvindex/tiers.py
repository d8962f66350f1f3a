"""KV storage tiers, fastest first, and the mapping from an event's `medium` string."""
from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    """Where a block sits. Lower value = faster to use; the order is relied upon."""

    GPU = 0
    CPU = 1
    DISK = 2
    REMOTE = 3
    # Held by another worker only: priced at network bandwidth, reached by a peer pull.
    # Never stored in the index; the planner derives it from other workers' matches.
    PEER = 4


# Mediums seen on the wire (vLLM names the device tier "GPU" even on its CPU backend;
# offloading connectors use "CPU"; LMCache/KVBM-style backends name disks and remotes).
_MEDIUMS: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CUDA": Tier.GPU,
    "HBM": Tier.GPU,
    "DEVICE": Tier.GPU,
    "CPU": Tier.CPU,
    "DRAM": Tier.CPU,
    "HOST": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "DISK": Tier.DISK,
    "SSD": Tier.DISK,
    "NVME": Tier.DISK,
    "LOCAL_DISK": Tier.DISK,
    "REMOTE": Tier.REMOTE,
    "REDIS": Tier.REMOTE,
    "VALKEY": Tier.REMOTE,
}

STORED_TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)


def tier_of_medium(medium: str | None) -> tuple[Tier, bool]:
    """Map an event's `medium` to a tier; returns (tier, known).

    `None` is vLLM's default and means the device tier. An unknown medium is not
    trusted as GPU: it is treated as DISK (slow but local) and reported as unknown so
    the caller can count it.
    """
    if medium is None:
        return Tier.GPU, True
    tier = _MEDIUMS.get(medium.upper())
    if tier is None:
        return Tier.DISK, False
    return tier, True


def medium_of_tier(tier: Tier) -> str:
    """The `medium` string our publishers put on the wire for a tier."""
    if tier is Tier.PEER:
        raise ValueError("PEER is a planning tier, never published")
    return tier.name
