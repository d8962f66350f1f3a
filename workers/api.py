"""The `Engine` interface behind the worker HTTP app (workers/app.py).

One HTTP surface (docs/design.md §4.3, docs/wire.md) serves every engine: the simulated one
(workers/sim/driver.py) now, the real torch engine (workers/engine/) later. The app
speaks OpenAI and the wire contract; an engine only deals in token ids, blocks and
usage. Everything an engine needs to plug in is here:

- `tokenizer`: text → ids (completions with a text prompt, chat template), ids → text.
- `generate(GenRequest) -> GenStream`: raises `workers.errors.EngineError` (400/429/503)
  before accepting; once accepted, the stream yields `GenChunk`s and ends with `usage`
  set, or raises `EngineError` mid-way (the app sends an error event; never silent).
- `prefetch`, `cancel_prefetch`, `purge`, `export_blocks`: the `/kv/*` endpoints.
- `info()`, `load()`: the `/info` (minus URL and event endpoints, which the server adds)
  and `/load` bodies of docs/wire.md, as the `kvwire` structs the gateway decodes.
- `counters()`: engine counters for `/metrics`.
- `draining`: when True, new generations get 503 and `/health` says "draining".

An engine that holds real KV data may also implement `BlockDataExporter`: then
`/kv/blocks` asked with `Accept: application/x-kvroute-kv-records` streams the blocks'
bytes (docs/wire.md § /kv/blocks); the simulated engine prices transfers and does not.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvwire import LoadReport, WorkerInfo
from workers.usage import Usage


@dataclass(slots=True)
class GenRequest:
    """A generation as the engine sees it: token ids in, `max_tokens` out."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    shared_prefix_blocks: int = 0
    lora: str | None = None
    ignore_eos: bool = False
    # OpenAI sampling (None: OpenAI's default). The simulated engine does not sample.
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    # vLLM's extension: no end (EOS, stop string) before this many generated tokens.
    min_tokens: int = 0
    # Log-probabilities of each generated token and of the `logprobs` most likely ones
    # (None: none asked). An engine that cannot give them refuses the request (400).
    logprobs: int | None = None
    # vLLM's prefill/decode disaggregation fields (docs/engine.md § Prefill/decode roles); an
    # engine that cannot take part refuses them (400). An accepted stream may then carry the
    # answer's own `kv_transfer_params` (attribute of that name) once it ends.
    kv_transfer_params: dict[str, Any] | None = None


MAX_LOGPROBS = 20  # most alternatives per token a request may ask log-probabilities of (vLLM's default)


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens' (id, logprob), best first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class GenChunk:
    """Tokens produced since the previous chunk (one step's worth, or more if the reader lagged),
    with one `TokenLogprob` per token when the request asked for them."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


class GenStream(Protocol):
    """An accepted generation. Iterate for chunks; `usage`/`finish_reason` are set at the end."""

    request_id: str
    usage: Usage | None
    finish_reason: str | None

    def __aiter__(self) -> AsyncIterator[GenChunk]: ...

    def cancel(self) -> None:
        """The client went away: stop and free everything (idempotent)."""
        ...


@dataclass(slots=True)
class PeerRef:
    """A worker to pull KV from (`source_peer` of /kv/prefetch)."""

    url: str
    worker_id: str | None = None


@dataclass(slots=True)
class PrefetchSpec:
    prefetch_id: str
    keys: list[bytes]
    deadline_s: float  # relative
    source_peer: PeerRef | None = None


@dataclass(slots=True)
class PrefetchResult:
    prefetch_id: str
    accepted_blocks: int
    queued: bool


@dataclass(slots=True)
class BlockExport:
    """One block a peer can take: where it sits here and what it weighs (+ metadata if known)."""

    key: bytes
    tier: str
    nbytes: int
    meta: dict[str, Any] | None = None


# The binary answer of /kv/blocks (records of workers/engine/store/record.py, one per block).
RECORDS_MEDIA_TYPE = "application/x-kvroute-kv-records"


class BlockDataExporter(Protocol):
    """Optional engine extension: the KV bytes of blocks, for a peer pulling them."""

    def export_block_data(self, keys: list[bytes]) -> AsyncIterator[bytes]:
        """Records of the leading `keys` held here, in order, as byte chunks (stops at the
        first key not held)."""
        ...


class Tokenizer(Protocol):
    max_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Engine(Protocol):
    worker_id: str
    draining: bool

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def info(self) -> WorkerInfo: ...

    def load(self) -> LoadReport: ...

    async def generate(self, req: GenRequest) -> GenStream: ...

    async def prefetch(self, spec: PrefetchSpec) -> PrefetchResult: ...

    def cancel_prefetch(self, prefetch_id: str) -> bool: ...

    def purge(self, cache_salt: str | None, everything: bool) -> int: ...

    def export_blocks(self, keys: list[bytes], with_meta: bool = False) -> list[BlockExport]: ...

    def counters(self) -> dict[str, dict[str, float]]:
        """Monotonic counters: metric name -> {tier label or "": value}."""
        ...


@runtime_checkable
class ServesAdapters(Protocol):
    """An engine that serves LoRA adapters as models of their own (the real one with `--lora`)."""

    def adapters(self) -> dict[str, str]:
        """Adapter name -> the served name of the base model it applies to."""
        ...


@runtime_checkable
class Embeds(Protocol):
    """An engine that answers /v1/embeddings: a unit vector per token sequence."""

    def embed(self, ids: list[int], dimensions: int | None) -> list[float]:
        """Raises ValueError for `dimensions` the engine cannot give (a 400)."""
        ...
