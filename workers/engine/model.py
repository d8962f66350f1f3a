"""Loading a causal LM from a local folder: device, dtype, tokenizer, KV geometry.

A user's model folder loads unchanged through `AutoModelForCausalLM.from_pretrained`,
never from a hub (`local_files_only`). The KV geometry is not read from the config
(field names differ between architectures) but probed: one 1-token forward shows the
cache layers the model really builds: full-attention and sliding-window layers
(docs/engine.md § Sliding-window models) of one shape are accepted, anything else is
refused, since the paged pool holds one shape for every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from workers.tokenizer import SimTokenizer, TokenizerError

from .lora import LoraSet
from .tiny import MODEL_ID, SERVED_ALIASES, ModelError, tiny_model_dir

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What to load and where: `model` is a folder or "default" (the tiny Llama)."""

    model: str = "default"
    model_id: str | None = None  # the namespace's model id; default: "kvroute/tiny-llama" or the folder name
    revision: str = ""
    served_names: tuple[str, ...] = ()
    device: str | None = None  # "cpu" | "cuda" | "cuda:N"; None: CUDA when available
    dtype: str = "auto"
    cache_dir: Path | None = None
    loras: tuple[tuple[str, str], ...] = ()  # (adapter name, folder in peft's format), served as models


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers of one attention kind (vLLM's KV-cache group): full attention or one window."""

    index: int
    window: int | None  # tokens; None: full attention
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        """vLLM's `kv_cache_spec_kind` of the group."""
        return "full_attention" if self.window is None else "sliding_window"


@dataclass(frozen=True, slots=True)
class KVShape:
    """Per-token KV of the model: every layer holds keys and values of [kv_heads, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    windows: tuple[int | None, ...] = ()  # per layer: its sliding window in tokens, None for full attention

    @property
    def groups(self) -> list[KVGroup]:
        """The KV-cache groups as vLLM forms them: one per kind of layer (full attention
        first, then one per window size), each with its layers."""
        windows = self.windows or (None,) * self.layers
        specs = sorted({w for w in windows}, key=lambda w: (w is not None, w or 0))
        return [KVGroup(i, w, tuple(j for j, x in enumerate(windows) if x == w)) for i, w in enumerate(specs)]

    @property
    def window_only(self) -> int | None:
        """The window when every layer has the same one (no layer needs older tokens), else None."""
        ws = set(self.windows)
        w = ws.pop() if len(ws) == 1 else None
        return w

    @property
    def sliding(self) -> bool:
        """True when some layer attends only within a window."""
        return any(w is not None for w in self.windows)

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


class EngineTokenizer:
    """The worker tokenizer (the gateway's rules, workers/tokenizer.py) bounded by the
    model's embedding table, decoding output without special tokens."""

    def __init__(self, folder: Path, vocab_size: int) -> None:
        self._inner = SimTokenizer(folder)
        self.hf = self._inner.hf
        self.max_token_id = vocab_size - 1

    def encode(self, text: str) -> list[int]:
        return self._inner.encode(text)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self._inner.apply_chat_template(messages)

    def decode(self, ids: list[int]) -> str:
        text: str = self.hf.decode(ids, skip_special_tokens=True)
        return text


@dataclass(slots=True)
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: EngineTokenizer
    device: torch.device
    dtype: torch.dtype
    kv: KVShape
    model_id: str
    revision: str
    served_names: list[str]
    max_positions: int
    vocab_size: int
    eos_ids: frozenset[int]
    folder: Path
    lora: LoraSet | None = None  # the LoRA adapters served beside the base model (None: none)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def load_model(spec: ModelSpec) -> LoadedModel:
    """Load the model of `spec` onto its device, with its tokenizer and probed KV shape."""
    from transformers import AutoModelForCausalLM

    default = spec.model == "default"
    folder = tiny_model_dir(spec.cache_dir) if default else Path(spec.model).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} is not a model folder (no config.json)")
    model_id = spec.model_id or (MODEL_ID if default else folder.name)
    names = list(spec.served_names) or [model_id, *(SERVED_ALIASES if default else ())]
    for name, _ in spec.loras:
        if name in (model_id, *names):
            raise ModelError(f"LoRA adapter name {name!r} is already a served model name")
    device = select_device(spec.device)
    dtype = select_dtype(spec.dtype, device, folder)
    auto: Any = AutoModelForCausalLM
    try:
        model = auto.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load the model in {folder}: {e}") from None
    model = model.to(device).eval()
    vocab = int(model.get_input_embeddings().num_embeddings)
    try:
        tokenizer = EngineTokenizer(folder, vocab)
    except TokenizerError as e:
        raise ModelError(str(e)) from None
    kv = probe_kv_shape(model, device)  # before any adapter is attached: the base model's cache
    lora = load_adapters(model, spec.loras, device, dtype) if spec.loras else None
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        kv=kv,
        model_id=model_id,
        revision=spec.revision,
        served_names=names,
        max_positions=int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20),
        vocab_size=vocab,
        eos_ids=_eos_ids(model, tokenizer),
        folder=folder,
        lora=lora,
    )


