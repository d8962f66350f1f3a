"""Open-loop replay of a trace over HTTP against any OpenAI-compatible URL.

Requests leave at the trace's timestamps divided by `speed`, whatever the server
does (open loop: a slow server faces the same arrivals, as in production). At most
`concurrency` requests are in flight; a request arriving when the bound is reached
waits on the client, and that wait is recorded per request (`client_queue_s`) and
shown in the report — never silently folded into the schedule. Latencies are
measured from the moment the request is sent.

Prompts are sent as token ids to `/v1/completions` (`prompt: [ids]`,
`max_tokens` = the trace's output length, `ignore_eos: true`, streamed with
`stream_options.include_usage`), so the server's block keys see exactly the
trace's prefix sharing (loadtest/tokens.py). `--endpoint chat` sends synthesised
text instead (one word per trace token, blocks separated by spaces): prefix sharing
then holds at word level only, and lengths are approximate — the real prompt_tokens
come back in `usage`.

Per request: TTFT (first streamed token), TPOT ((last − first token) / (n − 1)),
E2E, usage (`cached_tokens`, and our workers' `kv` extension: tokens loaded per
tier, recomputed, prefetched, queue/load/prefill ms), the worker and the planner's
predicted TTFT when the server says so in `x-kvroute-worker` /
`x-kvroute-predicted-ttft-ms` response headers, and any error (HTTP status and the
OpenAI error message, or an SSE error event).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from .results import RequestResult, ResultsWriter, RunMeta
from .tokens import TokenSynth
from .trace import Trace, TraceError, TraceRequest

WORKER_HEADER = "x-kvroute-worker"
PREDICTED_HEADER = "x-kvroute-predicted-ttft-ms"
_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will can more other what time "
    "up out some into only could new them these then two first may any like now my such make over our even "
    "most after also made many did way before must through back years where much your well down should because"
).split()


@dataclass(slots=True)
class ReplayConfig:
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # None: the first id of GET /v1/models
    speed: float = 1.0
    concurrency: int = 256
    limit: int | None = None
    duration_s: float | None = None  # stop sending after this long (replay time)
    request_timeout_s: float = 600.0
    grace_s: float = 60.0  # after the last send, how long in-flight requests may finish
    api_key: str | None = None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise TraceError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if not self.speed > 0:
            raise TraceError("speed must be > 0")
        if self.concurrency <= 0 or self.concurrency > 100_000:
            raise TraceError("concurrency must be in 1..100000")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TraceError(f"url must be http(s)://host:port, got {self.url!r}")

    @property
    def base(self) -> str:
        u = self.url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u


def chat_text(synth: TokenSynth, req: TraceRequest) -> str:
    """Deterministic text whose words follow the request's token ids (chat mode)."""
    toks = synth.tokens(req)
    n = len(_WORDS)
    return " ".join(_WORDS[t % n] for t in toks.tolist())


@dataclass(slots=True)
class _Progress:
    sent: int = 0
    done: int = 0
    errors: int = 0
    queued: int = 0  # waiting on the concurrency bound right now


