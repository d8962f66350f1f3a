"""A tiny LoRA adapter for the tiny model, made locally from a fixed seed (tests, demos).

Written in peft's on-disk format (adapter_config.json + adapter_model.safetensors with
peft's key names), so workers/engine/lora.py loads it exactly as it loads a real
adapter. Unlike a freshly initialised peft adapter (whose B is zero), both A and B are
random, so the adapter really changes the model's output.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .lora import CONFIG_FILE, KEY_PREFIX, WEIGHTS_FILE
from .tiny import MODEL_ID

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_tiny_adapter(folder: Path, model: Any, *, seed: int, r: int = 4, alpha: float = 8.0,
                       targets: tuple[str, ...] = TARGETS, std: float = 0.1,
                       base_model: str = MODEL_ID, use_rslora: bool = False) -> Path:
    """Write an adapter for `model` (its `nn.Linear` layers named in `targets`) into `folder`."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for path, mod in model.named_modules():
        if type(mod) is not nn.Linear or path.rpartition(".")[2] not in targets:
            continue
        a = torch.randn((r, mod.in_features), generator=gen) * std
        b = torch.randn((mod.out_features, r), generator=gen) * std
        tensors[f"{KEY_PREFIX}{path}.lora_A.weight"] = a.contiguous()
        tensors[f"{KEY_PREFIX}{path}.lora_B.weight"] = b.contiguous()
    if not tensors:
        raise ValueError(f"the model has no nn.Linear layer named {targets}")
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "inference_mode": True,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder
