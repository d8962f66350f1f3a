"""The worker app called in-process: a simulated worker serving under an alias first
(`AliasedDriver`), an httpx client over ASGI (`client`), and `assert_error` (OpenAI's error shape)."""
from __future__ import annotations

from typing import Any

import httpx
import msgspec

from kvwire import WorkerInfo
from workers.sim.driver import SimDriver


class AliasedDriver(SimDriver):
    """A simulated worker serving under an alias first, then the model id."""

    def info(self) -> WorkerInfo:
        return msgspec.structs.replace(super().info(), served_model_names=["alias", "test/model"])


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return dict(err)
