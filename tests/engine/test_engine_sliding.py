"""Sliding-window models in the real engine (CPU): a tiny hybrid Qwen2 (two full-attention
layers, two of a 40-token window) and a tiny Mistral whose every layer has the window, both
made here from a fixed seed. Prompts far longer than the window give the greedy tokens and
last logits of a plain transformers forward (whose own cache keeps only the window), with
chunked prefill, in a left-padded decode batch of mixed lengths, and for a 31-block prefix
loaded from GPU, CPU, DISK and REMOTE; the window really changes the output (the same
weights without it answer otherwise); the KV events name each block once per KV group with
the group's kind and window, as vLLM publishes them; only the window's blocks stay referenced
when every layer is windowed, and a prefix hit then needs only them (vLLM's rule, which the
gateway's index applies to these events and credits the same)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_rig import _redis, below_cpu, make_core, prompt, reference, run, to_cpu

from kvindex.events import BlockRemoved, BlockStored
from kvindex.index import PrefixIndex
from kvindex.keys import digests64
from kvindex.tiers import Tier
from workers.engine.core import EngineCore
from workers.engine.engineconfig import EngineConfig
from workers.engine.model import LoadedModel, ModelSpec, load_model
from workers.engine.sequence import SamplingParams
from workers.engine.testing import RedisServer
from workers.engine.tinyswa import write_tiny_sliding_model

WINDOW = 40
BASE = prompt(21, 520)
IDS = BASE[:496] + prompt(22, 37)  # 31 blocks of BASE's prefix, then 37 new tokens


@pytest.fixture(scope="module", params=["hybrid", "sliding"])
def lm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is faster than two fighting
    try:
        folder = write_tiny_sliding_model(tmp_path_factory.mktemp(request.param) / "m", kind=request.param,
                                          window=WINDOW)
        yield load_model(ModelSpec(model=str(folder), device="cpu", dtype="float32"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from _redis(tmp_path_factory.mktemp("redis"))


def check_exact(lm: LoadedModel, ids: list[int], toks: list[int], logits: torch.Tensor) -> None:
    ref_toks, ref_logits = reference(lm.model, ids, len(toks))
    assert toks == ref_toks
    assert torch.allclose(logits, ref_logits, atol=1e-4), (logits - ref_logits).abs().max()


def test_geometry_and_the_window_changes_the_output(lm: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    groups = lm.kv.groups
    if lm.kv.windows[0] is None:  # hybrid
        assert [(g.kind, g.window, g.layers) for g in groups] == [("full_attention", None, (0, 1)),
                                                                   ("sliding_window", WINDOW, (2, 3))]
    else:
        assert [(g.kind, g.window, g.layers) for g in groups] == [("sliding_window", WINDOW, (0, 1, 2, 3))]
    auto: Any = AutoModelForCausalLM
    no_window: dict[str, Any] = {"sliding_window": None}
    if lm.model.config.model_type == "qwen2":
        no_window["layer_types"] = ["full_attention"] * 4
    full = auto.from_pretrained(lm.folder, local_files_only=True, **no_window).eval()
    ids = prompt(23, 200)
    assert reference(full, ids, 6)[0] != reference(lm.model, ids, 6)[0]


def test_chunked_prefill_and_a_mixed_decode_batch_equal_full_recompute(lm: LoadedModel) -> None:
    core = EngineCore(lm, EngineConfig(num_blocks=96, max_num_batched_tokens=64, max_waiting=16))
    reqs: list[tuple[str, list[int], str | None]] = [
        ("a", prompt(24, 150), None), ("b", prompt(25, 61), None), ("c", prompt(26, 23), None)]
    out = run(core, reqs)
    for rid, ids, _ in reqs:
        toks, logits, _ = out[rid]
        check_exact(lm, ids, toks, logits)


@pytest.mark.parametrize("tier", ["GPU", "CPU", "DISK", "REMOTE"])
def test_prefix_from_each_tier_equals_full_recompute(lm: LoadedModel, tier: str, tmp_path: Path,
                                                     request: pytest.FixtureRequest) -> None:
    redis = request.getfixturevalue("redis") if tier == "REMOTE" else None
    core = make_core(lm, tmp_path, disk=tier == "DISK", redis=redis)
    try:
        run(core, [("warm", BASE, None)])
        groups = lm.kv.groups
        gpu = [e for e in _events(core) if isinstance(e, BlockStored) and e.medium == "GPU"]
        per = {g.index: {h for e in gpu if e.group_idx == g.index for h in e.block_hashes} for g in groups}
        assert len(per[0]) == 32 and all(per[g.index] == per[0] for g in groups)
        assert all((e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (groups[e.group_idx].kind,
                                                                               groups[e.group_idx].window)
                   for e in gpu if e.group_idx is not None)
        if tier == "CPU":
            to_cpu(core)
        elif tier in ("DISK", "REMOTE"):
            below_cpu(core)
        if tier != "GPU":
            evs = _events(core)
            gone = [e for e in evs if isinstance(e, BlockRemoved) and e.medium == "GPU"]
            assert {e.group_idx for e in gone} == {g.index for g in groups}
            assert {h for e in gone if e.group_idx == groups[-1].index for h in e.block_hashes} == per[0]
            assert not core.blocks.by_key
        if tier in ("DISK", "REMOTE"):
            assert core.tiers is not None and len(core.tiers.snapshot()[Tier[tier]]) == 32
        toks, logits, seq = run(core, [("b", IDS, None)])["b"]
        u = seq.usage
        assert u.cached_tokens == 496 and u.loaded_tokens[tier] == 496 and u.recomputed_tokens == 37
        check_exact(lm, IDS, toks, logits)
    finally:
        core.close()


def _events(core: EngineCore) -> list[Any]:
    with core.lock:
        return core.take_events()


def test_only_the_window_stays_referenced(lm: LoadedModel) -> None:
    """Every layer windowed: a sequence keeps references only to the blocks its next tokens
    attend to, so two requests whose whole KV exceeds the pool run side by side, exactly,
    the released blocks evicted under them. Full-attention layers (hybrid) keep everything."""
    core = EngineCore(lm, EngineConfig(num_blocks=40, max_num_batched_tokens=64, max_waiting=16))
    peak: dict[str, int] = {}
    trimmed: dict[str, int] = {}
    commit = core.commit

    def counting(plan: Any, res: Any) -> Any:
        out = commit(plan, res)
        for s in core.seqs.values():
            peak[s.request_id] = max(peak.get(s.request_id, 0), sum(b >= 0 for b in s.block_table))
            trimmed[s.request_id] = max(trimmed.get(s.request_id, 0), s.num_trimmed)
        return out

    core.commit = counting  # type: ignore[method-assign]
    reqs: list[tuple[str, list[int], str | None]] = [("a", BASE, None), ("b", prompt(27, 300), None)]
    out = run(core, reqs)
    for rid, ids, _ in reqs:
        toks, logits, _ = out[rid]
        check_exact(lm, ids, toks, logits)
    if lm.kv.window_only is not None:
        # the window's ceil(39 / 16) = 3 blocks, a 64-token chunk's 4, and the partial ones at both ends
        assert max(peak.values()) <= 3 + 4 + 2
        assert core.stats.preemptions == 0 and core.blocks.evicted > 0
        assert trimmed["a"] >= 28 and trimmed["b"] >= 14
    else:
        assert peak["a"] == 33 and core.stats.preemptions > 0 and not any(trimmed.values())


def test_a_windowed_prefix_hit_needs_only_the_blocks_before_its_end(lm: LoadedModel) -> None:
    """Every layer windowed: a prefix whose first 20 blocks were evicted is still a hit, since
    the next token attends only to the last ceil(39 / 16) = 3 blocks (vLLM's rule); with
    full-attention layers (hybrid) the same prefix is a miss. kvindex's PrefixIndex, fed the
    engine's group events, credits exactly that."""
    core = EngineCore(lm, EngineConfig(num_blocks=96, max_num_batched_tokens=512, max_waiting=16))
    run(core, [("warm", BASE, None)])
    keys = core.new_sequence("k", IDS, SamplingParams()).keys
    with core.lock:
        blocks = core.blocks
        for k in reversed(keys[:20]):
            blocks.cached.move_to_end(blocks.by_key[k], last=False)
        assert blocks.evict_cached(20) == 20
        assert not any(k in blocks.by_key for k in keys[:20]) and all(k in blocks.by_key for k in keys[20:31])
    # the gateway's index, fed this engine's events, credits what the engine will reuse
    index = PrefixIndex(block_size=16)
    index.add_worker("w", core.namespace.digest, 16, trusted_digests=True)
    index.apply("w", _events(core))
    credited = index.match(digests64(keys), max_blocks=(len(IDS) - 1) // 16).get("w")
    toks, logits, seq = run(core, [("b", IDS, None)])["b"]
    check_exact(lm, IDS, toks, logits)
    if lm.kv.window_only is not None:
        assert seq.usage.cached_tokens == 496 and seq.usage.recomputed_tokens == 37
        assert credited is not None and credited.blocks == 31
    else:
        assert seq.usage.cached_tokens == 0 and credited is None
