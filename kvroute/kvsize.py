"""`kvroute kv-size`: KV-cache bytes per token, per block and per request (docs/design.md §4.5).

    bytes = 2 · B · S · L · H · D · (Q / 8)

2 for keys and values, B requests of S tokens, L layers, H KV heads (the KV heads of
grouped-query attention, not the query heads), D head dimension, Q bits per element
(Llama-3-8B in bf16: 2·32·8·128·16/8 = 131,072 B per token).

A model is given as a Hugging Face `config.json` (or the folder holding it) or as a
profile from `configs/models/` (name or path to its YAML, which uses the config.json
field names). Models that cache a compressed latent instead of per-head K/V
(multi-head latent attention: DeepSeek-V2/V3, any config with `kv_lora_rank`) are
refused: the formula does not describe them.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MODELS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"

# Bits per KV element, by every spelling seen in HF configs and engine flags.
_DTYPE_BITS: dict[str, int] = {
    "fp32": 32, "float32": 32, "float": 32,
    "bf16": 16, "bfloat16": 16,
    "fp16": 16, "float16": 16, "half": 16,
    "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8, "fp8_e4m3fn": 8, "float8_e4m3fn": 8, "float8_e5m2": 8, "fp8_inc": 8,
    "int8": 8, "uint8": 8,
    "int4": 4, "uint4": 4, "fp4": 4, "nvfp4": 4, "mxfp4": 4,
}  # fmt: skip
_MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"}


class ModelGeometryError(ValueError):
    """A model description that cannot give KV sizes (missing, malformed or MLA)."""


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What KV size depends on, with where it came from."""

    name: str
    layers: int
    kv_heads: int
    attention_heads: int
    head_dim: int
    dtype: str  # the model's own dtype (torch_dtype), canonical spelling
    source: str
    max_context_tokens: int | None = None
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class KVSize:
    """KV bytes of one model at one element type."""

    geometry: ModelGeometry
    dtype: str
    bits: int
    bytes_per_token: int
    block_size: int
    bytes_per_block: int
    tokens: int
    batch: int
    bytes_per_request: int  # B requests of S tokens


def dtype_bits(dtype: str) -> int:
    """Bits per element of a dtype name (bf16, float16, fp8_e4m3, int4, ...)."""
    bits = _DTYPE_BITS.get(dtype.strip().lower().removeprefix("torch."))
    if bits is None:
        known = ", ".join(sorted({"fp32", "bf16", "fp16", "fp8", "int8", "int4", "fp4"}))
        raise ModelGeometryError(f"unknown dtype {dtype!r} (known: {known}, and their long names)")
    return bits


def _canonical_dtype(dtype: str) -> str:
    d = dtype.strip().lower().removeprefix("torch.")
    dtype_bits(d)
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(d, d)