def load_adapters(model: Any, loras: tuple[tuple[str, str], ...], device: torch.device,
                  dtype: torch.dtype) -> LoraSet:
    """Attach every `(name, folder)` adapter (peft's format) to `model`."""
    out = LoraSet(model)
    for name, folder in loras:
        out.load(name, Path(folder).expanduser().resolve(), device, dtype)
    return out


def select_device(name: str | None) -> torch.device:
    """CUDA when available (or asked for), else CPU; asking for CUDA without it is an error."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"unsupported device {name!r}: use cpu or cuda")
    return dev


def select_dtype(name: str, device: torch.device, folder: Path) -> torch.dtype:
    """`auto`: float32 on CPU (exact and fast enough there); on CUDA the config's half
    precision type if it names one, else bfloat16."""
    if name != "auto":
        if name not in DTYPES:
            raise ModelError(f"unsupported dtype {name!r}: use auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    import json

    cfg = json.loads((folder / "config.json").read_text())
    named = str(cfg.get("dtype") or cfg.get("torch_dtype") or "")
    return DTYPES[named] if named in ("float16", "bfloat16") else torch.bfloat16


def probe_kv_shape(model: Any, device: torch.device) -> KVShape:
    """Run one token and read the cache the model builds: full-attention and sliding-window
    layers of one shape are supported (the pool holds one shape for every layer); linear
    attention, MLA-style caches and anything else are refused."""
    with torch.inference_mode():
        out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    if not isinstance(cache, DynamicCache) or not cache.layers:
        raise ModelError(f"{type(model).__name__} does not build a DynamicCache: not supported by this engine")
    shapes = set()
    windows: list[int | None] = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) \
                or layer.keys is None or layer.values is None:
            raise ModelError(
                f"{type(model).__name__} uses {type(layer).__name__} cache layers (linear attention, ...): only "
                "full-attention and sliding-window models are supported by this engine yet"
            )
        if layer.keys.shape != layer.values.shape:
            raise ModelError("keys and values of different shapes (MLA-style caches) are not supported yet")
        shapes.add((tuple(layer.keys.shape), layer.keys.dtype))
        windows.append(int(layer.sliding_window) if isinstance(layer, DynamicSlidingWindowLayer) else None)
    if len(shapes) != 1:
        raise ModelError("cache layers of different shapes are not supported by this engine yet")
    (shape, dtype) = shapes.pop()
    return KVShape(layers=len(cache.layers), kv_heads=shape[1], head_dim=shape[3], dtype=dtype,
                   windows=tuple(windows) if any(w is not None for w in windows) else ())


def _eos_ids(model: Any, tokenizer: EngineTokenizer) -> frozenset[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    out: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            out.add(eos)
        elif isinstance(eos, (list, tuple)):
            out.update(int(x) for x in eos)
    tok_eos = getattr(tokenizer.hf, "eos_token_id", None)
    if isinstance(tok_eos, int):
        out.add(tok_eos)
    return frozenset(out)
