"""LoRA adapters: loaded from folders in peft's on-disk format, applied per sequence.

An adapter folder holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`base_model_name_or_path`, optionally `use_rslora`) and `adapter_model.safetensors`
with peft's key names: `base_model.model.<module path>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). The weights, not `target_modules`, say which linear
layers an adapter changes; each must exist in the base model with matching shapes.

Every targeted `nn.Linear` is wrapped once (`LoraLinear`); the wrapper computes
`W x + scale * B (A x)` for the rows of the batch whose sequence runs under an adapter
of that layer, and `W x` for the others. Which rows run under which adapter is set for
one forward by `LoraSet.active(names)` (one name per batch row, None for the base
model), so base and adapter requests share a decode batch and each gets its own
output. Options that change the arithmetic (DoRA, fan-in-fan-out weights, trained
biases, per-module rank or alpha patterns, embedding adapters, extra saved modules)
are refused when loading, never ignored.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .args import ADAPTER_NAME as _NAME
from .tiny import ModelError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One loaded adapter: its name (the model id clients ask for) and what it changes."""

    name: str
    folder: Path
    r: int
    alpha: float
    scale: float
    base_model: str  # `base_model_name_or_path` of its config (informative only)
    modules: tuple[str, ...]  # module paths of the base model it changes


class _Active:
    """Which batch rows run under which adapter during the current forward."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        # (adapter name, row indices or None for the whole batch)
        self.groups: list[tuple[str, torch.Tensor | None]] = []


class LoraLinear(nn.Module):
    """A base `nn.Linear` plus, per adapter, `scale * B (A x)` on that adapter's rows."""

    def __init__(self, base: nn.Linear, state: _Active) -> None:
        super().__init__()
        self.base = base
        self._state = state
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        for name, rows in self._state.groups:
            w = self.adapters.get(name)
            if w is None:
                continue
            a, b, scale = w
            if rows is None:
                y = y + scale * F.linear(F.linear(x, a), b)
            else:
                delta = scale * F.linear(F.linear(x.index_select(0, rows), a), b)
                y = y.index_add(0, rows, delta)
        return y


class LoraSet:
    """The adapters a model serves and the wrappers that apply them."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.adapters: dict[str, LoraAdapter] = {}
        self._state = _Active()
        self._wrapped: dict[str, LoraLinear] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def __len__(self) -> int:
        return len(self.adapters)

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def load(self, name: str, folder: Path, device: torch.device, dtype: torch.dtype) -> LoraAdapter:
        """Read a peft adapter folder and attach it under `name`. Raises ModelError."""
        if not _NAME.match(name):
            raise ModelError(f"bad LoRA adapter name {name!r}: letters, digits and ._:/@+- only")
        if name in self.adapters:
            raise ModelError(f"LoRA adapter {name!r} is given twice")
        cfg, r, alpha, scale = _read_config(folder)
        weights = _read_weights(folder)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in weights.items():
            m = _KEY.match(key)
            if m is None:
                raise ModelError(f"{folder / WEIGHTS_FILE}: unsupported tensor {key!r} (only lora_A / lora_B "
                                 "weights of linear layers are supported)")
            pairs.setdefault(m.group("path"), {})[m.group("ab")] = t
        if not pairs:
            raise ModelError(f"{folder / WEIGHTS_FILE} holds no LoRA weights")
        staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise ModelError(f"{folder}: module {path} has lora_{''.join(sorted(ab))} but not both A and B")
            target = self._linear(path, folder)
            a, b = ab["A"], ab["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape != (r, target.in_features) \
                    or b.shape != (target.out_features, r):
                raise ModelError(
                    f"{folder}: {path} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit r={r} and "
                    f"the base layer [{target.out_features}, {target.in_features}]")
            staged[path] = (a.to(device=device, dtype=dtype).contiguous(),
                            b.to(device=device, dtype=dtype).contiguous())
        for path, (a, b) in staged.items():
            self._wrap(path).adapters[name] = (a, b, scale)
        adapter = LoraAdapter(name, folder, r, alpha, scale, str(cfg.get("base_model_name_or_path") or ""),
                              tuple(sorted(staged)))
        self.adapters[name] = adapter
        return adapter

    @contextlib.contextmanager
    def active(self, names: Sequence[str | None], device: torch.device) -> Iterator[None]:
        """Run the forward inside under one adapter (or none) per batch row."""
        if not self.adapters or not any(names):
            yield
            return
        groups: list[tuple[str, torch.Tensor | None]] = []
        if all(n == names[0] for n in names):
            groups.append((str(names[0]), None))
        else:
            rows: dict[str, list[int]] = {}
            for i, n in enumerate(names):
                if n:
                    rows.setdefault(n, []).append(i)
            groups = [(n, torch.tensor(ix, dtype=torch.long, device=device)) for n, ix in rows.items()]
        for n, _ in groups:
            if n not in self.adapters:
                raise KeyError(f"LoRA adapter {n!r} is not loaded")
        self._state.groups = groups
        try:
            yield
        finally:
            self._state.groups = []

    def _linear(self, path: str, folder: Path) -> nn.Linear:
        wrapped = self._wrapped.get(path)
        if wrapped is not None:
            return wrapped.base
        try:
            mod = self.model.get_submodule(path)
        except AttributeError:
            raise ModelError(f"{folder}: the base model has no module {path}") from None
        if type(mod) is not nn.Linear:
            raise ModelError(f"{folder}: {path} is a {type(mod).__name__}; only nn.Linear layers take LoRA here")
        return mod

    def _wrap(self, path: str) -> LoraLinear:
        wrapped = self._wrapped.get(path)
        if wrapped is None:
            parent_path, _, attr = path.rpartition(".")
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
            wrapped = LoraLinear(getattr(parent, attr), self._state)
            setattr(parent, attr, wrapped)
            self._wrapped[path] = wrapped
        return wrapped


def _read_config(folder: Path) -> tuple[dict[str, Any], int, float, float]:
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{folder} is not a LoRA adapter folder ({CONFIG_FILE}: {e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{folder / CONFIG_FILE} is not a JSON object")
    ptype = cfg.get("peft_type", "LORA")
    if ptype != "LORA":
        raise ModelError(f"{folder}: peft_type {ptype!r} is not supported (LORA only)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ModelError(f"{folder / CONFIG_FILE}: r must be a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ModelError(f"{folder / CONFIG_FILE}: lora_alpha must be a positive number")
    refused = {
        "use_dora": bool(cfg.get("use_dora")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
        "bias": cfg.get("bias", "none") not in (None, "none"),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "modules_to_save": bool(cfg.get("modules_to_save")),
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ModelError(f"{folder / CONFIG_FILE}: {', '.join(bad)} not supported by this engine's LoRA")
    scale = float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return cfg, r, float(alpha), scale


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ModelError(f"{folder}: no {WEIGHTS_FILE} (only safetensors adapters are loaded)")
    try:
        return load_file(str(path), device="cpu")
    except (OSError, SafetensorError) as e:
        raise ModelError(f"cannot read {path}: {e}") from None