def kv_bytes(layers: int, kv_heads: int, head_dim: int, bits: int, tokens: int = 1, batch: int = 1) -> int:
    """2·B·S·L·H·D·(Q/8), rounded up to whole bytes."""
    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("bits", bits)):
        if v <= 0:
            raise ModelGeometryError(f"{name} must be positive, got {v}")
    if tokens < 0 or batch < 0:
        raise ModelGeometryError("tokens and batch must not be negative")
    return -(-2 * batch * tokens * layers * kv_heads * head_dim * bits // 8)


def kv_size(
    geometry: ModelGeometry, *, tokens: int = 8192, batch: int = 1, dtype: str | None = None, block_size: int = 16
) -> KVSize:
    """KV bytes per token, per `block_size`-token block and per request of `tokens` x `batch`."""
    if block_size <= 0:
        raise ModelGeometryError(f"block size must be positive, got {block_size}")
    d = dtype or geometry.dtype
    bits = dtype_bits(d)
    g = geometry
    return KVSize(
        g,
        _canonical_dtype(d),
        bits,
        kv_bytes(g.layers, g.kv_heads, g.head_dim, bits),
        block_size,
        kv_bytes(g.layers, g.kv_heads, g.head_dim, bits, tokens=block_size),
        tokens,
        batch,
        kv_bytes(g.layers, g.kv_heads, g.head_dim, bits, tokens=tokens, batch=batch),
    )


def _int(cfg: dict[str, Any], key: str, where: str) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ModelGeometryError(f"{where}: {key} must be a positive integer, got {v!r}")
    return v


def geometry_from_config(cfg: dict[str, Any], name: str, source: str) -> ModelGeometry:
    """Geometry from HF config.json fields (a `text_config` is used when the top level has none)."""
    if not isinstance(cfg, dict):
        raise ModelGeometryError(f"{source}: not a JSON/YAML object")
    model_type = str(cfg.get("model_type") or "")
    if "kv_lora_rank" in cfg or model_type in _MLA_MODEL_TYPES:
        raise ModelGeometryError(
            f"{source}: {model_type or 'this model'} uses multi-head latent attention (kv_lora_rank="
            f"{cfg.get('kv_lora_rank')}); it caches a compressed latent per token, not per-head K/V, "
            "so 2·L·H·D does not apply"
        )
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, dict):  # multimodal wrappers
        dtype = text.get("torch_dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
        return geometry_from_config({**text, "torch_dtype": dtype}, name, source)
    layers = _int(cfg, "num_hidden_layers", source)
    heads = _int(cfg, "num_attention_heads", source)
    if layers is None or heads is None:
        raise ModelGeometryError(f"{source}: needs num_hidden_layers and num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", source) or heads
    head_dim = _int(cfg, "head_dim", source)
    if head_dim is None:
        hidden = _int(cfg, "hidden_size", source)
        if hidden is None:
            raise ModelGeometryError(f"{source}: needs head_dim or hidden_size")
        if hidden % heads:
            raise ModelGeometryError(f"{source}: hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if not isinstance(dtype, str):
        raise ModelGeometryError(f"{source}: torch_dtype must be a string, got {dtype!r}")
    dtype_bits(dtype)
    return ModelGeometry(
        name=name,
        layers=layers,
        kv_heads=kv_heads,
        attention_heads=heads,
        head_dim=head_dim,
        dtype=_canonical_dtype(dtype),
        source=source,
        max_context_tokens=_int(cfg, "max_position_embeddings", source),
        sliding_window=_int(cfg, "sliding_window", source),
    )


def _load(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ModelGeometryError(f"cannot read {path}: {e.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ModelGeometryError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(data, dict):
        raise ModelGeometryError(f"{path}: expected an object at the top level")
    return data


def profile_names(models_dir: Path = MODELS_DIR) -> list[str]:
    return sorted(p.stem for p in models_dir.glob("*.yaml"))


def load_model_geometry(name_or_path: str | Path, models_dir: Path = MODELS_DIR) -> ModelGeometry:
    """A model's KV geometry from a profile name, a profile YAML, a config.json or its folder."""
    raw = str(name_or_path)
    p = Path(raw).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        profile = models_dir / (raw if raw.endswith(".yaml") else f"{raw}.yaml")
        if "/" not in raw and profile.is_file():
            p = profile
        else:
            known = ", ".join(profile_names(models_dir)) or "none"
            raise ModelGeometryError(
                f"no model {raw!r}: not a config.json, a folder with one, or a profile (known profiles: {known})"
            )
    cfg = _load(p)
    if p.name == "config.json":
        name = str(cfg.get("_name_or_path") or p.parent.name)
    else:
        name = str(cfg.get("name") or p.stem)
    return geometry_from_config(cfg, name, str(p))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def format_table(s: KVSize) -> str:
    g = s.geometry
    attn = "GQA" if g.kv_heads < g.attention_heads else "MHA"
    rows = [
        ("model", f"{g.name}  ({g.source})"),
        ("layers (L)", f"{g.layers}"),
        ("KV heads (H)", f"{g.kv_heads}  ({attn}, {g.attention_heads} attention heads)"),
        ("head dim (D)", f"{g.head_dim}"),
        ("KV dtype (Q)", f"{s.dtype}  ({s.bits} bits)"),
        ("per token", f"{s.bytes_per_token:,} B  ({_human(s.bytes_per_token)})"),
        (f"per block ({s.block_size} tok)", f"{s.bytes_per_block:,} B  ({_human(s.bytes_per_block)})"),
        (f"per request ({s.batch} x {s.tokens:,} tok)", f"{s.bytes_per_request:,} B  ({_human(s.bytes_per_request)})"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(f"{'formula':<{width}}  2·B·S·L·H·D·(Q/8)")
    if g.sliding_window and (g.max_context_tokens is None or g.sliding_window < g.max_context_tokens):
        lines.append(
            f"{'note':<{width}}  sliding_window={g.sliding_window}: "
            "an engine may keep only that many tokens per sequence"
        )
    return "\n".join(lines)


def _positive(v: str) -> int:
    n = int(v)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvroute kv-size",
        description="KV-cache bytes per token, per block and per request: 2·B·S·L·H·D·(Q/8).",
    )
    ap.add_argument("--model", help="config.json, a folder with one, or a profile name/path from configs/models/")
    ap.add_argument("--tokens", "-S", type=_positive, default=8192, help="tokens per request (default 8192)")
    ap.add_argument("--batch", "-B", type=_positive, default=1, help="requests (default 1)")
    ap.add_argument("--dtype", "-Q", default=None, help="KV element type: fp32, bf16, fp16, fp8, int8, int4, ... "
                    "(default: the model's torch_dtype)")  # fmt: skip
    ap.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block (default 16)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--list", action="store_true", help="list the shipped model profiles")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the reason
        return int(e.code or 0)
    if a.list:
        for n in profile_names():
            print(n)
        return 0
    if not a.model:
        ap.print_usage(sys.stderr)
        print("kvroute kv-size: error: --model is required (or --list)", file=sys.stderr)
        return 2
    try:
        geometry = load_model_geometry(a.model)
        s = kv_size(geometry, tokens=a.tokens, batch=a.batch, dtype=a.dtype, block_size=a.block_size)
    except ModelGeometryError as e:
        print(f"kvroute kv-size: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        g = s.geometry
        print(
            json.dumps(
                {
                    "model": g.name,
                    "source": g.source,
                    "layers": g.layers,
                    "kv_heads": g.kv_heads,
                    "head_dim": g.head_dim,
                    "dtype": s.dtype,
                    "bits": s.bits,
                    "bytes_per_token": s.bytes_per_token,
                    "block_size": s.block_size,
                    "bytes_per_block": s.bytes_per_block,
                    "tokens": s.tokens,
                    "batch": s.batch,
                    "bytes_per_request": s.bytes_per_request,
                }
            )
        )
    else:
        print(format_table(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
