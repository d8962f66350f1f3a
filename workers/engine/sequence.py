"""One request inside the engine: its tokens, its blocks, its keys, its sampling and timings.

A sequence's token list is the prompt followed by what it generated; `num_computed` of
them have their KV in the pool. The engine computes `num_tokens - num_computed` tokens
for it per step at most: many while prefilling, one while decoding. After preemption it
starts over from `num_computed = 0` with the same token list (recompute), finding its
own released blocks again through the prefix cache when they were not evicted meanwhile.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvindex.keys import ROOT_KEY, BlockHasher, ExtraKeys, Namespace
from workers.api import MAX_LOGPROBS
from workers.blockmeta import BlockMeta
from workers.usage import Usage

from .detok import OutputText


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI's fields; temperature 0 is greedy)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # no EOS, no stop string before this many generated tokens (vLLM's)
    logprobs: int | None = None  # logprobs of each token and of this many most likely (None: none)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class KeyScope:
    """Chained block keys of one request's scope (LoRA, cache salt, shared prefix), exactly
    as the gateway computes them (`BlockHasher.keys_for` under the scoped namespace), and
    extended block by block over generated tokens."""

    __slots__ = ("hasher", "ns", "salt", "salt_from", "lora", "_default", "_marked")

    def __init__(self, hasher: BlockHasher, ns: Namespace) -> None:
        self.hasher = hasher
        self.ns = ns
        self.salt = ns.wire_salt
        self.salt_from = max(0, ns.shared_prefix_blocks)
        self.lora = ns.lora
        layout = ns.extra_layout()
        self._default: ExtraKeys | None = layout[0] if layout is not None else None
        self._marked: dict[int, ExtraKeys] = dict(layout[1]) if layout is not None else {}

    def prompt_keys(self, tokens: list[int]) -> list[bytes]:
        return self.hasher.keys_for(tokens, self.ns)

    def extra(self, i: int) -> ExtraKeys | None:
        """Block i's extra keys (what `Namespace.extra_keys` gives for it)."""
        return self._marked.get(i, self._default)

    def next_key(self, parent: bytes | None, block_tokens: list[int], i: int) -> bytes:
        """Key of block i from its parent's key and its tokens."""
        return self.hasher.keys(block_tokens, [self.extra(i)], parent=parent if parent is not None else ROOT_KEY)[0]

    def salt_of(self, i: int) -> str | None:
        """The salt a purge of it drops block i with (blocks after the shared prefix)."""
        return self.salt if self.salt and i >= self.salt_from else None


class SeqStatus(enum.Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3
    LOADING = 4  # admitted, its cached prefix moving up from lower tiers (vLLM's WAITING_FOR_REMOTE_KVS)


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    scope: KeyScope
    keys: list[bytes]  # chained keys of full blocks known so far (the prompt's at first)
    arrival: float
    text: OutputText
    usage: Usage
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0  # leading blocks registered under their keys
    num_trimmed: int = 0  # leading blocks no longer referenced: out of every layer's window (table entry -1)
    registrable: bool = True  # False once a block of its chain was purged under it
    cached_hint: int = 0  # prompt tokens of its leading blocks held in some tier when it arrived (for /load)
    aborted: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    first_scheduled: float | None = None
    loaded_at: float | None = None  # when its loads from lower tiers ended (None: it loaded nothing)
    loading: Any = None  # its load in flight (workers/engine/loads.py `Load`) while LOADING
    first_token: float | None = None
    last_token: float | None = None
    generator: torch.Generator | None = None
    # a prefill for a remote decode: its prompt's blocks are pinned under this id as it finishes
    pd_pin: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def cacheable_blocks(self) -> int:
        """Leading blocks a prefix hit may cover: the last token is always computed (its logits)."""
        return (self.num_tokens - 1) // self.scope.hasher.block_size

    def key(self, i: int) -> bytes:
        """Key of full block i, chained on from the known keys (blocks of generated tokens)."""
        bs = self.scope.hasher.block_size
        while len(self.keys) <= i:
            j = len(self.keys)
            parent = self.keys[j - 1] if j else None
            self.keys.append(self.scope.next_key(parent, self.token_ids[j * bs : (j + 1) * bs], j))
        return self.keys[i]

    def block_meta(self, i: int) -> BlockMeta:
        """What `BlockStored` says about block i (parent, tokens, extra keys, LoRA)."""
        bs = self.scope.hasher.block_size
        parent = self.key(i - 1) if i else None
        return BlockMeta(parent, tuple(self.token_ids[i * bs : (i + 1) * bs]), 0, self.scope.extra(i), self.scope.lora)
