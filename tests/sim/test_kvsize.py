"""`kvroute kv-size`: the KV-bytes formula, model profiles and HF configs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.kvsize import (
    ModelGeometryError,
    dtype_bits,
    kv_bytes,
    kv_size,
    load_model_geometry,
    main,
    profile_names,
)


@pytest.mark.parametrize(
    "profile, per_token",
    [
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072 (docs/design.md §1)
        ("llama-3-70b", 2 * 80 * 8 * 128 * 2),
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),  # head_dim derived: 3584 / 28
        ("mistral-7b", 2 * 32 * 8 * 128 * 2),
    ],
)
def test_shipped_profiles(profile, per_token):
    s = kv_size(load_model_geometry(profile), tokens=8192, block_size=16)
    assert s.bytes_per_token == per_token
    assert s.bytes_per_block == 16 * per_token
    assert s.bytes_per_request == 8192 * per_token
    assert s.dtype == "bf16" and s.bits == 16


def test_llama3_8b_numbers():
    g = load_model_geometry("llama-3-8b")
    assert (g.layers, g.kv_heads, g.attention_heads, g.head_dim) == (32, 8, 32, 128)
    s = kv_size(g, tokens=8192, batch=4, dtype="fp8", block_size=32)
    assert s.bytes_per_token == 65_536 and s.bytes_per_block == 32 * 65_536
    assert s.bytes_per_request == 4 * 8192 * 65_536  # 2·B·S·L·H·D·(Q/8)
    assert kv_size(g, dtype="float32").bytes_per_token == 2 * 131_072
    assert kv_size(g, dtype="int4").bytes_per_token == 131_072 // 4
    assert set(profile_names()) >= {"llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mistral-7b"}


def test_formula():
    assert kv_bytes(layers=4, kv_heads=2, head_dim=64, bits=32) == 4096  # the bundled tiny model, fp32
    assert kv_bytes(4, 2, 64, 32, tokens=10, batch=3) == 30 * 4096
    assert kv_bytes(1, 1, 1, 4) == 1  # half a byte per element, two elements (K and V)
    assert kv_bytes(1, 1, 1, 4, tokens=0) == 0
    with pytest.raises(ModelGeometryError):
        kv_bytes(0, 1, 1, 16)
    assert [dtype_bits(d) for d in ("torch.bfloat16", "FP16", "fp8_e4m3", "int8", "nvfp4")] == [16, 16, 8, 8, 4]
    with pytest.raises(ModelGeometryError, match="unknown dtype"):
        dtype_bits("fp12")


def write(tmp_path: Path, cfg: dict, name: str = "config.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


def test_hf_config_fields_and_fallbacks(tmp_path):
    # no head_dim (hidden_size / heads), `dtype` (transformers 5) instead of torch_dtype
    p = write(tmp_path, {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "hidden_size": 256, "dtype": "float32"})  # fmt: skip
    g = load_model_geometry(p)
    assert (g.layers, g.kv_heads, g.head_dim, g.dtype) == (4, 2, 64, "fp32")
    assert kv_size(g).bytes_per_token == 4096  # 2 · 4 layers · 2 KV heads · 64 · 4 bytes
    assert load_model_geometry(tmp_path) == g  # the folder holding config.json
    # no num_key_value_heads: multi-head attention, every head cached
    p = write(tmp_path, {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512,
                         "torch_dtype": "float16"}, "mha.json")  # fmt: skip
    assert kv_size(load_model_geometry(p)).bytes_per_token == 2 * 2 * 8 * 64 * 2
    # explicit head_dim wins over hidden_size / heads (e.g. Gemma, Qwen3)
    p = write(tmp_path, {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
                         "hidden_size": 512, "head_dim": 128}, "hd.json")  # fmt: skip
    assert load_model_geometry(p).head_dim == 128
    # a multimodal wrapper: the geometry sits in text_config
    p = write(tmp_path, {"model_type": "llava", "torch_dtype": "bfloat16",
                         "text_config": {"num_hidden_layers": 32, "num_attention_heads": 32,
                                         "num_key_value_heads": 8, "hidden_size": 4096}}, "mm.json")  # fmt: skip
    assert kv_size(load_model_geometry(p)).bytes_per_token == 131_072


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128}, "latent attention"),
        ({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "kv_lora_rank": 512}, "latent"),
        ({"num_attention_heads": 2, "hidden_size": 8}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "num_attention_heads": 2}, "head_dim or hidden_size"),
        ({"num_hidden_layers": "32", "num_attention_heads": 2, "hidden_size": 8}, "positive integer"),
        ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 8}, "not a multiple"),
        ({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "torch_dtype": "fp12"}, "unknown dtype"),
    ],
)
def test_bad_configs_are_refused_clearly(tmp_path, cfg, message):
    with pytest.raises(ModelGeometryError, match=message):
        load_model_geometry(write(tmp_path, cfg))


def test_unreadable_inputs(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelGeometryError, match="not valid JSON"):
        load_model_geometry(tmp_path)
    with pytest.raises(ModelGeometryError, match="known profiles"):
        load_model_geometry("no-such-model")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ModelGeometryError, match="object"):
        load_model_geometry(tmp_path / "list.yaml")


def test_cli(capsys, tmp_path):
    assert main(["--model", "llama-3-8b"]) == 0
    out = capsys.readouterr().out
    assert "131,072 B" in out and "2,097,152 B" in out and "1.00 GiB" in out and "GQA" in out
    assert main(["--model", "llama-3-70b", "--tokens", "1000", "--batch", "2", "--dtype", "fp8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bytes_per_token"] == 163_840 and d["bytes_per_request"] == 2 * 1000 * 163_840
    assert main(["--list"]) == 0 and "qwen2.5-7b" in capsys.readouterr().out
    p = write(tmp_path, {"model_type": "deepseek_v2", "kv_lora_rank": 512})
    assert main(["--model", str(p)]) == 2
    assert "latent attention" in capsys.readouterr().err
    assert main(["--model", "llama-3-8b", "--tokens", "0"]) == 2
    assert main([]) == 2
    assert "--model is required" in capsys.readouterr().err
