"""LoRA adapters in the real engine, on the tiny Llama (CPU) with two tiny adapters made
here from fixed seeds in peft's format: an adapter changes the output; its greedy output
equals a plain forward of the base model with the adapter merged into the weights
(W + scale * B A, computed here from the adapter file, not by the engine's code), alone
and in a decode batch mixing base and adapter requests; blocks computed under an adapter
are reused by that adapter only (not by the base model, not by another adapter), also
when the prefix comes back from CPU, DISK or REMOTE; events carry `lora_name`; the HTTP
surface lists adapters in `/v1/models` with their parent and answers an unknown one with
OpenAI's 404; the gateway finds the adapter there and routes `model` = adapter to the worker,
which answers with it and reuses its blocks; `--lora NAME=DIR` on the command line; adapter
folders the engine cannot apply exactly are refused."""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from engine_rig import _redis, below_cpu, make_core, prompt, reference, run, to_cpu
from safetensors.torch import load_file, save_file

from kvindex.events import BlockStored
from kvindex.tiers import Tier
from workers.engine.args import add_arguments, check_arguments
from workers.engine.core import EngineCore
from workers.engine.engine import TorchEngine
from workers.engine.engineconfig import EngineConfig
from workers.engine.lora import LoraSet
from workers.engine.model import LoadedModel, ModelSpec, load_model
from workers.engine.sequence import SamplingParams, Sequence
from workers.engine.server import EngineWorker, ServeOptions
from workers.engine.testing import RedisServer
from workers.engine.tiny import ModelError
from workers.engine.tinylora import write_tiny_adapter

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
BASE = prompt(11, 520)
IDS = BASE[:496] + prompt(12, 37)  # 31 blocks of BASE's prefix, then 37 new tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoadedModel, LoadedModel, dict[str, Path]]]:
    """(the base model alone, the same model serving adapters a1 and a2, their folders)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is faster than two fighting
    root = Path(tmp_path_factory.getbasetemp())
    try:
        spec = ModelSpec(cache_dir=root / "kvroute-cache", device="cpu", dtype="float32")
        base = load_model(spec)
        folders = {"a1": write_tiny_adapter(root / "lora-a1", base.model, seed=1),
                   "a2": write_tiny_adapter(root / "lora-a2", base.model, seed=2, r=2, use_rslora=True)}
        lm = load_model(ModelSpec(cache_dir=spec.cache_dir, device="cpu", dtype="float32",
                                  loras=tuple((n, str(f)) for n, f in folders.items())))
        yield base, lm, folders
    finally:
        torch.set_num_threads(threads)


def merged(base: LoadedModel, folder: Path) -> Any:
    """The base model with the adapter merged into its weights, from the adapter's files."""
    cfg = json.loads((folder / "adapter_config.json").read_text())
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / (r ** 0.5 if cfg.get("use_rslora") else r)
    w = load_file(str(folder / "adapter_model.safetensors"))
    model = copy.deepcopy(base.model)
    paths = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in w}
    assert len(paths) == 16  # q, k, v, o of 4 layers
    with torch.no_grad():
        for p in paths:
            a = w[f"base_model.model.{p}.lora_A.weight"]
            b = w[f"base_model.model.{p}.lora_B.weight"]
            model.get_submodule(p).weight += scale * (b @ a)
    return model


@pytest.fixture(scope="module")
def refs(models: tuple[LoadedModel, LoadedModel, dict[str, Path]]) -> dict[str | None, Any]:
    base, _, folders = models
    return {None: base.model, **{n: merged(base, f) for n, f in folders.items()}}


def check_exact(refs: dict[str | None, Any], lora: str | None, ids: list[int], toks: list[int],
                logits: torch.Tensor) -> None:
    ref_toks, ref_logits = reference(refs[lora], ids, len(toks))
    assert toks == ref_toks
    assert torch.allclose(logits, ref_logits, atol=1e-4), (logits - ref_logits).abs().max()


def serve(core: EngineCore, rid: str, ids: list[int], lora: str | None) -> tuple[list[int], torch.Tensor, Sequence]:
    return run(core, [(rid, ids, lora)])[rid]


def test_adapter_output_differs_from_base_and_equals_merged_weights(
        models: tuple[LoadedModel, LoadedModel, dict[str, Path]], refs: dict[str | None, Any]) -> None:
    _, lm, _ = models
    core = EngineCore(lm, EngineConfig(num_blocks=64, max_num_batched_tokens=512, max_waiting=16))
    ids = prompt(3, 40)
    got = {lora: serve(core, f"r-{lora}", ids, lora) for lora in (None, "a1", "a2")}
    for lora, (toks, logits, _) in got.items():
        check_exact(refs, lora, ids, toks, logits)
    assert got["a1"][0] != got[None][0] and got["a2"][0] != got[None][0] and got["a1"][0] != got["a2"][0]
    assert (got["a1"][1] - got[None][1]).abs().max() > 0.1


