"""KV events as vLLM publishes them for a model with KV-cache groups (sliding-window layers)."""
from __future__ import annotations

import msgspec

from kvindex.events import BlockRemoved, BlockStored, KVEvent

from .model import KVGroup


def per_group(events: list[KVEvent], groups: list[KVGroup] | None) -> list[KVEvent]:
    """The events as vLLM publishes them for a model with KV groups (sliding-window
    layers): each block event once per group, with the group's index, kind and window.
    Every pool block holds every layer, so every group holds what the event names.
    `groups` None (full attention only): the events as they are, without group fields."""
    if not groups:
        return events
    out: list[KVEvent] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.extend(msgspec.structs.replace(e, group_idx=g.index, kv_cache_spec_kind=g.kind,
                                               kv_cache_spec_sliding_window=g.window) for g in groups)
        elif isinstance(e, BlockRemoved):
            out.extend(msgspec.structs.replace(e, group_idx=g.index) for g in groups)
        else:
            out.append(e)
    return out
