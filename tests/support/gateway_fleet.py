"""The gateway in-process against scriptable fake workers: the test model, its namespace digest,
a tenant key and an admin token; `_cfg` (a small config), `fleet` (fakes served, gateway running),
`client` (an `openai` client closed with its fleet), `wait_until`, and raw-HTTP helpers."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import openai
from fakes import FakeWorker, serve_fake
from hangs import patience

from kvindex.keys import Namespace
from router.config import Config, build_config
from router.fleet.fleetconfig import WorkerConfig
from router.server import running_gateway

MODEL = "test-model"
DIGEST = Namespace(MODEL).digest.hex()
KEY = "sk-tenant-a-123456"
ADMIN = "admin-token-123456"


def _cfg(**over: Any) -> Config:
    data: dict[str, Any] = {
        "models": [{"id": MODEL, "served_names": ["alias"], "tokenizer": "configs/assets/tiny-tokenizer",
                    "max_context_tokens": 512}],
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.1, "unhealthy_after": 2, "probe_timeout_s": 0.5},
        "routing": {"policy": "kv_cost", "retries": 1},
    }
    for k, v in over.items():
        data[k] = v
    return build_config(data, environ={})


@asynccontextmanager
async def fleet(
    fakes: list[FakeWorker], cfg: Config | None = None, ready: bool = True
) -> AsyncIterator[tuple[Any, str]]:
    cfg = cfg or _cfg()
    async with AsyncExitStack() as st:
        for f in fakes:
            await st.enter_async_context(serve_fake(f))
        cfg.workers = cfg.workers + [WorkerConfig(id=f.worker_id, url=f.url, model=MODEL, kind=f.kind,  # type: ignore[arg-type]
                                                  role=f.role)
                                     for f in fakes]
        gw, url = await st.enter_async_context(running_gateway(cfg, ready_timeout=5.0 if ready else None))
        try:
            yield gw, url
        finally:
            for c in _CLIENTS.pop(url, []):
                await c.close()


async def wait_until(cond: Any, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `cond()` until it holds; fail the test with `what` when `timeout` passes."""
    deadline = asyncio.get_running_loop().time() + patience(timeout)
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


_CLIENTS: dict[str, list[openai.AsyncOpenAI]] = {}  # closed by `fleet` before its loop ends


def client(url: str, key: str = "none") -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)
    _CLIENTS.setdefault(url, []).append(c)
    return c


async def _raw(
    url: str, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=body, headers={"content-type": "application/json", **(headers or {})}) as r:
            return r.status, await r.json(content_type=None), dict(r.headers)


def _shape(body: dict[str, Any]) -> dict[str, Any]:
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err
