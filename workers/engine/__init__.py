"""The real worker engine: a torch + transformers model whose KV lives in GPU → CPU → DISK → REMOTE tiers."""
from __future__ import annotations
