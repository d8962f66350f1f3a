"""A scriptable fake worker (docs/wire.md surface) for failure injection in gateway tests.

The simulated fleet (workers/) is what the behaviour tests run against; this fake exists
for what a healthy simulator never does on cue: refuse, 500, die mid-stream, report a
foreign namespace, stall. It is served by uvicorn on a free 127.0.0.1 port in the
test's own loop. The module also checks itself (one test at the bottom).
"""
from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from hangs import patience

_enc = msgspec.json.Encoder()


@dataclass
class FakeWorker:
    worker_id: str
    namespace_digest: str
    model: str = "test-model"  # what /v1/models lists
    adapters: tuple[str, ...] = ()  # LoRA adapters /v1/models lists after it (parent: the model)
    block_size: int = 16
    block_bytes: int = 2097152
    capabilities: tuple[str, ...] = ("prefetch", "purge")
    fail_status: int | None = None  # answer completions with this status
    fail_message: str | None = None  # ... and this error message (default: "injected <status>")
    die_after_chunks: int | None = None  # close the connection after N chunks
    stall_after_chunks: int | None = None  # say nothing more after N chunks (a hung worker)
    first_delay_s: float = 0.0
    headers_delay_s: float = 0.0  # say nothing, not even the status line, for this long
    garbage: bool = False  # answer 200 with bodies / events that are not JSON
    stream_as_json: bool = False  # answer a stream request with one JSON body
    kind: str = "kvroute"  # how the gateway's config registers it ("vllm", "sglang": pass-through)
    token_delay_s: float = 0.0
    load: dict[str, Any] = field(default_factory=dict)
    completions: list[dict[str, Any]] = field(default_factory=list)
    prefetches: list[dict[str, Any]] = field(default_factory=list)
    deleted_prefetches: list[str] = field(default_factory=list)
    purges: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    health_status: int = 200
    health_state: str = "ok"  # what /health says: "ok" or "draining"
    cached_tokens: int = 0  # what usage reports as cached
    gpu_blocks: int | None = None  # vLLM's num_gpu_blocks in /metrics (None: not exported)
    prompt_skew: int = 0  # counts this many more prompt tokens than the bundled tokenizer (a mis-keyed worker)
    embeddings: list[dict[str, Any]] = field(default_factory=list)
    embedding_headers: list[dict[str, str]] = field(default_factory=list)
    embeddings_status: int = 200  # answer /v1/embeddings with this status ...
    embeddings_body: bytes | None = None  # ... and this body (default: a two-number vector)
    embeddings_delay_s: float = 0.0  # say nothing, not even the status line, for this long
    completion_headers: list[dict[str, str]] = field(default_factory=list)  # each completion request's headers
    probes: list[dict[str, Any]] = field(default_factory=list)  # speed probes at join (x-kvroute-probe)
    probe_tps: float | None = None  # answer probes as an engine of this prefill speed (None: at once)
    probe_overhead_s: float = 0.0
    probe_status: int = 200
    events: dict[str, Any] | None = None  # what /info advertises as its KV-event endpoints
    api_key: str | None = None  # like `vllm --api-key`, but on every path: 401 without `Bearer <key>`
    authorized_paths: list[str] = field(default_factory=list)  # paths of the requests that carried the key
    unauthorized: list[str] = field(default_factory=list)  # paths refused for want of it
    # A vLLM prefill server with a KV connector: a request whose `kv_transfer_params` ask
    # for a remote decode is answered with these bytes as its answer's `kv_transfer_params`.
    kv_transfer_answer: bytes | None = None
    role: str = "both"  # how the gateway's config registers it
    bodies: list[bytes] = field(default_factory=list)  # each completion request's body, as sent
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def info(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "kind": "kvroute",
            "engine": "fake",
            "model": "fake-model",
            "namespace_digest": self.namespace_digest,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "max_context_tokens": 131072,
            "events": self.events,
            "remote_group": None,
            "capabilities": list(self.capabilities),
        }

    def load_report(self) -> dict[str, Any]:
        base = {
            "worker_id": self.worker_id,
            "ts": 0.0,
            "waiting_requests": 0,
            "waiting_prefill_tokens": 0,
            "running_requests": 0,
            "running_prefill_tokens": 0,
            "est_queue_s": 0.0,
            "blocks": {"GPU": {"used": 0, "free": 1000, "capacity": 1000}},
            "speeds": {"prefill_tokens_per_s": 35000.0, "prefill_attn_s_per_token2": 1e-9,
                       "prefill_overhead_s": 0.003, "decode_step_s": 0.006},
            "tiers": {"CPU": {"read_Bps": 5e10, "latency_s": 1e-5}},
            "prefetch_queue": 0,
            "max_waiting": 256,
        }
        base.update(self.load)
        return base

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break

        async def reply(status: int, obj: Any) -> None:
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": _enc.encode(obj)})

        if self.api_key is not None:
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.api_key}":
                self.unauthorized.append(path)
                await reply(401, {"error": "Unauthorized"})
                return
            self.authorized_paths.append(path)

        if path == "/health":
            await reply(self.health_status, {"status": self.health_state})
        elif path == "/info":
            await reply(200, self.info())
        elif path == "/load":
            await reply(200, self.load_report())
        elif path == "/metrics" and self.kind == "sglang":  # as SGLang exports it (--enable-metrics)
            lr = self.load_report()
            lb = 'model_name="m",engine_type="unified",tp_rank="0",pp_rank="0"'
            text = (f'sglang:num_queue_reqs{{{lb}}} {lr["waiting_requests"]}\n'
                    f'sglang:num_running_reqs{{{lb}}} {lr["running_requests"]}\n'
                    f'sglang:token_usage{{{lb}}} 0.25\nsglang:num_used_tokens{{{lb}}} 2048.0\n')
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": text.encode()})
        elif path == "/metrics":  # as vLLM exports it
            lr = self.load_report()
            text = (f'vllm:num_requests_waiting{{model_name="m"}} {lr["waiting_requests"]}\n'
                    f'vllm:num_requests_running{{model_name="m"}} {lr["running_requests"]}\n'
                    'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n')
            if self.gpu_blocks is not None:
                text += f'vllm:cache_config_info{{num_gpu_blocks="{self.gpu_blocks}"}} 1.0\n'
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": text.encode()})
        elif path == "/kv/prefetch" and method == "POST":
            d = msgspec.json.decode(body)
            self.prefetches.append(d)
            await reply(202, {"prefetch_id": d["prefetch_id"], "accepted_blocks": 1, "queued": True})
        elif path.startswith("/kv/prefetch/") and method == "DELETE":
            self.deleted_prefetches.append(path.rsplit("/", 1)[1])
            await reply(200, {})
        elif path == "/kv/purge":
            self.purges.append(msgspec.json.decode(body))
            await reply(200, {"purged_blocks": 3})
        elif path == "/v1/models":
            cards = [{"id": self.model, "object": "model", "root": self.model, "parent": None}]
            cards += [{"id": a, "object": "model", "root": f"/adapters/{a}", "parent": self.model}
                      for a in self.adapters]
            await reply(200, {"object": "list", "data": cards})
        elif path == "/v1/embeddings":
            self.embeddings.append(msgspec.json.decode(body))
            self.embedding_headers.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
            await asyncio.sleep(self.embeddings_delay_s)
            if self.embeddings_body is not None:
                await send({"type": "http.response.start", "status": self.embeddings_status,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": self.embeddings_body})
                return
            await reply(self.embeddings_status, {"object": "list", "data": [
                {"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
                "model": self.model, "usage": {"prompt_tokens": 2, "total_tokens": 2}})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            hdrs = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            if "x-kvroute-probe" in hdrs:  # the gateway measuring a worker's speed at join
                await self._probe(msgspec.json.decode(body), reply)
                return
            self.completion_headers.append(hdrs)
            self.bodies.append(body)
            await self._complete(msgspec.json.decode(body), reply, send, receive, path.endswith("chat/completions"))
        else:
            await reply(404, {"error": {"message": "no", "type": "x", "param": None, "code": None}})

    async def _probe(self, req: dict[str, Any], reply: Any) -> None:
        """A speed probe: answered at once, or as an engine of `probe_tps` tokens/s would."""
        self.probes.append(req)
        n = len(req["prompt"])
        if self.probe_status != 200:
            await reply(self.probe_status, {"error": {"message": "no", "type": "x", "param": None, "code": None}})
            return
        if self.probe_tps:
            await asyncio.sleep(self.probe_overhead_s + n / self.probe_tps)
        await reply(200, {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": n, "completion_tokens": 1,
                                    "prompt_tokens_details": {"cached_tokens": 0}}})

    async def _complete(self, req: dict[str, Any], reply: Any, send: Any, receive: Any, chat: bool) -> None:
        """As vLLM answers: streamed or whole, chat or completion, usage when asked for;
        `kv` timings only for the gateway's requests to our workers (they carry `kv`)."""
        self.completions.append(req)
        if self.fail_status is not None:
            msg = self.fail_message or f"injected {self.fail_status}"
            await reply(self.fail_status, {"error": {"message": msg, "type": "x", "param": None, "code": None}})
            return
        await asyncio.sleep(self.headers_delay_s)
        n = int(req.get("max_tokens") or req.get("max_completion_tokens") or 4)
        usage = self._usage(req, chat, n)
        if self.garbage:
            await self._garbage(bool(req.get("stream")), send)
            return
        if not req.get("stream") or self.stream_as_json:
            await asyncio.sleep(self.first_delay_s)
            whole = _whole(chat, n, usage)
            kvp = req.get("kv_transfer_params")
            if self.kv_transfer_answer is not None and isinstance(kvp, dict) and kvp.get("do_remote_decode"):
                whole["kv_transfer_params"] = msgspec.Raw(self.kv_transfer_answer)
            await reply(200, whole)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        me = asyncio.current_task()

        async def watch() -> None:  # as a real worker does: the client leaving cancels the request
            while True:
                if (await receive())["type"] == "http.disconnect":
                    if me is not None:
                        me.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        so = req.get("stream_options") or {}
        # vLLM: usage on every chunk only when both are set
        per_chunk = usage if so.get("include_usage") and so.get("continuous_usage_stats") else None
        try:
            await asyncio.sleep(self.first_delay_s)
            for i in range(n):
                if self.die_after_chunks is not None and i >= self.die_after_chunks:
                    raise ConnectionResetError("injected death")
                if self.stall_after_chunks is not None and i >= self.stall_after_chunks:
                    await asyncio.Event().wait()  # until the client goes away
                await send({"type": "http.response.body", "body": _event(_chunk(chat, i, n, per_chunk)),
                            "more_body": True})
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
            tail = b""
            if (req.get("stream_options") or {}).get("include_usage"):
                tail = _event({"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": 0, "model": self.model, "choices": [], "usage": usage})
            await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
        except asyncio.CancelledError:
            self.cancelled += 1
        finally:
            watcher.cancel()

    @staticmethod
    async def _garbage(stream: bool, send: Any) -> None:
        ct = b"text/event-stream" if stream else b"application/json"
        body = b"data: {not json at all\n\ndata: [DONE]\n\n" if stream else b"<html>oops</html>"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ct)]})
        await send({"type": "http.response.body", "body": body})

    def _usage(self, req: dict[str, Any], chat: bool, n: int) -> dict[str, Any]:
        p = _prompt_tokens(req, chat) + self.prompt_skew
        usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
                                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if "kv" in req:
            usage["kv"] = {"loaded_tokens": {"GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 0, "PEER": 0},
                           "recomputed_tokens": p, "prefetched_tokens": 0, "queue_ms": 0.0, "load_ms": 0.0,
                           "prefill_ms": 1.0, "ttft_ms": 1.0, "decode_ms": 1.0}
        return usage


def _event(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


def _chunk(chat: bool, i: int, n: int, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    finish = "length" if i == n - 1 else None
    if chat:
        delta: dict[str, Any] = {"content": f"t{i} "} if i else {"role": "assistant", "content": f"t{i} "}
        c = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    else:
        c = {"id": "x", "object": "text_completion", "created": 0, "model": "fake-model",
             "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": finish, "logprobs": None}]}
    if usage is not None:
        c["usage"] = usage
    return c


def _whole(chat: bool, n: int, usage: dict[str, Any]) -> dict[str, Any]:
    text = "".join(f"t{i} " for i in range(n))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": "x", "object": "chat.completion" if chat else "text_completion", "created": 0,
            "model": "fake-model", "choices": [choice], "usage": usage}