def test_a_decode_batch_mixing_base_and_adapters_gives_each_its_own_output(
        models: tuple[LoadedModel, LoadedModel, dict[str, Path]], refs: dict[str | None, Any]) -> None:
    _, lm, _ = models
    core = EngineCore(lm, EngineConfig(num_blocks=64, max_num_batched_tokens=512, max_waiting=16))
    reqs = [("b0", prompt(4, 30), None), ("x1", prompt(5, 45), "a1"), ("x2", prompt(6, 21), "a2"),
            ("y1", prompt(7, 33), "a1"), ("b1", prompt(8, 17), None)]
    batches: list[int] = []
    execute = core.runner.decode

    def decode(seqs: list[Sequence]) -> Any:
        batches.append(len({s.scope.lora for s in seqs}))
        return execute(seqs)

    core.runner.decode = decode  # type: ignore[method-assign]
    out = run(core, reqs)
    assert max(batches) == 3  # base, a1 and a2 rows in one forward
    for rid, ids, lora in reqs:
        toks, logits, _ = out[rid]
        check_exact(refs, lora, ids, toks, logits)


@pytest.mark.parametrize("tier", ["GPU", "CPU", "DISK", "REMOTE"])
def test_adapter_prefix_from_each_tier_is_reused_by_that_adapter_only(
        models: tuple[LoadedModel, LoadedModel, dict[str, Path]], refs: dict[str | None, Any], tier: str,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    _, lm, _ = models
    redis = request.getfixturevalue("redis") if tier == "REMOTE" else None
    core = make_core(lm, tmp_path, disk=tier == "DISK", redis=redis, num_blocks=160)  # no GPU eviction
    try:
        serve(core, "warm", BASE, "a1")
        evs = _events(core)
        gpu = [e for e in evs if isinstance(e, BlockStored) and e.medium == "GPU"]
        assert gpu and all(e.lora_name == "a1" for e in gpu)
        if tier == "CPU":
            to_cpu(core)
        elif tier in ("DISK", "REMOTE"):
            below_cpu(core)
        assert core.tiers is not None
        if tier != "GPU":
            assert not core.blocks.by_key
            below = [e for e in _events(core) if isinstance(e, BlockStored) and e.medium == tier]
            assert below and all(e.lora_name == "a1" for e in below)
        if tier in ("DISK", "REMOTE"):
            assert len(core.tiers.snapshot()[Tier[tier]]) == 32
        # neither the base model nor another adapter finds a1's blocks, in any tier
        for other in (None, "a2"):
            toks, logits, seq = serve(core, f"o-{other}", IDS, other)
            assert seq.usage.cached_tokens == 0 and seq.usage.recomputed_tokens == len(IDS)
            check_exact(refs, other, IDS, toks, logits)
        toks, logits, seq = serve(core, "b", IDS, "a1")
        u = seq.usage
        assert u.cached_tokens == 496 and u.loaded_tokens[tier] == 496 and u.recomputed_tokens == 37
        check_exact(refs, "a1", IDS, toks, logits)
    finally:
        core.close()


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from _redis(tmp_path_factory.mktemp("redis"))


def _events(core: EngineCore) -> list[Any]:
    with core.lock:
        return core.take_events()


async def test_http_lists_adapters_and_serves_them(models: tuple[LoadedModel, LoadedModel, dict[str, Path]],
                                                   refs: dict[str | None, Any]) -> None:
    _, lm, _ = models
    engine = TorchEngine(EngineCore(lm, EngineConfig(num_blocks=64, max_num_batched_tokens=256, max_waiting=8)),
                         calibrate=False)
    w = EngineWorker(engine, ServeOptions())
    await w.start()
    ids = prompt(9, 24)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{w.url}/v1/models") as r:
                cards = {c["id"]: c for c in (await r.json())["data"]}
            assert cards["a1"]["parent"] == cards["a2"]["parent"] == lm.served_names[0]
            assert cards[lm.served_names[0]]["parent"] is None
            async with http.get(f"{w.url}/v1/models/a2") as r:
                assert r.status == 200 and (await r.json())["parent"] == lm.served_names[0]
            for model, lora in (("a1", "a1"), (lm.served_names[0], None)):
                body = {"model": model, "prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
                async with http.post(f"{w.url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    d = await r.json()
                assert d["model"] == model
                assert lm.tokenizer.decode(reference(refs[lora], ids, 5)[0]) == d["choices"][0]["text"]
            for body in ({"model": "nope", "prompt": ids, "max_tokens": 2},
                         {"model": lm.served_names[0], "lora": "nope", "prompt": ids, "max_tokens": 2}):
                async with http.post(f"{w.url}/v1/completions", json=body) as r:
                    err = (await r.json())["error"]
                    assert r.status == 404 and err["code"] == "model_not_found" and "nope" in err["message"]
            body = {"model": "a1", "lora": "a2", "prompt": ids, "max_tokens": 2}
            async with http.post(f"{w.url}/v1/completions", json=body) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "lora"
    finally:
        await w.stop()


def test_adapter_folders_that_cannot_be_applied_exactly_are_refused(
        models: tuple[LoadedModel, LoadedModel, dict[str, Path]], tmp_path: Path) -> None:
    base, _, folders = models
    good = folders["a1"]
    cfg = json.loads((good / "adapter_config.json").read_text())
    w = load_file(str(good / "adapter_model.safetensors"))
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    qa, qb = w[f"{q}.lora_A.weight"], w[f"{q}.lora_B.weight"]

    def folder(name: str, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(config))
        save_file(weights, str(d / "adapter_model.safetensors"))
        return d

    cases = {
        "dora": (dict(cfg, use_dora=True), w, "use_dora"),
        "rank": (dict(cfg, r=8), w, "do not fit"),
        "half": (cfg, {k: v for k, v in w.items() if not k.startswith(f"{q}.lora_B")}, "not both"),
        "nomodule": (cfg, dict(w, **{"base_model.model.model.nope.lora_A.weight": qa.clone(),
                                     "base_model.model.model.nope.lora_B.weight": qb.clone()}), "no module"),
        "embed": (cfg, dict(w, **{"base_model.model.model.embed_tokens.lora_embedding_A": qa.clone()}),
                  "unsupported tensor"),
    }
    for name, (c, ws, msg) in cases.items():
        lora = LoraSet(copy.deepcopy(base.model))
        with pytest.raises(ModelError, match=msg):
            lora.load("x", folder(name, c, ws), torch.device("cpu"), torch.float32)
    with pytest.raises(ModelError, match="already a served model name"):
        load_model(ModelSpec(cache_dir=base.folder.parent, device="cpu", loras=((base.served_names[0], str(good)),)))


def test_lora_flag() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    a = ap.parse_args(["--port", "0", "--lora", "a1=/x", "--lora", "b=/y"])
    assert a.loras == ["a1=/x", "b=/y"] and check_arguments(a) is None
    for bad in (["--lora", "a1"], ["--lora", "=/x"], ["--lora", "a b=/x"], ["--lora", "a=/x", "--lora", "a=/y"]):
        assert check_arguments(ap.parse_args(["--port", "0", *bad])) is not None


def test_lora_flag_builds_an_engine_serving_the_adapter(models: tuple[LoadedModel, LoadedModel, dict[str, Path]],
                                                        tmp_path: Path) -> None:
    from workers.engine.server import build_engine, describe

    base, _, folders = models
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    common = ["--port", "0", "--device", "cpu", "--cache-dir", str(base.folder.parent), "--num-blocks", "16",
              "--no-calibrate"]
    engine = build_engine(ap.parse_args([*common, "--lora", f"sql={folders['a1']}"]))
    assert engine.adapters() == {"sql": base.served_names[0]} and "LoRA adapters sql" in describe(engine)
    with pytest.raises(ModelError, match="not a LoRA adapter folder"):
        build_engine(ap.parse_args([*common, "--lora", f"sql={tmp_path}"]))


async def test_an_adapter_through_the_gateway(models: tuple[LoadedModel, LoadedModel, dict[str, Path]],
                                              refs: dict[str | None, Any]) -> None:
    """The gateway finds the adapter in the worker's /v1/models, sends `model` = the adapter
    to it, and the engine answers with the adapter; a repeat reuses the adapter's blocks,
    the base model does not."""
    import openai

    from router.config import build_config
    from router.server import running_gateway

    _, lm, _ = models
    engine = TorchEngine(EngineCore(lm, EngineConfig(num_blocks=64, max_num_batched_tokens=256, max_waiting=8)),
                         calibrate=False)
    w = EngineWorker(engine, ServeOptions())
    await w.start()
    repo = Path(__file__).resolve().parents[2]
    cfg = build_config({
        "models": [{"id": lm.model_id, "tokenizer": "assets/tiny-tokenizer", "profile": "tiny-cpu"}],
        "workers": [{"id": "w0", "url": w.url, "model": lm.model_id, "kind": "kvroute"}],
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.1, "probe_timeout_s": 2.0},
    }, repo / "configs", environ={})
    ids = prompt(10, 70)
    try:
        async with running_gateway(cfg, ready_timeout=20.0) as (gw, url):
            deadline = time.monotonic() + 20
            while "a1" not in gw.models.get(lm.model_id).adapters:
                assert time.monotonic() < deadline, "the gateway did not list the adapter"
                await asyncio.sleep(0.05)
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
            try:
                assert "a1" in [m.id for m in (await c.models.list()).data]
                want = lm.tokenizer.decode(reference(refs["a1"], ids, 5)[0])
                cached = []
                for model in ("a1", "a1", lm.model_id):
                    r = await c.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0,
                                                   extra_body={"ignore_eos": True})
                    assert r.model == model
                    if model == "a1":
                        assert r.choices[0].text == want
                    details = r.usage.prompt_tokens_details if r.usage is not None else None
                    cached.append(details.cached_tokens if details is not None else None)
                assert cached == [0, 64, 0]
            finally:
                await c.close()
    finally:
        await w.stop()
