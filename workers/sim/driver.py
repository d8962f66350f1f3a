"""Real-time driver: the `workers.api.Engine` interface over a `SimEngine` on asyncio.

The engine's clock is the event loop's: one `loop.call_at` timer armed for the engine's
next event, so a simulated worker costs a timer per engine event and a wake-up per step
per streaming request, nothing per token. Timers, peer pulls: docs/sim-engine.md § Driver.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from kvindex.tiers import Tier
from kvwire import LoadReport, WorkerInfo
from workers.api import BlockExport, GenChunk, GenRequest, PrefetchResult, PrefetchSpec
from workers.blockmeta import BlockMeta, meta_from_json, meta_to_json
from workers.chunkstream import ChunkStream
from workers.errors import BadRequest, Draining, UnsupportedParameter
from workers.fleetkeys import peer_bearer
from workers.tokenizer import SimTokenizer
from workers.usage import Usage

from .embed import embed
from .engine import SimEngine, SimRequest

log = logging.getLogger(__name__)


class _SimStream(ChunkStream):
    """One accepted request: engine callbacks in, `GenChunk`s out (filler text)."""

    __slots__ = ("_driver", "_count", "_pos")

    def __init__(self, driver: SimDriver, request_id: str) -> None:
        super().__init__(request_id)
        self._driver = driver
        self._count = 0  # tokens produced since the last chunk
        self._pos = 0  # tokens handed out so far

    # engine callbacks (run inside SimEngine.advance)
    def on_first(self, t: float, u: Usage) -> None:
        self._count += 1
        self._wake()

    def on_tokens(self, t: float, n: int) -> None:
        self._count += n
        self._wake()

    def on_finish(self, t: float, u: Usage) -> None:
        self.usage = u
        self.finish_reason = "length"
        self._end()

    def on_error(self, t: float, msg: str) -> None:
        self._end(msg)

    def _pending(self) -> bool:
        return self._count > 0

    def _take(self) -> GenChunk:
        n, self._count = self._count, 0
        ids, text = self._driver.tokenizer.filler(self._pos, n)
        self._pos += n
        return GenChunk(ids, text)

    def _abort(self) -> None:
        d = self._driver
        d.engine.cancel(self.request_id, d.now())
        d.schedule()


class _HttpPeer:
    """What a peer in another process said it holds (from its /kv/blocks)."""

    def __init__(self, held: dict[bytes, Tier], metas: dict[bytes, BlockMeta]) -> None:
        self._held = held
        self._metas = metas

    def match_tiers(self, keys: list[bytes]) -> list[Tier | None]:
        out: list[Tier | None] = []
        for k in keys:
            t = self._held.get(k)
            if t is None:
                break
            out.append(t)
        out.extend([None] * (len(keys) - len(out)))
        return out

    def block_metas(self, keys: list[bytes]) -> dict[bytes, BlockMeta]:
        return {k: self._metas[k] for k in keys if k in self._metas}


class SimDriver:
    """`workers.api.Engine` over one SimEngine, on the running asyncio loop."""

    def __init__(
        self,
        engine: SimEngine,
        *,
        peers: Mapping[str, SimEngine] | None = None,
        peer_token: str | None = None,
        peer_timeout_s: float = 2.0,
        tokenizer: SimTokenizer | None = None,
    ) -> None:
        self.engine = engine
        self.worker_id = engine.worker_id
        self.tokenizer = tokenizer if tokenizer is not None else SimTokenizer(engine.profile.tokenizer_dir())
        self.draining = False
        self._peers = peers if peers is not None else {}
        self._peer_token = peer_token
        self._peer_timeout = peer_timeout_s
        self._http: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self.publisher_stats: Any = None  # set by the cluster: the publisher, for counters
        # (worker id, request id, time.monotonic(), prompt tokens) of each accepted request:
        # the cluster's --arrival-log, to measure what the HTTP path does to arrival order
        self.on_arrival: Callable[[str, str, float, int], None] | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def now(self) -> float:
        t = self.loop.time()
        return t if t > self.engine.now else self.engine.now

    # ------------------------------------------------------------------ clock

    def schedule(self) -> None:
        """Arm the timer for the engine's next event (or disarm it when idle)."""
        t = self.engine.next_event_time()
        if t is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
                self._timer_at = math.inf
            return
        if self._timer is not None:
            if t == self._timer_at:
                return
            self._timer.cancel()
        self._timer_at = t
        self._timer = self.loop.call_at(t, self._fire)

    def _fire(self) -> None:
        due = self._timer_at
        self._timer = None
        self._timer_at = math.inf
        try:
            self.engine.advance(max(self.loop.time(), due))
        except Exception:  # pragma: no cover - a bug; keep the worker alive and visible
            log.exception("worker %s: engine advance failed", self.worker_id)
        self.schedule()

    def _sync(self) -> float:
        now = self.now()
        self.engine.advance(now)
        return now

    # ------------------------------------------------------------------ Engine API

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        """Stop: every request still in flight ends with an explicit error, never silently."""
        self.draining = True
        if self._loop is not None:
            self.engine.fail_all(self.now(), "the worker is shutting down")
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    def embed(self, ids: list[int], dimensions: int | None) -> list[float]:
        """workers.api.Embeds: deterministic vectors from the tokens (workers/sim/embed.py)."""
        out: list[float] = embed(ids, dimensions).tolist()
        return out

    def info(self) -> WorkerInfo:
        return self.engine.info()

    def load(self) -> LoadReport:
        now = self._sync()
        rep = self.engine.load_report(now)
        rep.ts = time.time()
        self.schedule()
        return rep

    async def generate(self, req: GenRequest) -> _SimStream:
        """Accept a generation: exactly `max_tokens` filler tokens (so `min_tokens`, at most
        that, always holds). Log-probabilities are refused: there is no model to give them."""
        if self.draining:
            raise Draining("this worker is draining: send the request elsewhere", retry_after=1.0)
        if req.logprobs is not None:
            raise UnsupportedParameter(
                "logprobs is not supported by this worker: the simulated engine has no model to give "
                "log-probabilities", param="logprobs")
        if req.kv_transfer_params is not None:
            raise UnsupportedParameter(
                "kv_transfer_params is not supported by this worker: the simulated engine holds no KV to "
                "transfer (its prefill/decode roles are priced by the offline simulator)",
                param="kv_transfer_params")
        if not 0 <= req.min_tokens <= req.max_tokens:
            raise BadRequest("min_tokens must be in [0, max_tokens]", param="min_tokens")
        stream = _SimStream(self, req.request_id)
        sreq = SimRequest(
            req.request_id,
            len(req.prompt_ids),
            req.max_tokens,
            token_ids=req.prompt_ids,
            cache_salt=req.cache_salt,
            shared_prefix_blocks=req.shared_prefix_blocks,
            lora=req.lora,
            on_first_token=stream.on_first,
            on_tokens=stream.on_tokens,
            on_finish=stream.on_finish,
            on_error=stream.on_error,
        )
        self.engine.submit(sreq, self.now())
        if self.on_arrival is not None:
            self.on_arrival(self.worker_id, req.request_id, time.monotonic(), len(req.prompt_ids))
        self.schedule()
        return stream

    async def prefetch(self, spec: PrefetchSpec) -> PrefetchResult:
        source = None
        if spec.source_peer is not None:
            source = await self._resolve_peer(spec.source_peer.worker_id, spec.source_peer.url, spec.keys)
        now = self.now()
        n = self.engine.prefetch(spec.keys, now, now + spec.deadline_s, spec.prefetch_id, source)
        self.schedule()
        return PrefetchResult(spec.prefetch_id, n, n > 0)

    def cancel_prefetch(self, prefetch_id: str) -> bool:
        ok = self.engine.cancel_prefetch(prefetch_id)
        self.schedule()
        return ok

    def republish(self) -> int:
        """Publish everything held as one batch of events; returns its sequence number."""
        self._sync()
        events = self.engine.state_events()
        pub = self.publisher_stats
        return int(pub.publish(events)) if pub is not None else -1

    def purge(self, cache_salt: str | None, everything: bool) -> int:
        self._sync()
        n = self.engine.purge(cache_salt, everything)
        self.schedule()
        return n

    def export_blocks(self, keys: list[bytes], with_meta: bool = False) -> list[BlockExport]:
        eng = self.engine
        held = eng.holdings(keys)
        metas = eng.block_metas([k for k, _ in held]) if with_meta else {}
        bb = eng.block_bytes
        out = []
        for k, t in held:
            m = metas.get(k)
            out.append(BlockExport(k, t.name, bb, meta_to_json(m, eng.bs) if m is not None else None))
        return out

    def counters(self) -> dict[str, dict[str, float]]:
        eng = self.engine
        s = eng.stats
        kv = eng.kv
        out: dict[str, dict[str, float]] = {
            "requests_finished": {"": s.finished},
            "requests_cancelled": {"": s.cancelled},
            "requests_rejected_too_large": {"": s.rejected_too_large},
            "requests_rejected_queue_full": {"": s.rejected_queue_full},
            "computed_tokens": {"": s.computed_tokens},
            "generated_tokens": {"": s.generated_tokens},
            "steps": {"": s.steps},
            "loaded_blocks": dict(s.loaded_blocks),
            "stored_blocks": {t.name: v for t, v in kv.stored.items()},
            "evicted_blocks": {t.name: v for t, v in kv.evicted.items()},
            "link_bytes": {t: v["bytes"] for t, v in eng.link_stats().items()},
            "disk_bytes_written": {"": kv.disk_bytes_written},
            "disk_admission_rejected_blocks": {"": kv.disk_rejected},
            "prefetch_requests": {"": s.prefetch_requests},
            "prefetch_blocks_accepted": {"": s.prefetch_blocks_accepted},
            "prefetch_blocks_landed": {"": s.prefetch_blocks_landed},
            "prefetch_transfers_dropped": {"": s.prefetch_transfers_dropped},
        }
        pub = self.publisher_stats
        if pub is not None:
            out["event_batches"] = {"": pub.batches}
            out["event_batches_dropped"] = {"": pub.dropped}
        return out

    # ------------------------------------------------------------------ peers

    async def _resolve_peer(self, worker_id: str | None, url: str, keys: list[bytes]) -> Any:
        if worker_id is not None and worker_id in self._peers:
            return self._peers[worker_id]
        if url.rstrip("/") in self._peers:
            return self._peers[url.rstrip("/")]
        if self._peer_token is None:
            raise BadRequest("cannot pull from a peer: no peer token configured", param="source_peer")
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._peer_timeout))
        body = {"keys_b64": base64.b64encode(b"".join(keys)).decode(), "meta": True}
        auth = {"Authorization": f"Bearer {peer_bearer(self._peer_token)}"}  # derived: the secret stays here
        try:
            async with self._http.post(
                url.rstrip("/") + "/kv/blocks", json=body, headers=auth
            ) as r:
                if r.status != 200:
                    raise BadRequest(f"peer {url} answered {r.status} to /kv/blocks", param="source_peer")
                data = await r.json()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise BadRequest(f"peer {url} unreachable: {e!r}", param="source_peer") from None
        held: dict[bytes, Tier] = {}
        metas: dict[bytes, BlockMeta] = {}
        try:
            for b in data["blocks"]:
                k = bytes.fromhex(b["key"])
                held[k] = Tier[b["tier"]]
                if b.get("meta"):
                    metas[k] = meta_from_json(b["meta"])
        except (KeyError, ValueError, TypeError) as e:
            raise BadRequest(f"peer {url} sent a malformed /kv/blocks answer: {e!r}", param="source_peer") from None
        return _HttpPeer(held, metas)
