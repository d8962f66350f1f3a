"""Reading a worker over HTTP: `/health`, `/info`, `/load` (or vLLM's / SGLang's `/metrics`).

Each read returns a typed answer or None with the reason left in `worker.last_error`,
so the pool's state machine (router/fleet/pool.py) decides what a failure means.
"""
from __future__ import annotations

import aiohttp
import msgspec

from kvwire import LoadReport, WorkerInfo
from kvwire.info import info_decoder
from kvwire.load import load_report_decoder

from ..upstream import http1 as upstream
from .sglang_load import parse_sglang_metrics, sglang_report
from .vllm_load import parse_vllm_metrics, vllm_report
from .worker import Worker


class BadAnswer(ValueError):
    """The worker answered, but not with what the contract says."""


class Probe:
    def __init__(self, session: aiohttp.ClientSession, timeout_s: float, connect_timeout_s: float) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self.timeout_s = timeout_s
        # Set by the gateway: plain-http workers are read over router/upstream/http1.py's keep-alive
        # connections (a load poll every 0.1 s per worker costs a fraction of aiohttp's).
        self.upstream: upstream.UpstreamPool | None = None

    async def fetch(self, w: Worker, path: str) -> bytes | None:
        """The body of a 200, else None with the reason in `w.last_error` (and whether
        nothing listens at all in `w.last_refused`)."""
        w.last_refused = False
        if self.upstream is not None and w.fast_key is not None:
            return await self._fetch_lean(w, w.fast_key, path)
        try:
            async with self.session.get(w.url + path, headers=w.headers(), timeout=self.timeout) as r:
                body = await r.read()
                if r.status != 200:
                    w.last_error = f"GET {path}: HTTP {r.status}"
                    return None
                return body
        except aiohttp.ClientConnectorError as e:
            w.last_refused = isinstance(e.os_error, ConnectionRefusedError)
            w.last_error = f"GET {path}: {type(e).__name__}: {e}"
            return None
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            w.last_error = f"GET {path}: {type(e).__name__}: {e}"
            return None

    async def _fetch_lean(self, w: Worker, key: tuple[str, int], path: str) -> bytes | None:
        assert self.upstream is not None
        try:
            status, body = await upstream.get(self.upstream, key, path, self.timeout_s, w.call_head)
        except ConnectionRefusedError as e:
            w.last_refused = True
            w.last_error = f"GET {path}: {type(e).__name__}: {e}"
            return None
        except (TimeoutError, OSError, ValueError) as e:
            w.last_error = f"GET {path}: {type(e).__name__}: {e}"
            return None
        if status != 200:
            w.last_error = f"GET {path}: HTTP {status}"
            return None
        return body

    async def health(self, w: Worker) -> str | None:
        """The worker's status ("ok", "draining"), or None when `/health` failed."""
        body = await self.fetch(w, "/health")
        if body is None:
            return None
        if w.kind != "kvroute":
            return "ok"
        try:
            st = msgspec.json.decode(body).get("status", "ok")
        except (msgspec.DecodeError, AttributeError):
            return "ok"
        return st if isinstance(st, str) else "ok"

    async def info(self, w: Worker) -> WorkerInfo | None:
        """Our worker's `/info`; raises BadAnswer when it does not parse."""
        body = await self.fetch(w, "/info")
        if body is None:
            return None
        try:
            return info_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadAnswer(f"/info is not valid: {e}") from None

    async def models(self, w: Worker) -> tuple[list[str], dict[str, str]] | None:
        """What `/v1/models` lists: the model names (ids, and the `root` each is an alias
        of) and the LoRA adapters (an entry with a `parent`, as vLLM lists them: name → parent)."""
        body = await self.fetch(w, "/v1/models")
        if body is None:
            return None
        try:
            data = msgspec.json.decode(body).get("data")
            adapters = {m["id"]: m["parent"] for m in data
                        if isinstance(m.get("parent"), str) and isinstance(m["id"], str)}
            names = [m["id"] for m in data if m["id"] not in adapters]
            names += [m["root"] for m in data if isinstance(m.get("root"), str) and m["id"] not in adapters]
        except (msgspec.DecodeError, AttributeError, KeyError, TypeError):
            raise BadAnswer("/v1/models is not an OpenAI model list") from None
        return [n for n in names if isinstance(n, str)], adapters

    async def load(self, w: Worker) -> LoadReport | None:
        """The worker's load: our `/load`, or a vLLM or SGLang server's `/metrics` as a report."""
        if w.kind == "kvroute":
            body = await self.fetch(w, "/load")
            if body is None:
                return None
            try:
                return load_report_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                w.last_error = f"/load: {e}"
                return None
        body = await self.fetch(w, "/metrics")
        if body is None:
            return None
        try:
            rank = w.cfg.data_parallel_rank
            text, r = body.decode(errors="replace"), None if rank is None else str(rank)
            if w.kind == "sglang":
                return sglang_report(parse_sglang_metrics(text, r), w.block_size or w.model.block_size)
            return vllm_report(parse_vllm_metrics(text, r))
        except ValueError as e:
            w.last_error = f"/metrics: {e}"
            return None
