"""Profiles: block bytes = 2·layers·kv_heads·head_dim·dtype_bytes·block_size, GPU KV blocks
from memory minus weights, 128k context on the H200 profiles, every number sourced, and
bad profiles refused with the field path.

The block bytes are checked against the formula here and against kvroute/kvsize.py
(`load_model_geometry` + `kv_size`, `kv_bytes`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvroute import kvsize
from workers.sim.profile import PROFILES_DIR, ProfileError, load_profile, profile_from_dict

NAMES = ["h200-llama3.1-8b", "h200-llama3.1-70b-tp8", "tiny-cpu"]
# Published geometry of the models (config.json of each), for an independent check.
GEOMETRY = {
    "h200-llama3.1-8b": (32, 8, 128, 2),
    "h200-llama3.1-70b-tp8": (80, 8, 128, 2),
    "tiny-cpu": (4, 2, 64, 4),
}


@pytest.mark.parametrize("name", NAMES)
def test_block_bytes_formula(name: str) -> None:
    p = load_profile(name)
    layers, kv_heads, head_dim, dtype_bytes = GEOMETRY[name]
    assert p.block_bytes == 2 * layers * kv_heads * head_dim * dtype_bytes * p.block_size
    assert p.with_block_size(64).block_bytes == 4 * p.block_bytes
    # capacities are bytes: the pool holds the same memory at any block size
    assert abs(p.with_block_size(64).gpu_blocks() * 4 - p.gpu_blocks()) < 4
    assert p.gpu_blocks() == int((p.memory.device_bytes * p.memory.memory_utilization - p.memory.weights_bytes
                                  - p.memory.reserved_bytes) // p.block_bytes)


def test_known_values() -> None:
    assert load_profile("h200-llama3.1-8b").geometry.bytes_per_token == 131072  # docs/design.md §1
    assert load_profile("tiny-cpu").geometry.bytes_per_token == 4096  # 2 · 4 layers · 2 heads · 64 · 4 B (fp32)


@pytest.mark.parametrize("name", NAMES)
def test_block_bytes_match_kvroute_kvsize(name: str, tmp_path: Path) -> None:
    """The same number from `kvroute kv-size` (a HF config.json of the profile's geometry)."""
    p = load_profile(name)
    g = p.geometry
    dtype = {2: "bfloat16", 4: "float32"}[g.dtype_bytes]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "num_hidden_layers": g.layers, "num_key_value_heads": g.kv_heads, "num_attention_heads": g.kv_heads * 4,
        "hidden_size": g.head_dim * g.kv_heads * 4, "head_dim": g.head_dim, "torch_dtype": dtype,
    }))
    size = kvsize.kv_size(kvsize.load_model_geometry(str(cfg)), block_size=p.block_size)
    assert size.bytes_per_token == g.bytes_per_token
    assert size.bytes_per_block == p.block_bytes
    assert kvsize.kv_bytes(g.layers, g.kv_heads, g.head_dim, 8 * g.dtype_bytes, tokens=p.block_size) == p.block_bytes


@pytest.mark.parametrize("name", NAMES[:2])
def test_h200_profiles(name: str) -> None:
    p = load_profile(name)
    assert p.max_context_tokens == 131072
    assert p.gpu_blocks() * p.block_size > 4 * 131072  # several full-context requests fit
    assert p.cpu is not None and p.disk is not None and p.remote is not None and p.peer is not None
    assert p.cpu.read_Bps > p.remote.read_Bps and p.cpu.read_Bps > p.disk.read_Bps


@pytest.mark.parametrize("name", NAMES)
def test_every_number_is_sourced(name: str) -> None:
    """Each numeric setting carries its source (or the reason for it) as a comment on its line."""
    lines = (PROFILES_DIR / f"{name}.yaml").read_text().splitlines()
    num = re.compile(r"^\s*[a-z_A-Z]+:\s*[-0-9.e+]+\s*(#.*)?$")
    numeric = [(i, line) for i, line in enumerate(lines) if num.match(line)]
    assert len(numeric) > 20
    for i, line in numeric:
        assert "#" in line, f"{name}.yaml line {i + 1} has no source comment: {line.strip()}"


