"""The model runner: forward passes over the pool, nothing else (no scheduling, no sampling).

A step runs each prefill chunk as its own forward (batch 1, no padding: a chunk's length
is the budget's business) and every one-token sequence (decodes, and prompts cached up
to their last token) as one batched forward, rows left-padded to the longest context
with an attention mask and explicit positions. Measured on a 2-core CPU host (tiny model): padding
costs little next to one forward per sequence, and the results equal each sequence run
alone to ~1e-5 (tests/engine/test_engine_core.py).

A model whose every layer attends within a window gets only the window's tokens as
context (the rows right-aligned as before, so the model's sliding-window mask, which
compares a query's and a key's places in the row, sees their true distances); the
blocks before it may be released (workers/engine/blocks.py `trim`).

LoRA: each forward runs every row under its sequence's adapter (`Sequence.scope.lora`,
None for the base model; workers/engine/lora.py), so a batch may mix them.

Only the last position's logits are computed (`logits_to_keep=1`). Every timing covers
building the inputs and the forward, between synchronisations of the compute stream, so
on CUDA it measures the work, not its launch (and not the tiers' copies on their streams).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from .kvpool import KVPool
from .lora import LoraSet
from .sequence import Sequence


@dataclass(frozen=True, slots=True)
class Timed:
    """What a forward computed and how long it took (seconds, device work included)."""

    logits: torch.Tensor
    seconds: float


class ModelRunner:
    def __init__(self, model: Any, pool: KVPool, device: torch.device, lora: LoraSet | None = None, *,
                 window: int | None = None) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.lora = lora
        self.window = window  # every layer attends within this many tokens: gather only them

    def _first_seen(self, start: int) -> int:
        """The first position a token at `start` or later attends to."""
        return max(0, start - self.window + 1) if self.window is not None else 0

    def prefill(self, seq: Sequence, n: int) -> Timed:
        """Compute tokens [num_computed, num_computed + n) of one sequence; last logits [vocab]."""
        t0 = self._now()
        start, end = seq.num_computed, seq.num_computed + n
        table = seq.block_table
        first = self._first_seen(start)
        context = self.pool.slot_ids(table, first, start)[None] if start > first else None
        cache = self.pool.cache(context, self.pool.slot_ids(table, start, end))
        ids = torch.tensor([seq.token_ids[start:end]], dtype=torch.long)
        pos = torch.arange(start, end, dtype=torch.long)[None]
        logits = self._forward(ids, pos, cache, None, [seq.scope.lora])
        return Timed(logits[0], self._now() - t0)

    def decode(self, seqs: list[Sequence]) -> Timed:
        """One token for each sequence, batched; last logits [batch, vocab]."""
        t0 = self._now()
        lens = [s.num_computed for s in seqs]
        firsts = [self._first_seen(n) for n in lens]
        seen = [n - f for n, f in zip(lens, firsts, strict=True)]  # context tokens each row attends to
        width = max(seen)
        context = torch.zeros((len(seqs), width), dtype=torch.long) if width else None
        mask = torch.zeros((len(seqs), width + 1), dtype=torch.long)
        for row, (s, n, f, c) in enumerate(zip(seqs, lens, firsts, seen, strict=True)):
            if c and context is not None:
                context[row, width - c :] = self.pool.slot_ids(s.block_table, f, n)
            mask[row, width - c :] = 1
        new = torch.cat([self.pool.slot_ids(s.block_table, n, n + 1) for s, n in zip(seqs, lens, strict=True)])
        cache = self.pool.cache(context, new)
        ids = torch.tensor([[s.token_ids[n]] for s, n in zip(seqs, lens, strict=True)], dtype=torch.long)
        pos = torch.tensor(lens, dtype=torch.long)[:, None]
        logits = self._forward(ids, pos, cache, mask if width and min(seen) < width else None,
                               [s.scope.lora for s in seqs])
        return Timed(logits, self._now() - t0)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: Any, mask: torch.Tensor | None,
                 adapters: list[str | None]) -> torch.Tensor:
        dev = self.device
        lora = self.lora.active(adapters, dev) if self.lora is not None else contextlib.nullcontext()
        with torch.inference_mode(), lora:
            out = self.model(
                input_ids=ids.to(dev, non_blocking=True),
                position_ids=pos.to(dev, non_blocking=True),
                attention_mask=mask.to(dev, non_blocking=True) if mask is not None else None,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def _now(self) -> float:
        if self.device.type == "cuda":  # this stream only: the tiers' copies run on their own streams
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()
