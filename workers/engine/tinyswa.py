"""Tiny sliding-window models, made locally from a fixed seed (tests, demos).

`hybrid`: a Qwen2 whose last layers attend within a window and whose first layers attend
to everything (Gemma-style KV groups: full attention next to sliding window); `sliding`:
a Mistral whose every layer attends within the window. Both are the default model's
size (hidden 256, 2 KV heads of 64, vocab 8192) with its tokenizer, so the engine
serves them exactly as a user's folder: `--model DIR`.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from .tiny import ASSETS, TOKENIZER_FILES

KINDS = ("hybrid", "sliding")
_COMMON: dict[str, Any] = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-6, initializer_range=0.1,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)


def write_tiny_sliding_model(folder: Path, *, kind: str = "hybrid", window: int = 40, seed: int = 0) -> Path:
    """Write a tiny sliding-window model of `kind` (see the module doc) into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    if kind == "hybrid":
        config: Any = Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=2, **_COMMON)
    elif kind == "sliding":
        config = MistralConfig(sliding_window=window, **_COMMON)
    else:
        raise ValueError(f"kind must be one of {KINDS}")
    auto: Any = AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / name, folder / name)
    return folder
