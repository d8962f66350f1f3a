"""`TorchEngine`: the `workers.api.Engine` interface over an `EngineCore` in its own thread.

The asyncio side never runs the model: `generate` hashes the prompt's block keys, queues
the sequence (refusals raise at once) and returns a stream; the engine thread's results
come back through `call_soon_threadsafe` and are pushed into the streams. KV events are
taken from the core under its lock and published from the event loop, in the order the
core recorded them, so a subscriber never sees a block removed before it was stored.

With lower tiers (workers/engine/tiers.py) the tiers' threads change state too: they
ask for a flush of the events through `call_soon_threadsafe`. `/kv/prefetch` asks the
REMOTE server (and the source peer, over HTTP) which blocks they hold before queueing
the transfers; `/kv/blocks` lists what this worker holds, or streams the blocks' records
(`export_block_data`). Without tiers (GPU only) `/kv/prefetch` answers 501.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvindex.events import KVEvent
from kvindex.tiers import Tier
from kvwire import LoadReport, WorkerInfo
from workers.api import BlockExport, GenChunk, GenRequest, PrefetchResult, PrefetchSpec, TokenLogprob
from workers.blockmeta import meta_to_json, state_events
from workers.chunkstream import ChunkStream
from workers.errors import BadRequest, Draining, EngineError, ModelNotFound, PrefetchQueueFull
from workers.fleetkeys import peer_bearer

from .blockio import record_of
from .core import EngineCore, SeqUpdate
from .group_events import per_group
from .loop import EngineThread
from .model import EngineTokenizer
from .pd import PeerPullFailed, PeerPullTimeout, RemotePrefill, prefill_answer
from .pd import parse as parse_transfer
from .sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)
_EXPORT_CHUNK = 16  # blocks read per thread hop of a peer export


class NotSupported(EngineError):
    status = 501
    type = "invalid_request_error"
    code = "not_supported"


class TorchStream(ChunkStream):
    """One accepted request: step results in (on the event loop), `GenChunk`s out."""

    __slots__ = ("seq", "_engine", "_ids", "_texts", "_logprobs", "kv_transfer_params", "held")

    def __init__(self, engine: TorchEngine, seq: Sequence) -> None:
        super().__init__(seq.request_id)
        self.seq = seq
        self._engine = engine
        self._ids: list[int] = []
        self._texts: deque[str] = deque()
        self._logprobs: list[TokenLogprob] | None = [] if seq.params.logprobs is not None else None
        self.kv_transfer_params: dict[str, Any] | None = None  # a prefill for a remote decode: the answer's
        self.held: list[int] = []  # device blocks pulled for it from a prefill worker, held until it ends

    def push(self, u: SeqUpdate) -> None:
        if self._done:
            return
        self._ids.extend(u.token_ids)
        if u.text:
            self._texts.append(u.text)
        if self._logprobs is not None and u.logprobs:
            self._logprobs.extend(u.logprobs)
        if u.finished:
            if u.error is None:
                self.finish_reason = u.seq.finish_reason
                self.usage = u.seq.usage
                if u.seq.pd_pin is not None:
                    self.kv_transfer_params = self._engine._transfer_params(u.seq)
            self._end(u.error)
        else:
            self._wake()

    def _pending(self) -> bool:
        return bool(self._ids or self._texts)

    def _take(self) -> GenChunk:
        ids, self._ids = self._ids, []
        text = "".join(self._texts)
        self._texts.clear()
        lps = self._logprobs
        if lps is not None:
            self._logprobs = []
        return GenChunk(ids, text, lps)

    def _abort(self) -> None:
        self._engine._cancel(self.request_id)


def sampling_of(req: GenRequest) -> SamplingParams:
    """How to sample a request: OpenAI's fields, None meaning OpenAI's defaults
    (temperature 1, top_p 1, no seed, no stop strings), and vLLM's min_tokens."""
    stop = req.stop
    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        seed=req.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=req.logprobs,
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
        self._http: Any = None  # aiohttp session for peers (created on first use)
        # where peers reach this worker (set by the server): a prefill for a remote decode says it
        self.advertised_url = ""
        self._pin_timers: dict[str, asyncio.TimerHandle] = {}

    @property
    def tokenizer(self) -> EngineTokenizer:
        return self.core.lm.tokenizer

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served as models: name -> the base model they apply to (its
        first served name, what `/v1/models` gives as `parent`)."""
        lm = self.core.lm
        return {name: lm.served_names[0] for name in lm.lora.names} if lm.lora is not None else {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        if self.core.tiers is not None:
            self.core.tiers.on_change = self._tiers_changed
        if self._calibrate:
            await asyncio.to_thread(self.core.calibrate)
        self._thread.start()
        self._started = True
        self._flush_events()  # what a restarted DISK tier found

    async def close(self) -> None:
        """Stop: every request in flight ends with an explicit error, then the thread ends."""
        self.draining = True
        with self._thread.lock:
            updates = self.core.fail_all("the worker is shutting down")
            for pid in list(self.core.pins):
                self.core.unpin(pid)
        for timer in self._pin_timers.values():
            timer.cancel()
        self._pin_timers.clear()
        self._dispatch(updates)
        if self._started:
            await asyncio.to_thread(self._thread.stop)
            self._started = False
        await asyncio.to_thread(self.core.close)
        self._flush_events()
        if self._http is not None:
            await self._http.close()
            self._http = None

    # ------------------------------------------------------------------ requests

    async def generate(self, req: GenRequest, sampling: SamplingParams | None = None) -> TorchStream:
        """Accept a generation, sampled as `sampling` says or as `req` asks (`sampling_of`).
        Raises BadRequest, RequestTooLarge, QueueFull, Draining."""
        if self.draining:
            raise Draining("this worker is draining: send the request elsewhere", retry_after=1.0)
        if not self._started:
            raise Draining("this worker is starting", retry_after=1.0)
        if req.lora and (self.core.lm.lora is None or req.lora not in self.core.lm.lora):
            raise ModelNotFound(req.lora, param="lora")
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
        held: list[int] = []
        if req.kv_transfer_params is not None:
            ask = parse_transfer(req.kv_transfer_params, self.core.max_context // self.core.bs + 1)
            role = self.core.cfg.role
            if ask == "prefill":
                if role == "decode":
                    raise BadRequest("this worker's role is decode: it does not prefill for a remote decode "
                                     "(kv_transfer_params.do_remote_decode)", param="kv_transfer_params")
                seq.pd_pin = uuid.uuid4().hex
            elif isinstance(ask, RemotePrefill):
                if role == "prefill":
                    raise BadRequest("this worker's role is prefill: it does not decode after a remote prefill "
                                     "(kv_transfer_params.do_remote_prefill)", param="kv_transfer_params")
                held = await self._pull_remote(req.request_id, seq, ask)
        stream = TorchStream(self, seq)
        stream.held = held
        self._streams[req.request_id] = stream
        try:
            self._thread.submit(seq)
        except EngineError:
            del self._streams[req.request_id]
            self._release_held(stream)
            raise
        return stream

    # ------------------------------------------------------------------ prefill/decode

    async def _pull_remote(self, request_id: str, seq: Sequence, src: RemotePrefill) -> list[int]:
        """Pull a remote prefill's blocks through the PEER link (the /kv/prefetch path: the
        peer's listing, then its records, MAC-checked) and hold them on the device until the
        request ends. Only blocks of this request's own chain are accepted; any block that
        does not arrive fails the request (nothing is left held)."""
        tiers = self.core.tiers
        if tiers is None or Tier.PEER not in tiers.links:
            raise BadRequest("this worker cannot pull KV from a prefill worker: no peer token configured",
                             param="kv_transfer_params")
        n = len(src.keys)
        if src.keys != seq.keys[:n] or n > seq.cacheable_blocks:
            raise BadRequest("kv_transfer_params.remote_block_ids are not the leading blocks of this prompt "
                             "(another prompt, model, cache_salt or block size)", param="kv_transfer_params")
        if not n:
            return []
        timeout = tiers.cfg.peer_timeout_s
        try:
            held_there = await self._peer_holdings(src.url, src.keys)
        except BadRequest as e:
            raise PeerPullFailed(f"cannot pull the prefilled KV from {src.engine_id or src.url}: {e.message}",
                                 param="kv_transfer_params") from None
        pid = f"pd-{request_id}-{uuid.uuid4().hex[:8]}"
        with self._thread.lock:
            tiers.prefetch(pid, src.keys, timeout, peer_url=src.url, peer_held=held_there)
        self._flush_events()
        deadline = time.monotonic() + timeout + 1.0
        while True:
            with self._thread.lock:
                moving = pid in tiers.prefetches or any(k in tiers.inflight for k in src.keys)
            if not moving:
                break
            if time.monotonic() > deadline:
                self.cancel_prefetch(pid)
                raise PeerPullTimeout(f"pulling {n} KV blocks from {src.engine_id or src.url} took longer than "
                                      f"{timeout:g} s", param="kv_transfer_params")
            await asyncio.sleep(0.005)
        held: list[int] = []
        with self._thread.lock:
            by_key = self.core.blocks.by_key
            for k in src.keys:
                bid = by_key.get(k)
                if bid is None:
                    break
                self.core.blocks.acquire(bid)
                held.append(bid)
            if len(held) < n:
                for bid in reversed(held):
                    self.core.blocks.release_block(bid)
        self._flush_events()
        if len(held) < n:
            missing = n - len(held)
            why = ("it no longer holds them (its pin expired?)" if len(held_there) < n
                   else "the transfer failed or this worker had no room")
            raise PeerPullFailed(f"{missing} of {n} KV blocks did not arrive from {src.engine_id or src.url}: {why}",
                                 param="kv_transfer_params")
        return held

    def _release_held(self, stream: TorchStream) -> None:
        if stream.held:
            with self._thread.lock:
                for bid in reversed(stream.held):
                    self.core.blocks.release_block(bid)
            stream.held = []

    def _transfer_params(self, seq: Sequence) -> dict[str, Any]:
        """The fields a prefill for a remote decode answers with."""
        pid = seq.pd_pin
        assert pid is not None
        pin_s = self.core.cfg.pd_pin_s
        with self._thread.lock:
            keys = self.core.pinned_keys(pid)
        return prefill_answer(worker_id=self.worker_id, url=self.advertised_url, request_id=seq.request_id,
                              keys=keys, block_size=self.core.bs, pin_id=pid, pin_s=pin_s)

    def _arm_pin(self, pid: str) -> None:
        """A prefill for a remote decode pinned its blocks: release them after the bound (armed
        whether or not its client is still there, so that no pin outlives the bound)."""
        loop = self._loop
        if loop is not None and pid not in self._pin_timers:
            self._pin_timers[pid] = loop.call_later(self.core.cfg.pd_pin_s, self._expire_pin, pid)

    def _expire_pin(self, pid: str) -> None:
        self._pin_timers.pop(pid, None)
        with self._thread.lock:
            self.core.expire_pin(pid)

    def pd_pinned_blocks(self) -> int:
        """Device blocks pinned now for remote decodes (/metrics)."""
        with self._thread.lock:
            return self.core.pinned_blocks()

    def _cancel(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._release_held(stream)
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
            if u.finished and u.error is None and u.seq.pd_pin is not None:
                self._arm_pin(u.seq.pd_pin)
            stream = streams.get(u.seq.request_id)
            if stream is None or stream.seq is not u.seq:  # cancelled meanwhile (its id maybe reused)
                continue
            stream.push(u)
            if u.finished:
                del streams[u.seq.request_id]
                self._release_held(stream)
        self._flush_events()

    def _flush_events(self) -> None:
        with self._thread.lock:
            events = self.core.take_events()
        if events and self.on_events is not None:
            self.on_events(events)

    def _tiers_changed(self) -> None:
        """Called by the tiers' threads after a change: publish its events from the loop."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._flush_events)
        except RuntimeError:  # the loop closed at shutdown
            pass

    # ------------------------------------------------------------------ KV

    async def prefetch(self, spec: PrefetchSpec) -> PrefetchResult:
        """Queue transfers raising the leading blocks toward the pool: from CPU or DISK, from
        REMOTE (those the server holds), else from `source_peer` (those it holds)."""
        tiers = self.core.tiers
        if tiers is None:
            raise NotSupported("/kv/prefetch needs lower tiers or a peer token on this worker", param="keys_b64")
        if spec.source_peer is not None and Tier.PEER not in tiers.links:
            raise BadRequest("cannot pull from a peer: no peer token configured", param="source_peer")
        with self._thread.lock:
            if spec.prefetch_id in tiers.prefetches:
                raise BadRequest(f"prefetch {spec.prefetch_id!r} is already in flight", param="prefetch_id")
            if len(tiers.prefetches) >= tiers.cfg.prefetch_queue:
                raise PrefetchQueueFull(f"{len(tiers.prefetches)} prefetches in flight", retry_after=1.0)
            far = [k for k in spec.keys if not tiers.local(k) and k not in tiers.inflight]
        remote_present: set[bytes] | None = None
        if tiers.remote is not None and far:
            found = await asyncio.to_thread(tiers.remote.contains, far)
            remote_present = {k for k, f in zip(far, found, strict=True) if f}
            far = [k for k in far if k not in remote_present]
        peer_held: set[bytes] | None = None
        url = None
        if spec.source_peer is not None and far:
            url = spec.source_peer.url.rstrip("/")
            peer_held = await self._peer_holdings(url, far)
        with self._thread.lock:
            n = tiers.prefetch(spec.prefetch_id, spec.keys, spec.deadline_s, remote_present=remote_present,
                               peer_url=url, peer_held=peer_held)
        self._flush_events()  # room made for it may have evicted blocks
        return PrefetchResult(spec.prefetch_id, n, n > 0)

    async def _peer_holdings(self, url: str, keys: list[bytes]) -> set[bytes]:
        """Which of `keys` the peer holds (its /kv/blocks listing)."""
        import aiohttp

        tiers = self.core.tiers
        assert tiers is not None
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=tiers.cfg.peer_timeout_s))
        body = {"keys_b64": base64.b64encode(b"".join(keys)).decode()}
        headers = {"Authorization": f"Bearer {peer_bearer(tiers.cfg.peer_token or '-')}"}
        try:
            async with self._http.post(url + "/kv/blocks", json=body, headers=headers) as r:
                if r.status != 200:
                    raise BadRequest(f"peer {url} answered {r.status} to /kv/blocks", param="source_peer")
                data = await r.json()
            return {bytes.fromhex(b["key"]) for b in data["blocks"]}
        except (TimeoutError, aiohttp.ClientError) as e:
            raise BadRequest(f"peer {url} unreachable: {e!r}", param="source_peer") from None
        except (KeyError, ValueError, TypeError) as e:
            raise BadRequest(f"peer {url} sent a malformed /kv/blocks answer: {e!r}", param="source_peer") from None

    def cancel_prefetch(self, prefetch_id: str) -> bool:
        tiers = self.core.tiers
        if tiers is None:
            return False
        with self._thread.lock:
            return tiers.cancel_prefetch(prefetch_id)

    def purge(self, cache_salt: str | None, everything: bool) -> int:
        with self._thread.lock:
            n = self.core.purge(cache_salt, everything)
        self._flush_events()
        return n

    def export_blocks(self, keys: list[bytes], with_meta: bool = False) -> list[BlockExport]:
        """Which of `keys` this worker holds (GPU, CPU, DISK), with metadata when at hand."""
        core = self.core
        bb = core.pool.block_bytes
        with self._thread.lock:
            if core.tiers is not None:
                held = core.tiers.locate(keys)
            else:
                by_key = core.blocks.by_key
                held = [(k, Tier.GPU, core.blocks.blocks[by_key[k]].meta) for k in keys if k in by_key]
        return [BlockExport(k, t.name, bb, meta_to_json(m, core.bs) if with_meta and m is not None else None)
                for k, t, m in held]

    async def export_block_data(self, keys: list[bytes]) -> AsyncIterator[bytes]:
        """The records of the leading `keys` held here (peer pull), a few blocks per chunk."""
        tiers = self.core.tiers
        if tiers is None:
            return
        for i in range(0, len(keys), _EXPORT_CHUNK):
            batch = keys[i : i + _EXPORT_CHUNK]
            got = await asyncio.to_thread(tiers.export, batch)
            if got:
                yield b"".join(record_of(k, m, p) + tag for k, m, p, tag in got)
                # handed over to the server (a peer that went away before this closed the generator)
                with self._thread.lock:
                    self.core.pulled([k for k, _, _, _ in got])
            if len(got) < len(batch):
                return

    def republish(self) -> int:
        """Everything held, published as one batch (`AllBlocksCleared`, then every block of
        every tier after its parent): a gateway that restarted rebuilds this worker from it.
        Events pending go out first. Returns the batch's sequence number (-1: no publisher)."""
        core = self.core
        with self._thread.lock:
            pending = core.take_events()
            held = {Tier.GPU: core.blocks.snapshot()}
            metas = {}
            if core.tiers is not None:
                held.update(core.tiers.snapshot())
                metas = core.tiers.metas()
            for k, b in core.blocks.by_key.items():
                m = core.blocks.blocks[b].meta
                if m is not None:
                    metas[k] = m
            kv = core.lm.kv
            state = per_group(state_events(held, metas, core.bs), kv.groups if kv.sliding else None)
            publish = getattr(self.publisher_stats, "publish", None)
            if publish is None:
                return -1
            if pending:
                publish(pending)
            return int(publish(state))

    def tiers_snapshot(self) -> dict[Tier, set[bytes]]:
        """Keys held per tier: what the published events describe."""
        with self._thread.lock:
            out = {Tier.GPU: self.core.blocks.snapshot()}
            if self.core.tiers is not None:
                out.update(self.core.tiers.snapshot())
            return out

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
                "pd_pins": {"": s.pd_pins},
                "pd_pins_pulled": {"": s.pd_pins_pulled},
                "pd_pins_expired": {"": s.pd_pins_expired},
                "stored_blocks": {"GPU": b.stored},
                "evicted_blocks": {"GPU": b.evicted},
            }
            tiers = self.core.tiers
            if tiers is not None:
                names = {t.name for t in tiers.links} - {"PEER"}
                out["stored_blocks"].update({k: v for k, v in tiers.stats.stored.items() if k in names})
                out["evicted_blocks"].update({k: v for k, v in tiers.stats.evicted.items() if k in names})
                out.update(tiers.counters())
        pub = self.publisher_stats
        if pub is not None:
            out["event_batches"] = {"": getattr(pub, "batches", 0)}
            out["event_batches_dropped"] = {"": getattr(pub, "dropped", 0)}
        return out
