"""`TorchEngine`: the `workers.api.Engine` interface over an `EngineCore` in its own thread.

The asyncio side never runs the model: `generate` hashes the prompt's block keys, queues
the sequence (refusals raise at once) and returns a stream; the engine thread's results
come back through `call_soon_threadsafe` and are pushed into the streams. KV events are
taken from the core under its lock and published from the event loop, in the order the
core recorded them, so a subscriber never sees a block removed before it was stored.

Stage 1 serves the GPU tier only: `/kv/prefetch` and `/kv/blocks` answer 501 and are not
advertised; `/kv/purge` works.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from kvindex.events import KVEvent
from kvindex.tiers import Tier
from kvwire import LoadReport, WorkerInfo
from workers.api import BlockExport, GenChunk, GenRequest, PrefetchResult, PrefetchSpec
from workers.errors import BadRequest, Draining, EngineError
from workers.usage import Usage

from .core import EngineCore, SeqUpdate
from .loop import EngineThread
from .model import EngineTokenizer
from .sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)


class NotSupported(EngineError):
    status = 501
    type = "invalid_request_error"
    code = "not_supported"


class _Failed(EngineError):
    status = 500
    type = "server_error"
    code = "engine_error"


class TorchStream:
    """One accepted request: step results in (on the event loop), `GenChunk`s out."""

    __slots__ = ("request_id", "seq", "usage", "finish_reason", "_engine", "_ids", "_texts", "_done", "_error",
                 "_waiter")

    def __init__(self, engine: TorchEngine, seq: Sequence) -> None:
        self.request_id = seq.request_id
        self.seq = seq
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self._engine = engine
        self._ids: list[int] = []
        self._texts: deque[str] = deque()
        self._done = False
        self._error: str | None = None
        self._waiter: asyncio.Future[None] | None = None

    def push(self, u: SeqUpdate) -> None:
        if self._done:
            return
        self._ids.extend(u.token_ids)
        if u.text:
            self._texts.append(u.text)
        if u.finished:
            self._done = True
            if u.error is not None:
                self._error = u.error
            else:
                self.finish_reason = u.seq.finish_reason
                self.usage = u.seq.usage
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> AsyncIterator[GenChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[GenChunk]:
        loop = asyncio.get_running_loop()
        while True:
            if self._ids or self._texts:  # everything since the last read, as one chunk
                ids, self._ids = self._ids, []
                text = "".join(self._texts)
                self._texts.clear()
                yield GenChunk(ids, text)
                continue
            if self._done:
                if self._error is not None:
                    raise _Failed(self._error)
                return
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def cancel(self) -> None:
        """The client went away: the request is dropped and its blocks freed (idempotent)."""
        if self._done:
            return
        self._done = True
        self._engine._cancel(self.request_id)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


def sampling_of(req: GenRequest) -> SamplingParams:
    """How to sample a request: OpenAI's fields, None meaning OpenAI's defaults
    (temperature 1, top_p 1, no seed, no stop strings)."""
    stop = req.stop
    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        seed=req.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        ignore_eos=req.ignore_eos,
    )


class TorchEngine:
    """`workers.api.Engine` over a real model; see the module doc."""

    def __init__(
        self,
        core: EngineCore,
        *,
        on_events: Callable[[list[KVEvent]], object] | None = None,
        calibrate: bool = True,
    ) -> None:
        self.core = core
        self.worker_id = core.cfg.worker_id
        self.draining = False
        self.on_events = on_events
        self.publisher_stats: object | None = None  # the publisher, for counters (set by the server)
        self._calibrate = calibrate
        self._thread = EngineThread(core, self._on_step, name=f"engine-{self.worker_id}")
        self._streams: dict[str, TorchStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False

    @property
    def tokenizer(self) -> EngineTokenizer:
        return self.core.lm.tokenizer

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        if self._calibrate:
            await asyncio.to_thread(self.core.calibrate)
        self._thread.start()
        self._started = True

    async def close(self) -> None:
        """Stop: every request in flight ends with an explicit error, then the thread ends."""
        self.draining = True
        with self._thread.lock:
            updates = self.core.fail_all("the worker is shutting down")
        self._dispatch(updates)
        if self._started:
            await asyncio.to_thread(self._thread.stop)
            self._started = False

    # ------------------------------------------------------------------ requests

    async def generate(self, req: GenRequest, sampling: SamplingParams | None = None) -> TorchStream:
        """Accept a generation, sampled as `sampling` says or as `req` asks (`sampling_of`).
        Raises BadRequest, RequestTooLarge, QueueFull, Draining."""
        if self.draining:
            raise Draining("this worker is draining: send the request elsewhere", retry_after=1.0)
        if not self._started:
            raise Draining("this worker is starting", retry_after=1.0)
        if req.lora:
            raise BadRequest(f"LoRA adapter {req.lora!r} is not loaded: this engine serves no adapters yet",
                             param="lora")
        if req.request_id in self._streams:
            raise BadRequest(f"request id {req.request_id!r} is already in flight", param="request_id")
        try:
            params = sampling or sampling_of(req)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"bad sampling parameters: {e}") from None
        seq = self.core.new_sequence(
            req.request_id,
            req.prompt_ids,
            params,
            cache_salt=req.cache_salt,
            shared_prefix_blocks=req.shared_prefix_blocks,
            lora=req.lora,
        )
        stream = TorchStream(self, seq)
        self._streams[req.request_id] = stream
        try:
            self._thread.submit(seq)
        except EngineError:
            del self._streams[req.request_id]
            raise
        return stream

    def _cancel(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._thread.abort(request_id)

    # ------------------------------------------------------------------ engine thread -> loop

    def _on_step(self, updates: list[SeqUpdate]) -> None:
        """Called on the engine thread after every step (events may be pending even without updates)."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._dispatch, updates)
        except RuntimeError:  # the loop closed under a step finishing at shutdown
            log.debug("engine %s: step results after the event loop closed", self.worker_id)

    def _dispatch(self, updates: list[SeqUpdate]) -> None:
        streams = self._streams
        for u in updates:
            stream = streams.get(u.seq.request_id)
            if stream is None or stream.seq is not u.seq:  # cancelled meanwhile (its id maybe reused)
                continue
            stream.push(u)
            if u.finished:
                del streams[u.seq.request_id]
        self._flush_events()

    def _flush_events(self) -> None:
        with self._thread.lock:
            events = self.core.take_events()
        if events and self.on_events is not None:
            self.on_events(events)

    # ------------------------------------------------------------------ KV

    async def prefetch(self, spec: PrefetchSpec) -> PrefetchResult:
        raise NotSupported("/kv/prefetch is not supported by this engine yet (GPU tier only)", param="keys_b64")

    def cancel_prefetch(self, prefetch_id: str) -> bool:
        return False

    def purge(self, cache_salt: str | None, everything: bool) -> int:
        with self._thread.lock:
            n = self.core.purge(cache_salt, everything)
        self._flush_events()
        return n

    def export_blocks(self, keys: list[bytes], with_meta: bool = False) -> list[BlockExport]:
        raise NotSupported("/kv/blocks (peer export) is not supported by this engine yet", param="keys_b64")

    def tiers_snapshot(self) -> dict[Tier, set[bytes]]:
        """Keys held per tier (GPU only in stage 1): what the published events describe."""
        with self._thread.lock:
            return {Tier.GPU: self.core.blocks.snapshot()}

    # ------------------------------------------------------------------ reports

    def info(self) -> WorkerInfo:
        return self.core.info()

    def load(self) -> LoadReport:
        with self._thread.lock:
            return self.core.load_report()

    def counters(self) -> dict[str, dict[str, float]]:
        with self._thread.lock:
            s = self.core.stats
            b = self.core.blocks
            out: dict[str, dict[str, float]] = {
                "requests_finished": {"": s.finished},
                "requests_cancelled": {"": s.cancelled},
                "requests_failed": {"": s.failed},
                "requests_rejected_too_large": {"": s.rejected_too_large},
                "requests_rejected_queue_full": {"": s.rejected_queue_full},
                "computed_tokens": {"": s.computed_tokens},
                "generated_tokens": {"": s.generated_tokens},
                "steps": {"": s.steps},
                "preemptions": {"": s.preemptions},
                "stored_blocks": {"GPU": b.stored},
                "evicted_blocks": {"GPU": b.evicted},
            }
        pub = self.publisher_stats
        if pub is not None:
            out["event_batches"] = {"": getattr(pub, "batches", 0)}
            out["event_batches_dropped"] = {"": getattr(pub, "dropped", 0)}
        return out