def test_bad_profiles_are_refused_with_the_field() -> None:
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("no-such-profile")
    good = load_profile("tiny-cpu")
    data = {
        "name": "x", "model": "m", "geometry": {"layers": 1, "kv_heads": 1, "head_dim": 8, "dtype_bytes": 2},
        "memory": {"device_bytes": 1e6, "memory_utilization": 1.0, "weights_bytes": 0},
        "compute": {"prefill_tokens_per_s": 1, "prefill_attn_s_per_token2": 0, "prefill_overhead_s": 0,
                    "decode_base_s": 0, "decode_per_seq_s": 0, "decode_per_ctx_token_s": 0},
    }
    assert profile_from_dict(data).block_bytes == 32 * 16
    with pytest.raises(ProfileError, match="geometry.layers"):
        profile_from_dict({**data, "geometry": {**data["geometry"], "layers": "many"}})
    with pytest.raises(ProfileError, match="bogus"):
        profile_from_dict({**data, "bogus": 1})
    with pytest.raises(ProfileError, match="no device memory"):
        profile_from_dict({**data, "memory": {**data["memory"], "weights_bytes": 2e6}})
    assert good.names()[0] == "kvroute/tiny-llama"


def test_tiny_cpu_profile_matches_the_real_engine(tmp_path: Path) -> None:
    """configs/profiles/tiny-cpu.yaml is calibrated from the torch engine (workers/engine/
    calibration.py): its prefill formula and its CPU/DISK link costs stay within a factor of 2
    (either way) of a fresh measurement by the engine: the time of a 1k and of a 4k-token miss
    (chunks of the profile's token budget, taken round-robin after a warm-up; the minimum,
    as calibrated: other work on the machine only ever slows compute) and of a request's
    255-block load from each tier (the median: load times spread both ways from run to run).
    The bound is wide because the profile was measured on one host and the test runs on
    whichever host runs it: on one quiet machine, within one hour, the 1k miss took 82.5 and
    111-126 ms (profile 105.9), a CPU load 4.2 and 7.4 ms (profile 5.3), a DISK load 13.8 and
    25.8 ms (profile 17.3); a CI host copied memory faster (a CPU load in 3.3 ms). A profile
    off by 2x or more, as a wrong unit or a stale formula would be, still fails it.
    A quantity out of bounds gets more samples, up to four rounds in all. Still out of bounds
    while the machine ran more than a job per core (load average above the core count), the
    timings measured the neighbours, not the engine: the test then skips, loudly, with them."""
    import os
    import statistics
    import warnings

    torch = pytest.importorskip("torch")
    load_before = os.getloadavg()[0]
    from workers.engine.calibration import bench_core, load_samples, time_prefill
    from workers.engine.model import ModelSpec, load_model

    prof = load_profile("tiny-cpu")
    c = prof.compute
    budget = prof.scheduler.max_num_batched_tokens
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibrated
    core = None
    try:
        lm = load_model(ModelSpec(cache_dir=tmp_path / "kvroute-cache"))
        core = bench_core(lm, tmp_path, budget=budget)
        assert core.pool.block_bytes == prof.block_bytes and budget == 2048
        chunks = ((1024, 0), (2048, 0), (2048, 2048))  # a 1k miss; a 4k miss in two budget-sized chunks
        time_prefill(core, chunks, 1)  # warm-up
        want = {"prefill 1024": c.prefill_s(1024, 0), "prefill 4096": c.prefill_s(2048, 0) + c.prefill_s(2048, 2048)}
        for tier, spec in (("CPU", prof.cpu), ("DISK", prof.disk)):
            assert spec is not None
            want[f"{tier} load"] = spec.latency_s + 255 * prof.block_bytes / spec.read_Bps
        samples: dict[str, list[float]] = {k: [] for k in want}

        def sample(keys: set[str]) -> None:
            if keys & {"prefill 1024", "prefill 4096"}:
                for _ in range(3):
                    t = time_prefill(core, chunks, 1)
                    samples["prefill 1024"].append(t[1024, 0])
                    samples["prefill 4096"].append(t[2048, 0] + t[2048, 2048])
            for tier in ("CPU", "DISK"):
                if f"{tier} load" in keys:
                    samples[f"{tier} load"] += load_samples(core, tier, 255, 5, seed=1)

        def stat(k: str) -> float:
            return min(samples[k]) if k.startswith("prefill") else statistics.median(samples[k])

        def off() -> set[str]:
            return {k for k, w in want.items() if max(w / stat(k), stat(k) / w) > 2.0}

        sample(set(want))
        for _ in range(3):
            if not off():
                break
            sample(off())
        got = {k: stat(k) for k in samples}
        report = "; ".join(f"{k}: engine {got[k] * 1e3:.1f} ms (of {len(samples[k])}), profile "
                           f"{w * 1e3:.1f} ms ({w / got[k] - 1:+.0%})" for k, w in want.items())
        busy = max(os.getloadavg()[0], load_before)
        if off() and busy > (os.cpu_count() or 1):
            msg = f"!!! tiny-cpu calibration NOT checked: the machine was busy (load average {busy:.1f}): {report}"
            warnings.warn(msg, stacklevel=1)
            pytest.skip(msg)
        assert not off(), report
    finally:
        if core is not None:
            core.close()
        torch.set_num_threads(threads)
