"""The KV pool: one preallocated tensor on the device, and the model's view of it.

Layout `[num_blocks, block_size, layers, 2, kv_heads, head_dim]`: a block is one
contiguous run of bytes (stage 2 offloads and loads blocks as such), and a token's slot
`block * block_size + offset` indexes a flat `[slots, layers, 2, kv_heads, head_dim]`
view, so one layer's K/V of any set of tokens is a single `index_select`.

`PagedCache` is a transformers `Cache` whose layers write the new tokens' K/V straight
into their pool slots and hand attention the context gathered from the pool, one layer
at a time: only one layer's gathered context is alive at once, never the whole batch's.
Rows of a batch are left-padded to the longest context; the padding is masked by the
attention mask the runner passes, so what it points at never matters.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .model import KVShape


class KVPool:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.data = torch.zeros(
            (num_blocks, block_size, shape.layers, 2, shape.kv_heads, shape.head_dim), dtype=shape.dtype, device=device
        )
        self.slots = self.data.view(num_blocks * block_size, shape.layers, 2, shape.kv_heads, shape.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.shape.token_bytes * self.block_size

    def block(self, block_id: int) -> torch.Tensor:
        """One block's tensor `[block_size, layers, 2, kv_heads, head_dim]` (a view)."""
        return self.data[block_id]

    def slot_ids(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slots of token positions [start, end) of a sequence with this block table."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        blocks = torch.tensor(block_table[first : last + 1], dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)
        return slots[start - first * bs : end - first * bs]

    def cache(self, context: torch.Tensor | None, new: torch.Tensor) -> PagedCache:
        """A cache over the pool for one forward: `context` [batch, T] slots to attend to
        (None: nothing before), `new` [batch * q] slots the new tokens' K/V go to."""
        ctx = context.to(self.device, non_blocking=True) if context is not None else None
        dst = new.to(self.device, non_blocking=True)
        return PagedCache([_PagedLayer(self.slots[:, i], ctx, dst) for i in range(self.shape.layers)])


class PagedCache(Cache):
    """transformers `Cache` over pool slots (see the module doc)."""

    def __init__(self, layers: list[_PagedLayer]) -> None:
        super().__init__(layers=list(layers))


class _PagedLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One layer: `update` writes the new K/V to the pool, returns context + new."""

    def __init__(self, pool: torch.Tensor, context: torch.Tensor | None, new: torch.Tensor) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._pool = pool  # [slots, 2, kv_heads, head_dim], a strided view of the pool
        self._context = context
        self._new = new
        self._past = 0 if context is None else int(context.shape[1])
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, q, d = key_states.shape
        kv = torch.stack((key_states, value_states), dim=1)  # [b, 2, h, q, d]
        self._pool.index_copy_(0, self._new, kv.permute(0, 3, 1, 2, 4).reshape(b * q, 2, h, d))
        if self._context is None:
            return key_states, value_states
        past = self._pool.index_select(0, self._context.reshape(-1)).view(b, self._past, 2, h, d)
        keys = torch.cat((past[:, :, 0].transpose(1, 2), key_states), dim=2)
        values = torch.cat((past[:, :, 1].transpose(1, 2), value_states), dim=2)
        return keys, values

    def get_seq_length(self) -> int:
        return self._past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._past + query_length, 0

    def get_max_length(self) -> int:
        return -1