@functools.cache
def _tokenizer() -> Any:
    """The bundled tokenizer, as a vLLM on the bundled model folder uses it."""
    from router.intake.tokenize import Tokenizer

    return Tokenizer(Path(__file__).resolve().parents[2] / "configs/assets/tiny-tokenizer")


def _prompt_tokens(req: dict[str, Any], chat: bool) -> int:
    """Prompt tokens as a vLLM on the bundled model folder would count them."""
    prompt = req.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    tok = _tokenizer()
    if chat:
        msgs = [{"role": "system" if m["role"] == "developer" else m["role"],
                 "content": m["content"] if isinstance(m.get("content"), str) else
                 "".join(p.get("text", "") for p in m.get("content") or [] if p.get("type") == "text")}
                for m in req["messages"]]
        return len(tok.encode_text(tok.render_chat(msgs), False))
    return len(tok.encode_text(str(prompt), True))


@asynccontextmanager
async def serve_fake(worker: FakeWorker) -> AsyncIterator[FakeWorker]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    worker.port = sock.getsockname()[1]
    cfg = uvicorn.Config(worker, loop="none", lifespan="off", access_log=False, log_level="critical")
    server = uvicorn.Server(cfg)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.005)
    try:
        yield worker
    finally:
        server.should_exit = True
        server.force_exit = True
        try:
            await asyncio.wait_for(task, patience(5))
        except (TimeoutError, Exception):
            task.cancel()
        sock.close()
