"""A faulty worker: a small asyncio HTTP/1.1 server speaking the worker contract of
docs/wire.md (`/health`, `/info`, `/load`, `/metrics`, `/v1/models`, `/v1/completions`,
`/v1/chat/completions`) whose completions misbehave on purpose.

    python -m loadtest.harden.faulty --mode MODE --digest HEX --model ID [--served NAME ...]
        [--kind kvroute|vllm] [--worker-id ID] [--port P] [--tokens N] [--token-delay S]

prints `ready url=http://127.0.0.1:P` once it listens. Standard library only (it starts
in ~0.1 s). The mode can be changed while it runs with `POST /_mode {"mode": M}`;
`GET /_stats` tells what it saw (completion requests, how many are still open, every
request when recording). Modes (what a completion request gets):

    ok            a well-formed answer (a stream of `--tokens` chunks, usage, [DONE])
    hang          nothing, ever (the connection stays open: accepted, never answered)
    stall         200, SSE headers and one chunk, then nothing, ever
    garbage       200 and SSE events whose payloads are not JSON, then [DONE]
    truncated     200, two chunks and half an event, then the connection is closed
    s500          500 with a body full of internal details (paths, hosts, a traceback)
    s429          429 with `Retry-After: 7`
    reset_first   the connection is reset (RST) before any byte
    reset_mid     200 and one chunk, then the connection is reset
    exit_first    the whole process exits before answering (a worker killed before its first byte)
    exit_mid      200 and one chunk, then the whole process exits (killed mid-stream)
    sick          from the first completion on, `/health` and `/load` answer 500 and every
                  completion stalls (odd ones before their first byte, even ones after one chunk)
    record        a plain HTTP service that is no worker: 404 everywhere, every request recorded
    s202          (embeddings) 202 with a prefetch's body: a status no OpenAI route answers
    huge          (embeddings) 200 with an 80 MB JSON answer

`POST /v1/embeddings` gets: nothing in `hang`/`sick`, the 500 of `s500`, the 429 of `s429`,
`s202` and `huge` above, else a two-number vector; each one's `model` and `X-Request-Id`
are in `/_stats`' log. `--events`/`--replay` set what `/info` advertises as its KV-event
endpoints (none by default).

`/health`, `/info`, `/load` and `/v1/models` answer normally in every mode but `sick`
and `record`. Nothing here is imported by the gateway or the workers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import sys
import time
from typing import Any

INTERNAL_MARKER = "INTERNAL-db7.corp.internal:5432"
_TRACEBACK = (
    'Traceback (most recent call last):\n  File "/opt/worker/engine.py", line 412, in step\n'
    f"    conn = connect('{INTERNAL_MARKER}')\nRuntimeError: CUDA error: an illegal memory access was encountered"
)
MODES = ("ok", "hang", "stall", "garbage", "truncated", "s500", "s429", "reset_first", "reset_mid",
         "exit_first", "exit_mid", "sick", "record", "s202", "huge")
_REASONS = {200: "OK", 202: "Accepted", 404: "Not Found", 405: "Method Not Allowed", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


class Faulty:
    def __init__(self, a: argparse.Namespace) -> None:
        self.mode: str = a.mode
        self.kind: str = a.kind
        self.worker_id: str = a.worker_id
        self.model: str = a.model
        self.served: list[str] = a.served or [a.model]
        self.digest: str = a.digest
        self.block_size: int = a.block_size
        self.tokens: int = a.tokens
        self.token_delay: float = a.token_delay
        self.port = 0
        self.completions = 0
        self.open = 0
        self.closed_by_peer = 0
        self.sick = False
        self.log: list[dict[str, Any]] = []
        self.events = {"endpoint": a.events, "replay_endpoint": a.replay, "topic": "kv"} if a.events else None

    # ------------------------------------------------------------------ server

    async def serve(self, port: int) -> None:
        server = await asyncio.start_server(self._conn, "127.0.0.1", port, backlog=1024, limit=1 << 22)
        self.port = server.sockets[0].getsockname()[1]
        print(f"ready url=http://127.0.0.1:{self.port}", flush=True)
        async with server:
            await server.serve_forever()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                req = await _read_request(reader)
                if req is None:
                    return
                keep = await self._handle(req, reader, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            try:
                writer.close()
            except Exception:
                pass

    async def _handle(self, req: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        method, path, query = req["method"], req["path"], req["query"]
        if path == "/_mode" and method == "POST":
            mode = json.loads(req["body"] or b"{}").get("mode")
            if mode not in MODES:
                await _reply(writer, 400, {"error": f"unknown mode {mode!r}"})
                return True
            self.mode = mode
            self.sick = False
            await _reply(writer, 200, {"mode": mode})
            return True
        if path == "/_stats":
            await _reply(writer, 200, {"mode": self.mode, "completions": self.completions, "open": self.open,
                                       "closed_by_peer": self.closed_by_peer, "log": self.log[-200:]})
            return True
        if self.mode == "record":
            self.log.append({"method": method, "path": path, "query": query, "t": time.time(),
                             "authorization": req["headers"].get("authorization")})
            await _reply(writer, 404, {"detail": "Not Found", "service": "internal-billing"})
            return True
        if path in ("/health", "/load", "/metrics") and self.sick:
            await _reply(writer, 500, {"error": {"message": "engine wedged", "type": "internal"}})
            return True
        if path == "/health" and method == "GET":
            await _reply(writer, 200, {"status": "ok"})
        elif path == "/info" and method == "GET":
            await _reply(writer, 200, self._info())
        elif path == "/load" and method == "GET":
            await _reply(writer, 200, self._load())
        elif path == "/metrics" and method == "GET":
            text = ('vllm:num_requests_waiting{model_name="m"} 0\n'
                    f'vllm:num_requests_running{{model_name="m"}} {self.open}\n'
                    'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n')
            await _reply_raw(writer, 200, text.encode(), b"text/plain; version=0.0.4")
        elif path == "/v1/models" and method == "GET":
            await _reply(writer, 200, {"object": "list", "data": [
                {"id": n, "object": "model", "created": 0, "owned_by": "faulty", "root": self.model, "parent": None,
                 "max_model_len": 8192} for n in self.served]})
        elif path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
            return await self._complete(req, path.endswith("/chat/completions"), reader, writer)
        elif path == "/v1/embeddings" and method == "POST":
            return await self._embed(req, reader, writer)
        elif path.startswith("/kv/prefetch"):
            body = json.loads(req["body"] or b"{}") if method == "POST" else {}
            await _reply(writer, 202 if method == "POST" else 200,
                         {"prefetch_id": body.get("prefetch_id", ""), "accepted_blocks": 0, "queued": False})
        elif path == "/kv/purge":
            await _reply(writer, 200, {"purged_blocks": 0})
        else:
            await _reply(writer, 404, {"error": {"message": "unknown path", "type": "invalid_request_error",
                                                 "param": None, "code": "unknown_url"}})
        return True

    def _info(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "kind": "kvroute", "engine": "faulty", "model": self.model,
                "served_model_names": self.served, "namespace_digest": self.digest, "block_size": self.block_size,
                "block_bytes": 65536, "max_context_tokens": 8192, "events": self.events, "remote_group": None,
                "capabilities": ["prefetch", "purge"]}

    def _load(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "ts": time.time(), "waiting_requests": 0, "waiting_prefill_tokens": 0,
                "running_requests": self.open, "running_prefill_tokens": 0, "est_queue_s": 0.0,
                "blocks": {"GPU": {"used": 0, "free": 10000, "capacity": 10000}},
                "speeds": {"prefill_tokens_per_s": 20000.0, "prefill_attn_s_per_token2": 1e-9,
                           "prefill_overhead_s": 0.002, "decode_step_s": 0.002},
                "tiers": {}, "prefetch_queue": 0, "max_waiting": 1024}

    # ------------------------------------------------------------------ completions

    async def _complete(self, req: dict[str, Any], chat: bool, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> bool:
        self.completions += 1
        n_req = self.completions
        try:
            body = json.loads(req["body"] or b"{}")
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        mode = self.mode
        if mode == "sick":
            self.sick = True
            mode = "hang" if n_req % 2 else "stall"
        self.open += 1
        try:
            return await self._answer(mode, body, chat, reader, writer)
        finally:
            self.open -= 1

    async def _answer(self, mode: str, body: dict[str, Any], chat: bool, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        stream = bool(body.get("stream")) or self.kind == "kvroute"
        if mode == "s500":
            await _reply(writer, 500, {"error": {"message": f"engine crashed: {_TRACEBACK}", "type": "internal_error",
                                                 "param": None, "code": None}, "worker": self.worker_id})
            return True
        if mode == "s429":
            await _reply(writer, 429, {"error": {"message": f"queue full on {self.worker_id}", "type": "rate_limit",
                                                 "param": None, "code": None}}, {"retry-after": "7"})
            return True
        if mode == "hang":
            await self._wait_peer(reader)
            return False
        if mode == "reset_first":
            _rst(writer)
            return False
        if mode == "exit_first":
            os._exit(17)
        if not stream:  # a vLLM worker asked for one JSON body
            whole = json.dumps(self._whole(body, chat)).encode()
            if mode == "garbage":
                junk = b'{"choices": [{"text": \x00 not json'
                writer.write(_head(200, b"application/json", {"content-length": str(len(junk))}) + junk)
                await writer.drain()
                return True
            if mode in ("stall", "truncated", "reset_mid", "exit_mid"):
                writer.write(_head(200, b"application/json", {"content-length": str(len(whole))}))
                writer.write(whole[: len(whole) // 2])
                await writer.drain()
                if mode == "stall":
                    await self._wait_peer(reader)
                elif mode == "truncated":
                    writer.close()
                else:
                    await asyncio.sleep(0.05)
                    if mode == "exit_mid":
                        os._exit(17)
                    _rst(writer)
                return False
            await _reply(writer, 200, self._whole(body, chat))
            return True
        writer.write(_head(200, b"text/event-stream", {"transfer-encoding": "chunked", "cache-control": "no-cache"}))
        n = self._n(body)
        if mode == "garbage":
            for junk in (b"data: {not json at all\n\n", b"data: \x00\xff\xfe garbage \x01\n\n",
                         b"data: {\"choices\": \"nope\"\n\n", b"data: [DONE]\n\n"):
                _chunk(writer, junk)
            _end(writer)
            await writer.drain()
            return True
        first = _event(self._chunk(body, chat, 0, n))
        if mode == "truncated":
            _chunk(writer, first + _event(self._chunk(body, chat, 1, n)) + b'data: {"id": "x", "cho')
            await writer.drain()
            writer.close()
            return False
        if mode in ("stall", "reset_mid", "exit_mid"):
            _chunk(writer, first)
            await writer.drain()
            if mode == "reset_mid":
                await asyncio.sleep(0.05)
                _rst(writer)
                return False
            if mode == "exit_mid":
                await asyncio.sleep(0.05)
                os._exit(17)
            await self._wait_peer(reader)
            return False
        # ok; vLLM sends usage on every chunk when both stream options are set
        so = body.get("stream_options")
        per_chunk = self.kind == "vllm" and isinstance(so, dict) and bool(so.get("include_usage")) \
            and bool(so.get("continuous_usage_stats"))
        for i in range(n):
            c = self._chunk(body, chat, i, n)
            if per_chunk:
                c["usage"] = self._usage(body, i + 1)
            _chunk(writer, _event(c))
            await writer.drain()
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
        tail = b""
        if self.kind == "kvroute" or (body.get("stream_options") or {}).get("include_usage"):
            tail = _event({"id": "cmpl-f", "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": 0, "model": self.served[0], "choices": [], "usage": self._usage(body, n)})
        _chunk(writer, tail + b"data: [DONE]\n\n")
        _end(writer)
        await writer.drain()
        return True

    async def _embed(self, req: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """/v1/embeddings in the current mode (module doc)."""
        try:
            body = json.loads(req["body"] or b"{}")
        except ValueError:
            body = {}
        model = body.get("model") if isinstance(body, dict) else None
        self.log.append({"path": "/v1/embeddings", "model": model, "t": time.time(),
                         "x-request-id": req["headers"].get("x-request-id")})
        mode = self.mode
        self.open += 1
        try:
            if mode in ("hang", "sick"):
                await self._wait_peer(reader)
                return False
            if mode in ("s500", "s429"):
                return await self._answer(mode, {}, False, reader, writer)
            if mode == "s202":
                await _reply(writer, 202, {"prefetch_id": "p-1", "accepted_blocks": 0, "queued": True})
                return True
            vec = {"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}
            if mode == "huge":  # chunked: no length to refuse it by, it must be bounded while read
                filler = b"0.125, " * (1 << 17)  # ~0.9 MB per chunk
                writer.write(_head(200, b"application/json", {"transfer-encoding": "chunked"}))
                _chunk(writer, b'{"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [')
                for _ in range(90):
                    _chunk(writer, filler)
                    await writer.drain()
                _chunk(writer, b"1]}]}")
                _end(writer)
                await writer.drain()
                return True
            await _reply(writer, 200, {"object": "list", "data": [vec], "model": model or self.served[0],
                                       "usage": {"prompt_tokens": 2, "total_tokens": 2}})
            return True
        finally:
            self.open -= 1

    async def _wait_peer(self, reader: asyncio.StreamReader) -> None:
        """Hold the request open until the peer closes the connection."""
        try:
            while await reader.read(65536):
                pass
        except (ConnectionError, OSError):
            pass
        self.closed_by_peer += 1

    def _n(self, body: dict[str, Any]) -> int:
        mt = body.get("max_tokens") or body.get("max_completion_tokens") or self.tokens
        return max(1, min(int(mt) if isinstance(mt, int) else self.tokens, self.tokens))

    def _usage(self, body: dict[str, Any], n: int) -> dict[str, Any]:
        prompt = body.get("prompt")
        p = len(prompt) if isinstance(prompt, list) else 8
        u: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
                             "prompt_tokens_details": {"cached_tokens": 0}}
        if "kv" in body:
            u["kv"] = {"loaded_tokens": {"GPU": 0, "CPU": 0, "DISK": 0, "REMOTE": 0, "PEER": 0},
                       "recomputed_tokens": p, "prefetched_tokens": 0, "queue_ms": 0.0, "load_ms": 0.0,
                       "prefill_ms": 1.0, "ttft_ms": 1.0, "decode_ms": 1.0}
        return u

    def _chunk(self, body: dict[str, Any], chat: bool, i: int, n: int) -> dict[str, Any]:
        finish = "length" if i == n - 1 else None
        model = body.get("model") or self.served[0]
        if chat:
            delta: dict[str, Any] = {"content": f"tok{i} "}
            if i == 0:
                delta["role"] = "assistant"
            return {"id": "chatcmpl-f", "object": "chat.completion.chunk", "created": 0, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return {"id": "cmpl-f", "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": f"tok{i} ", "finish_reason": finish, "logprobs": None}]}

    def _whole(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        n = self._n(body)
        text = "".join(f"tok{i} " for i in range(n))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": "cmpl-f", "object": "chat.completion" if chat else "text_completion", "created": 0,
                "model": body.get("model") or self.served[0], "choices": [choice], "usage": self._usage(body, n)}


# ---------------------------------------------------------------------- HTTP plumbing


async def _read_request(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for ln in lines[1:]:
        if ":" in ln:
            k, v = ln.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    path, _, query = target.partition("?")
    body = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    return {"method": method, "path": path, "query": query, "headers": headers, "body": body}


def _head(status: int, ctype: bytes, extra: dict[str, str] | None = None) -> bytes:
    h = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}".encode(), b"content-type: " + ctype]
    for k, v in (extra or {}).items():
        h.append(f"{k}: {v}".encode())
    return b"\r\n".join(h) + b"\r\n\r\n"


async def _reply_raw(writer: asyncio.StreamWriter, status: int, data: bytes, ctype: bytes,
                     extra: dict[str, str] | None = None) -> None:
    writer.write(_head(status, ctype, {**(extra or {}), "content-length": str(len(data))}) + data)
    await writer.drain()


async def _reply(writer: asyncio.StreamWriter, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
    await _reply_raw(writer, status, json.dumps(obj).encode(), b"application/json", extra)


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    if data:
        writer.write(b"%x\r\n" % len(data) + data + b"\r\n")


def _end(writer: asyncio.StreamWriter) -> None:
    writer.write(b"0\r\n\r\n")


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed peer's kernel would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loadtest.harden.faulty", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="ok", choices=MODES)
    ap.add_argument("--kind", default="kvroute", choices=["kvroute", "vllm"])
    ap.add_argument("--worker-id", default="faulty")
    ap.add_argument("--model", required=True)
    ap.add_argument("--served", action="append", default=[])
    ap.add_argument("--digest", default="0" * 64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=8, help="chunks per answer (at most; max_tokens caps it)")
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--events", default=None, help="the KV-event endpoint /info advertises")
    ap.add_argument("--replay", default=None, help="the replay endpoint /info advertises")
    a = ap.parse_args(argv)
    try:
        asyncio.run(Faulty(a).serve(a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
