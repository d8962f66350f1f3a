"""`GET /info`: who a worker is and what its KV means (namespace, block size, events).

The gateway registers a worker from it and refuses one whose namespace digest differs
from the model it is configured for; the offline simulator registers its engines the
same way.
"""
from __future__ import annotations

import msgspec


class NamespaceInfo(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """The fields that make a worker's KV (non-)interchangeable (kvindex.keys.Namespace)."""

    model: str = ""
    revision: str = ""
    tokenizer_revision: str = ""
    kv_dtype: str = ""
    parallel: str = ""
    block_size: int = 0


class EventsInfo(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """Where the worker publishes KV events (vLLM's ZMQ format) and answers replays."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = "kv"


class WorkerInfo(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """The `/info` body (docs/wire.md). `url` and `events` are filled by the server."""

    namespace_digest: str
    block_size: int
    worker_id: str = ""
    kind: str = "kvroute"
    engine: str = ""
    model: str = ""
    served_model_names: list[str] = []
    namespace: NamespaceInfo | None = None
    block_bytes: int | None = None
    max_context_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    remote_group: str | None = None
    capabilities: list[str] = []
    profile: str | None = None
    # prefill/decode disaggregation: "prefill", "decode" or "both" (None: not said, as both)
    role: str | None = None
    url: str = ""
    events: EventsInfo | None = None


info_decoder = msgspec.json.Decoder(WorkerInfo)
