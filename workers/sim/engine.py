"""The simulated engine: one vLLM-like worker with tiered KV, as a passive, clock-free object.

It never reads a clock: every call takes `now` in the caller's time domain (virtual
seconds in the offline simulator, `loop.time()` behind the HTTP driver), so the same
code serves both. `SimEngine` is the public surface (submit, cancel, advance, prefetch,
purge, reports); the scheduler (scheduler.py) runs the step loop, the loader
(loader.py) moves KV up from lower tiers, the tiered cache (kvcache.py) places blocks.
The API, the callbacks and the timing model are in docs/sim-engine.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from kvindex.events import KVEvent
from kvindex.keys import BlockHasher, ExtraKeys, Namespace
from kvindex.tiers import Tier
from kvwire import LoadReport, NamespaceInfo, Speeds, TierLink, WorkerInfo
from workers.blockmeta import BlockMeta, state_events
from workers.errors import BadRequest, PrefetchQueueFull, QueueFull, RequestTooLarge
from workers.usage import Usage

from .admission import AdmissionFilter
from .job import Job, SimRequest
from .kvcache import TieredKV
from .loader import Loader, PeerSource
from .profile import SimProfile
from .remote import RemoteStore
from .scheduler import Scheduler
from .stats import EngineStats

__all__ = [
    "BadRequest",
    "EngineStats",
    "SimEngine",
    "SimRequest",
    "Usage",
    "RequestTooLarge",
    "QueueFull",
    "PrefetchQueueFull",
    "PeerSource",
    "RemoteStore",
    "SimProfile",
]

_INF = math.inf


class SimEngine:
    """One simulated worker; see the module doc."""

    def __init__(
        self,
        worker_id: str,
        profile: SimProfile,
        *,
        remote: RemoteStore | None = None,
        on_events: Callable[[list[KVEvent]], object] | None = None,
        max_waiting: int | None = None,
        block_size: int | None = None,
        role: str = "both",
    ) -> None:
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"unknown worker role {role!r}; choose one of: prefill, decode, both")
        # Prefill/decode disaggregation: what the router may send here. The engine serves
        # any request either way: a prefill worker is sent prompts with max_tokens 1, a
        # decode worker requests whose KV it pulls first (`prefetch` from the prefill worker).
        self.role = role
        if block_size is not None and block_size != profile.block_size:
            profile = profile.with_block_size(block_size)
        self.worker_id = worker_id
        self.profile = profile
        self.bs = profile.block_size
        self.block_bytes = profile.block_bytes
        self.compute = profile.compute
        self.max_batched = profile.scheduler.max_num_batched_tokens
        self.max_seqs = profile.scheduler.max_num_seqs
        self.max_waiting = max_waiting if max_waiting is not None else profile.scheduler.max_waiting
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.prefetch_limit = profile.scheduler.prefetch_queue
        self.namespace = profile.namespace()
        self._hasher = BlockHasher.for_namespace(self.namespace)
        self.on_events = on_events
        if remote is not None and profile.remote is None:
            raise ValueError(f"profile {profile.name!r} has no remote tier: cannot join a remote group")
        if remote is not None and remote.block_size != self.bs:
            raise ValueError(
                f"remote store {remote.name!r} holds {remote.block_size}-token blocks, engine uses {self.bs}"
            )
        self.remote = remote
        disk = profile.disk
        self.admission = AdmissionFilter(disk.admit_after_uses, disk.admit_window_s) if disk is not None else None
        self.kv = _tiered_kv(profile, self.admission, remote, events=on_events is not None)
        self._max_tokens_ctx = profile.max_context_tokens
        self._capacity_tokens = self.kv.capacity * self.bs
        self.stats = EngineStats()
        self.loader = Loader(profile, self.kv, remote, self.stats)
        self.sched = Scheduler(profile, self.kv, self.loader, self.stats, self.admission)
        self.now = -_INF
        self._advancing = False

    # ------------------------------------------------------------------ requests

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request. Raises RequestTooLarge (→400), QueueFull (→429), BadRequest."""
        self.advance(now)
        self._check(req, now)
        keys, extra = self._keys(req)
        P = req.prompt_tokens
        job = Job(
            req=req,
            rid=req.request_id,
            prompt=P,
            max_tokens=req.max_tokens,
            keys=keys,
            cacheable=min(len(keys), (P - 1) // self.bs),  # the last prompt token is always computed
            extra=extra,
            salt=req.cache_salt or None,
            salt_from=max(0, req.shared_prefix_blocks),
            arrival=now,
            usage=Usage(P),
            streaming=req.on_tokens is not None,
            tokens=req.token_ids or (),
        )
        if job.cacheable:
            job.gpu_hint = self.kv.gpu_prefix(keys, job.cacheable)
            job.cached_hint = sum(1 for t in self.kv.match_tiers(keys[: job.cacheable]) if t is not None)
        self.sched.add(job)
        self.stats.submitted += 1
        self.stats.prompt_tokens += P
        self._poke(now)
        self._flush()

    def _check(self, req: SimRequest, now: float) -> None:
        """Refuse what the engine cannot take: malformed input, too large for the context or
        the KV pool, a request id in flight, a full waiting queue (429)."""
        P, M = req.prompt_tokens, req.max_tokens
        if P < 1:
            raise BadRequest("the prompt must have at least one token", param="prompt")
        if M < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        refused = self.profile.refusal(P, M)
        if refused is not None:
            self.stats.rejected_too_large += 1
            raise RequestTooLarge(refused[1], param=refused[0])
        if req.request_id in self.sched.jobs:
            raise BadRequest(f"request id {req.request_id!r} is already in flight", param="request_id")
        tokens = req.token_ids
        if tokens is not None and len(tokens) != P:
            raise BadRequest(f"token_ids has {len(tokens)} ids, prompt_tokens says {P}", param="prompt")
        if self.on_events is not None and tokens is None:
            raise ValueError("an engine that publishes KV events needs token_ids on every request")
        if len(self.sched.waiting) >= self.max_waiting:
            self.stats.rejected_queue_full += 1
            raise QueueFull(
                f"worker {self.worker_id} has {len(self.sched.waiting)} requests waiting (max_waiting)",
                retry_after=max(1.0, math.ceil(self.estimate_queue_s(now))),
            )

    def _keys(self, req: SimRequest) -> tuple[list[bytes], list[ExtraKeys | None] | None]:
        """The request's full-block keys (given, or hashed from its tokens) and, when the
        engine publishes events, each block's extra keys."""
        keys = req.keys
        scoped: Namespace | None = None
        if keys is None and req.token_ids is not None:
            scoped = self._scoped(req)
            keys = self._hasher.keys_for(req.token_ids, scoped)
        elif keys is None:
            keys = []
        elif len(keys) > req.prompt_tokens // self.bs:
            raise BadRequest(
                f"{len(keys)} block keys for a {req.prompt_tokens}-token prompt at block size {self.bs}", param="keys"
            )
        if self.on_events is None or not keys:
            return keys, None
        return keys, (scoped or self._scoped(req)).extra_keys(len(keys))

    def _scoped(self, req: SimRequest) -> Namespace:
        return self.namespace.scoped(
            lora=req.lora, cache_salt=req.cache_salt or "", shared_prefix_blocks=req.shared_prefix_blocks
        )

    def cancel(self, request_id: str, now: float) -> bool:
        """Drop a request wherever it is (no callback); False if unknown or finished."""
        self.advance(now)
        if not self.sched.cancel(request_id):
            return False
        self._poke(now)
        self._flush()
        return True

    def fail_all(self, now: float, message: str) -> int:
        """Abandon every accepted request (the worker is going away): each gets
        `on_error(now, message)`, all its blocks are released. Returns how many."""
        self.advance(now)
        jobs = list(self.sched.jobs.values())
        for job in jobs:
            self.cancel(job.rid, now)
            self.stats.cancelled -= 1
            cb = job.req.on_error
            if cb is not None:
                cb(now, message)
        self.sched.step = None  # the step in flight computed for requests that no longer exist
        return len(jobs)

    # ------------------------------------------------------------------ the clock

    def next_event_time(self) -> float | None:
        """When `advance` must next be called (a step end or a transfer); None when idle."""
        step = self.sched.step
        t = min(step.end if step is not None else _INF, self.loader.next_end())
        return None if t == _INF else t

    def advance(self, now: float) -> None:
        """Process every step end and transfer completion due at or before `now`."""
        if self._advancing:  # called from a callback: the outer loop carries on
            return
        self._advancing = True
        try:
            self._advance(now)
        finally:
            self._advancing = False

    def _advance(self, now: float) -> None:
        sched = self.sched
        loader = self.loader
        while True:
            step = sched.step
            link, t = loader.first_due(step.end if step is not None else _INF)
            if t > now:
                break
            self.now = t
            if link is not None:
                for job, recompute in loader.complete(link, t):
                    sched.loaded(job, t, recompute)
            else:
                sched.end_step(t)
            if sched.step is None:
                sched.schedule(t)
            self._flush()
        if now > self.now:
            self.now = now

    def _poke(self, now: float) -> None:
        """Something changed: let the GPU pick it up at the next step boundary."""
        step = self.sched.step
        if step is None:
            if not self._advancing:  # inside a callback, advance() starts the step afterwards
                self.sched.schedule(now)
        else:
            step.cut(now)

    def _flush(self) -> None:
        kv = self.kv
        if kv.events:
            ev = kv.take_events()
            if self.on_events is not None:
                self.on_events(ev)

    # ------------------------------------------------------------------ KV

    def prefetch(
        self,
        keys: list[bytes],
        now: float,
        deadline: float,
        prefetch_id: str,
        source: PeerSource | None = None,
    ) -> int:
        """Raise the leading `keys` toward GPU from wherever they sit (or from `source`, a
        peer, over the PEER link). Transfers not started by `deadline` are dropped.
        Returns the number of blocks accepted (0: nothing to do). Raises
        PrefetchQueueFull (→429) or BadRequest."""
        self.advance(now)
        inflight = self.loader.prefetches
        if prefetch_id in inflight:
            raise BadRequest(f"prefetch {prefetch_id!r} is already in flight", param="prefetch_id")
        if len(keys) > self._max_tokens_ctx // self.bs:
            raise BadRequest(f"{len(keys)} blocks exceed the model's context", param="keys_b64")
        if len(inflight) >= self.prefetch_limit:
            raise PrefetchQueueFull(f"worker {self.worker_id} has {len(inflight)} prefetches queued")
        accepted = self.loader.prefetch(keys, now, deadline, prefetch_id, None if source is self else source)
        self._flush()
        return accepted

    def cancel_prefetch(self, prefetch_id: str) -> bool:
        """Cancel a prefetch's transfers not yet moving; False if unknown or finished."""
        return self.loader.cancel_prefetch(prefetch_id)

    def state_events(self) -> list[KVEvent]:
        """Everything this worker holds, as events a fresh subscriber can rebuild it from
        (published on request: a gateway that restarted asks for it)."""
        meta = {**(self.remote.meta if self.remote is not None else {}), **self.kv.meta}
        return state_events(self.kv.snapshot(), meta, self.bs)

    def purge(self, cache_salt: str | None, everything: bool = False, *, lora: str | None = None) -> int:
        """Drop every block of chains salted with `cache_salt`, of LoRA adapter `lora` (an
        adapter version retired), or all blocks, from every tier; BlockRemoved is published."""
        dropped = self.kv.purge(cache_salt, everything, lora)
        if dropped:
            self.loader.forget_purged()
            self.sched.cut_purged(dropped)
        self._flush()
        return len(dropped)

    def corrupt(self, keys: list[bytes], tier: Tier) -> int:
        """Damage the stored copies of `keys` in `tier` (CPU, DISK or REMOTE), for failure
        scenarios: a load reads them, fails verification, drops them (BlockRemoved) and the
        request recomputes from the first damaged block. Returns how many were damaged."""
        return self.kv.mark_corrupt(keys, tier)

    def tiers_snapshot(self) -> dict[Tier, set[bytes]]:
        return self.kv.snapshot()

    def match_tiers(self, keys: list[bytes]) -> list[Tier | None]:
        """Fastest tier of each leading key, None from the first miss on."""
        return self.kv.match_tiers(keys)

    def block_metas(self, keys: list[bytes]) -> dict[bytes, BlockMeta]:
        """Metadata of the blocks this worker holds (a peer pulling them publishes it)."""
        meta = self.kv.meta
        rmeta = self.remote.meta if self.remote is not None else {}
        out: dict[bytes, BlockMeta] = {}
        for k in keys:
            m = meta.get(k) or rmeta.get(k)
            if m is not None:
                out[k] = m
        return out

    def holdings(self, keys: Sequence[bytes]) -> list[tuple[bytes, Tier]]:
        """Which of `keys` this worker holds, each in its fastest tier (peer export)."""
        tier_of = self.kv.tier_of
        out = []
        for k in keys:
            t = tier_of(k)
            if t is not None:
                out.append((k, t))
        return out

    # ------------------------------------------------------------------ reports

    def estimate_queue_s(self, now: float) -> float:
        """Wait before a request arriving now starts its prefill."""
        return self.sched.estimate_queue_s(now)

    def load_report(self, now: float) -> LoadReport:
        """The /load body of docs/wire.md (`ts` in the caller's time domain)."""
        c = self.compute
        s = self.sched
        b = len(s.decoding)
        return LoadReport(
            worker_id=self.worker_id,
            ts=now,
            waiting_requests=len(s.waiting),
            waiting_prefill_tokens=s.waiting_tokens,
            running_requests=len(s.loading) + len(s.prefilling) + b,
            running_prefill_tokens=s.running_prefill,
            est_queue_s=self.estimate_queue_s(now),
            blocks=self.kv.blocks_report(),
            speeds=Speeds(
                prefill_tokens_per_s=c.prefill_tokens_per_s,
                prefill_attn_s_per_token2=c.prefill_attn_s_per_token2,
                prefill_overhead_s=c.prefill_overhead_s,
                decode_step_s=c.decode_step_s(max(b, 1), s.decode_ctx if b else 0),
            ),
            tiers={t.name: TierLink(link.read_Bps, link.latency_s) for t, link in self.loader.links.items()},
            prefetch_queue=len(self.loader.prefetches),
            max_waiting=self.max_waiting,
            block_size=self.bs,
            profile=self.profile.name,
        )

    def info(self) -> WorkerInfo:
        """The /info body of docs/wire.md, without the URLs and endpoints the server adds."""
        ns = self.namespace
        caps = ["prefetch", "purge"]
        if Tier.PEER in self.loader.links:
            caps.insert(1, "peer_pull")
        return WorkerInfo(
            worker_id=self.worker_id,
            kind="kvroute",
            engine="sim",
            model=self.profile.model,
            served_model_names=list(self.profile.names()),
            namespace=NamespaceInfo(
                ns.model, ns.revision, ns.tokenizer_revision, ns.kv_dtype, ns.parallel, ns.block_size
            ),
            namespace_digest=ns.digest.hex(),
            block_size=self.bs,
            block_bytes=self.block_bytes,
            max_context_tokens=self._max_tokens_ctx,
            kv_capacity_tokens=self._capacity_tokens,
            remote_group=self.remote.name if self.remote is not None else None,
            capabilities=caps,
            role=self.role,
            profile=self.profile.name,
        )

    def counts(self) -> dict[str, int]:
        s = self.sched
        return {
            "waiting": len(s.waiting),
            "loading": len(s.loading),
            "prefilling": len(s.prefilling),
            "decoding": len(s.decoding),
            "prefetches": len(self.loader.prefetches),
        }

    def link_stats(self) -> dict[str, dict[str, float]]:
        return self.loader.link_stats()


def _tiered_kv(
    profile: SimProfile, admission: AdmissionFilter | None, remote: RemoteStore | None, *, events: bool
) -> TieredKV:
    return TieredKV(
        block_size=profile.block_size,
        block_bytes=profile.block_bytes,
        gpu_blocks=profile.gpu_blocks(),
        cpu_blocks=profile.tier_blocks(profile.cpu),
        disk_blocks=profile.tier_blocks(profile.disk),
        admission=admission,
        remote=remote,
        remote_write=profile.remote_write,
        events=events,
    )