class Replayer:
    """One replay run; `run()` returns the results in trace order."""

    def __init__(
        self,
        trace: Trace,
        synth: TokenSynth,
        cfg: ReplayConfig,
        *,
        label: str = "replay",
        writer: ResultsWriter | None = None,
        meta_extra: dict[str, Any] | None = None,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> None:
        self.trace = trace
        self.synth = synth
        self.cfg = cfg
        self.label = label
        self.writer = writer
        self.meta_extra = meta_extra or {}
        self.on_result = on_result
        self.progress = _Progress()
        self._enc = msgspec.json.Encoder()

    async def _model(self, session: aiohttp.ClientSession) -> str:
        if self.cfg.model:
            return self.cfg.model
        try:
            async with session.get(self.cfg.base + "/v1/models") as resp:
                body = await resp.json(content_type=None)
                return str(body["data"][0]["id"])
        except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError) as e:
            raise TraceError(f"cannot list models at {self.cfg.base}/v1/models ({e}); pass --model") from None

    def _body(self, req: TraceRequest, model: str) -> bytes:
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": req.output_length,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if req.cache_salt:
            body["cache_salt"] = req.cache_salt
        if cfg.endpoint == "completions":
            body["prompt"] = self.synth.token_list(req)
        else:
            body["messages"] = [{"role": "user", "content": chat_text(self.synth, req)}]
        body.update(cfg.extra_body)
        return self._enc.encode(body)

    async def _one(
        self,
        session: aiohttp.ClientSession,
        sem: asyncio.Semaphore,
        req: TraceRequest,
        model: str,
        t0: float,
    ) -> RequestResult:
        arrival = req.arrival_s / self.cfg.speed
        res = RequestResult(run=self.label, index=req.index, arrival_s=arrival, prompt_tokens=req.input_length)
        self.progress.queued += 1
        acquired = False
        try:
            await sem.acquire()
            acquired = True
            self.progress.queued -= 1
            body = self._body(req, model)
            sent = time.monotonic()
            res.start_s = sent - t0
            res.client_queue_s = max(0.0, res.start_s - arrival)
            self.progress.sent += 1
            await self._send(session, body, res, sent)
        except asyncio.CancelledError:
            res.status, res.error = 0, "cancelled at the end of the run"
            if not acquired:
                self.progress.queued -= 1
                res.client_queue_s = max(0.0, time.monotonic() - t0 - arrival)
        except TimeoutError:
            res.status, res.error = 0, f"timed out after {self.cfg.request_timeout_s:g}s"
        except aiohttp.ClientError as e:
            res.status, res.error = 0, f"{type(e).__name__}: {e}"
        finally:
            if acquired:
                sem.release()
        self.progress.done += 1
        if not res.ok:
            self.progress.errors += 1
        if self.writer is not None:
            self.writer.write(res)
        if self.on_result is not None:
            self.on_result(res)
        return res

    async def _send(self, session: aiohttp.ClientSession, body: bytes, res: RequestResult, sent: float) -> None:
        path = "/v1/completions" if self.cfg.endpoint == "completions" else "/v1/chat/completions"
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            headers["Authorization"] = f"Bearer {self.cfg.api_key}"
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        async with session.post(self.cfg.base + path, data=body, headers=headers, timeout=timeout) as resp:
            res.worker = resp.headers.get(WORKER_HEADER)
            pred = resp.headers.get(PREDICTED_HEADER)
            if pred:
                try:
                    res.predicted_ttft_s = float(pred) / 1000.0
                except ValueError:
                    pass
            if resp.status != 200:
                res.status = resp.status
                raw = await resp.read()
                try:
                    err = msgspec.json.decode(raw)["error"]
                    res.error = str(err.get("message") or err)
                except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
                    res.error = raw[:300].decode("utf-8", "replace") or resp.reason or "error"
                return
            first: float | None = None
            last = sent
            chunks = 0
            usage: dict[str, Any] | None = None
            dec = msgspec.json.Decoder()
            buf = b""
            async for piece in resp.content.iter_any():
                now = time.monotonic()
                buf += piece.replace(b"\r\n", b"\n")  # SSE allows CRLF line ends
                while True:
                    cut = buf.find(b"\n\n")
                    if cut < 0:
                        break
                    event, buf = buf[:cut], buf[cut + 2 :]
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        try:
                            obj = dec.decode(data)
                        except msgspec.DecodeError:
                            res.error = f"bad SSE data: {data[:100]!r}"
                            continue
                        if "error" in obj:
                            err = obj["error"]
                            res.error = str(err.get("message") if isinstance(err, dict) else err)
                            continue
                        if obj.get("usage"):
                            usage = obj["usage"]
                        if _has_token(obj):
                            chunks += 1
                            last = now
                            if first is None:
                                first = now
            end = time.monotonic()
        res.e2e_s = end - sent
        if first is not None:
            res.ttft_s = first - sent
        elif res.error is None:
            res.error = "stream ended without a token"
        n_out = chunks
        if usage:
            _apply_usage(res, usage)
            n_out = int(usage.get("completion_tokens") or chunks)
        res.output_tokens = n_out
        if first is not None and n_out > 1:
            res.tpot_s = (last - first) / (n_out - 1)

    async def run(self) -> list[RequestResult]:
        cfg = self.cfg
        self.trace.validate()  # a bad trace fails here, before anything is sent
        reqs: Sequence[TraceRequest] = self.trace.requests
        if cfg.limit is not None:
            reqs = reqs[: cfg.limit]
        if cfg.duration_s is not None:
            reqs = [r for r in reqs if r.arrival_s / cfg.speed < cfg.duration_s]
        connector = aiohttp.TCPConnector(limit=cfg.concurrency, limit_per_host=cfg.concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            model = await self._model(session)
            sem = asyncio.Semaphore(cfg.concurrency)
            t0 = time.monotonic()
            wall0 = time.time()
            if self.writer is not None:
                self.writer.write(self._meta(model, 0.0, 0.0, len(reqs), t0=t0))
            tasks: list[asyncio.Task[RequestResult]] = []
            stop_progress = asyncio.Event()
            bar = asyncio.create_task(self._progress_loop(len(reqs), stop_progress)) if cfg.progress else None
            try:
                for req in reqs:
                    delay = t0 + req.arrival_s / cfg.speed - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(self._one(session, sem, req, model, t0)))
                # A time-bounded run gives in-flight requests `grace_s` after the last send.
                drain = cfg.grace_s if cfg.duration_s is not None else cfg.request_timeout_s + cfg.grace_s
                pending: set[asyncio.Task[RequestResult]] = set()
                if tasks:
                    _, pending = await asyncio.wait(tasks, timeout=drain)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
            finally:
                for t in tasks:
                    if not t.done():
                        t.cancel()
                stop_progress.set()
                if bar is not None:
                    await bar
            results = [t.result() for t in tasks if not t.cancelled()]
            duration = time.monotonic() - t0
        results.sort(key=lambda r: r.index)
        if self.writer is not None:
            self.writer.write(self._meta(model, duration, time.time() - wall0, len(reqs), final=True, t0=t0))
            self.writer.flush()
        return results

    def _meta(self, model: str, duration: float, wall: float, n: int, final: bool = False,
              t0: float = 0.0) -> RunMeta:
        return RunMeta(
            run=self.label,
            mode="replay",
            policy=self.meta_extra.get("policy"),
            trace=self.trace.name,
            speed=self.cfg.speed,
            workers=self.meta_extra.get("workers"),
            profile=self.meta_extra.get("profile"),
            tiers=self.meta_extra.get("tiers", "all"),
            url=self.cfg.base,
            duration_s=duration,
            wall_s=wall,
            params={"endpoint": self.cfg.endpoint, "model": model, "concurrency": self.cfg.concurrency,
                    "requests": n, "final": final,
                    # start_s + this = time.monotonic() at the send: comparable with logs of
                    # other processes on the same host (sim-cluster --arrival-log)
                    "t0_monotonic_s": t0},
        )

    async def _progress_loop(self, total: int, stop: asyncio.Event) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        p = self.progress
        with Progress(
            TextColumn(f"[bold]{self.label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("sent {task.fields[sent]} · in flight {task.fields[flight]} · client-queued "
                       "{task.fields[queued]} · errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            transient=False,
        ) as bar:
            task = bar.add_task("replay", total=total, sent=0, flight=0, queued=0, errors=0)
            while True:
                bar.update(task, completed=p.done, sent=p.sent, flight=p.sent - p.done, queued=p.queued,
                           errors=p.errors)
                if stop.is_set():
                    break
                try:
                    await asyncio.wait_for(stop.wait(), 0.25)
                except TimeoutError:
                    pass


def _has_token(obj: dict[str, Any]) -> bool:
    for ch in obj.get("choices") or ():
        if ch.get("text"):
            return True
        delta = ch.get("delta")
        if delta and (delta.get("content") or delta.get("reasoning_content")):
            return True
    return False


def _apply_usage(res: RequestResult, usage: dict[str, Any]) -> None:
    res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)
    details = usage.get("prompt_tokens_details") or {}
    res.cached_tokens = int(details.get("cached_tokens") or 0)
    kv = usage.get("kv")
    if isinstance(kv, dict):
        res.loaded_tokens = {str(k): int(v) for k, v in (kv.get("loaded_tokens") or {}).items()}
        if kv.get("recomputed_tokens") is not None:
            res.recomputed_tokens = int(kv["recomputed_tokens"])
        res.prefetched_tokens = int(kv.get("prefetched_tokens") or 0)
        for f in ("queue_ms", "load_ms", "prefill_ms"):
            if kv.get(f) is not None:
                setattr(res, f, float(kv[f]))


def run_replay(trace: Trace, synth: TokenSynth, cfg: ReplayConfig, **kw: Any) -> list[RequestResult]:
    """Synchronous wrapper (the CLI's entry)."""
    return asyncio.run(Replayer(trace, synth, cfg, **kw).run())
