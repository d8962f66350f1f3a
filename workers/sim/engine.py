"""The simulated engine core: a passive, synchronous, clock-free model of one worker.

It never reads a clock. Every call takes `now` in the caller's time domain (virtual
seconds in the offline simulator, `loop.time()` in the HTTP driver) and the engine
processes everything due up to it. The same code runs both ways.

API (fixed; the offline simulator and the HTTP driver code against it)::

    eng = SimEngine("w0", load_profile("h200-llama3.1-8b"), remote=store, on_events=cb,
                    max_waiting=None, block_size=None)
    eng.submit(SimRequest(...), now)     # raises RequestTooLarge (400), QueueFull (429)
    t = eng.next_event_time()            # when advance() must next be called; None = idle
    eng.advance(t)                       # process everything due at or before t
    eng.cancel(request_id, now) -> bool
    eng.prefetch(keys, now, deadline, prefetch_id, source=None) -> accepted blocks
    eng.cancel_prefetch(prefetch_id) -> bool
    eng.load_report(now) -> LoadReport   # the /load body of docs/wire.md (kvwire)
    eng.info() -> WorkerInfo             # the /info body, minus what the server adds
    eng.purge(cache_salt, everything=False) -> blocks dropped
    eng.estimate_queue_s(now) -> float   # wait before a request arriving now starts prefill
    eng.tiers_snapshot() -> {Tier: set of keys}
    eng.match_tiers(keys) -> [Tier | None]   # fastest tier per leading key, None after a miss

Driving it: after `submit`/`cancel`/`prefetch`, ask `next_event_time()` and call
`advance()` then (or later: `advance(now)` catches up on everything due). Calls must
come with non-decreasing `now`; every mutating call first advances to its `now`.

Requests (`SimRequest`): `keys` are the full-block keys (kvindex) if the caller has
them — the fast path: the offline simulator computes them once per trace block;
otherwise they are computed from `token_ids` under the profile's namespace scoped by
`cache_salt` / `shared_prefix_blocks` / `lora` (docs/wire.md § Block keys); with
neither, nothing of the request is cacheable. An engine with `on_events` needs
`token_ids` (published in `BlockStored`).

Callbacks: `on_first_token(t, usage)` once (the first token counts as one generated
token), then `on_tokens(t, n)` per decode step with the tokens of that step (a
request that sets `on_tokens` is simulated step by step; one that does not lets the
engine jump over whole decode spans), `on_finish(t, usage)` once at the end. `usage`
is the request's live `Usage` object (copy it to keep a snapshot). `on_error(t, msg)`
is called if the engine has to abandon an accepted request (`fail_all`, when the
worker goes away; not on `cancel`, which the caller asked for). `on_events(events)` receives the KV events of one instant;
`engine.now` is that instant.

Failure knobs (scenarios): `corrupt(keys, tier)` damages stored copies (read, rejected,
dropped with BlockRemoved, recomputed); `RemoteStore.set_available(False)` takes a
group's REMOTE backend down (lookups miss, writes are skipped); `purge(None, lora=...)`
retires a LoRA adapter's blocks; `fail_all(now, msg)` abandons everything in flight.

Timing model (profile.compute): a step costs the sum of its prefill chunks'
`overhead + n/tps + attn·n·(c + n/2)` (c = context before the chunk) plus, when it
decodes, `decode_base + per_seq·batch + per_ctx·context`. Loads of a cached prefix
go over the tier's link (workers/sim/links.py); the engine loads the leading cached
blocks only as far as loading beats recomputing them (the cut is evaluated at tier
boundaries, where the optimum lies), then prefills the rest. The first token comes
at the end of the step that computes the last prompt token; at least one prompt
token is always computed (as in vLLM).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvindex.events import KVEvent
from kvindex.keys import BlockHasher
from kvindex.tiers import Tier
from kvwire import LoadReport, NamespaceInfo, Speeds, TierLink, WorkerInfo

from workers.errors import BadRequest, PrefetchQueueFull, QueueFull, RequestTooLarge
from workers.usage import Usage

from .admission import AdmissionFilter
from .kvcache import BlockMeta, TieredKV
from .links import Link, Transfer
from .profile import SimProfile
from .remote import RemoteStore
from .scheduler import Job, Phase, Step

__all__ = [
    "BadRequest",
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


@dataclass
class SimRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    keys: list[bytes] | None = None
    token_ids: list[int] | None = None
    cache_salt: str | None = None
    shared_prefix_blocks: int = 0
    lora: str | None = None
    on_first_token: Callable[[float, Usage], None] | None = None
    on_tokens: Callable[[float, int], None] | None = None
    on_finish: Callable[[float, Usage], None] | None = None
    on_error: Callable[[float, str], None] | None = None


class PeerSource(Protocol):
    """What a prefetch needs from the worker it pulls from (a SimEngine, or a peer seen over HTTP)."""

    def match_tiers(self, keys: list[bytes]) -> list[Tier | None]: ...

    def block_metas(self, keys: list[bytes]) -> dict[bytes, BlockMeta]: ...


@dataclass(slots=True, eq=False)
class _Prefetch:
    prefetch_id: str
    deadline: float
    transfers: list[Transfer]
    accepted: int
    pending: int
    metas: dict[bytes, BlockMeta] = field(default_factory=dict)
    landed: int = 0


@dataclass(slots=True)
class EngineStats:
    """Counters for /metrics and benchmarks."""

    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected_too_large: int = 0
    rejected_queue_full: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    loaded_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("CPU", "DISK", "REMOTE", "PEER"), 0))
    steps: int = 0
    prefetch_requests: int = 0
    prefetch_blocks_accepted: int = 0
    prefetch_blocks_landed: int = 0
    prefetch_transfers_dropped: int = 0


class SimEngine:
    """One simulated worker; see the module doc."""

    def __init__(
        self,
        worker_id: str,
        profile: SimProfile,
        *,
        remote: RemoteStore | None = None,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        max_waiting: int | None = None,
        block_size: int | None = None,
    ) -> None:
        if block_size is not None and block_size != profile.block_size:
            profile = profile.with_block_size(block_size)
        self.worker_id = worker_id
        self.profile = profile
        self.bs = bs = profile.block_size
        self.block_bytes = profile.block_bytes
        self.compute = profile.compute
        sched = profile.scheduler
        self.max_batched = sched.max_num_batched_tokens
        self.max_seqs = sched.max_num_seqs
        self.max_waiting = max_waiting if max_waiting is not None else sched.max_waiting
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.prefetch_limit = sched.prefetch_queue
        self.namespace = profile.namespace()
        self._hasher = BlockHasher.for_namespace(self.namespace)
        self.on_events = on_events
        if remote is not None and profile.remote is None:
            raise ValueError(f"profile {profile.name!r} has no remote tier: cannot join a remote group")
        if remote is not None and remote.block_size != bs:
            raise ValueError(f"remote store {remote.name!r} holds {remote.block_size}-token blocks, engine uses {bs}")
        self.remote = remote
        disk = profile.disk
        self.admission = AdmissionFilter(disk.admit_after_uses, disk.admit_window_s) if disk is not None else None
        self.kv = TieredKV(
            block_size=bs,
            block_bytes=self.block_bytes,
            gpu_blocks=profile.gpu_blocks(),
            cpu_blocks=profile.tier_blocks(profile.cpu),
            disk_blocks=profile.tier_blocks(profile.disk),
            admission=self.admission,
            remote=remote,
            remote_write=profile.remote_write,
            events=on_events is not None,
        )
        self._links: dict[Tier, Link] = {}
        for tier, spec in ((Tier.CPU, profile.cpu), (Tier.DISK, profile.disk)):
            if spec is not None and profile.tier_blocks(spec) > 0:
                self._links[tier] = Link(tier, spec.read_Bps, spec.latency_s)
        if remote is not None and profile.remote is not None:
            self._links[Tier.REMOTE] = Link(Tier.REMOTE, profile.remote.read_Bps, profile.remote.latency_s)
        if profile.peer is not None:
            self._links[Tier.PEER] = Link(Tier.PEER, profile.peer.read_Bps, profile.peer.latency_s)
        self._link_list = list(self._links.values())
        self._has_below = bool(self.kv.cpu is not None or self.kv.disk is not None or remote is not None)
        self._max_tokens_ctx = profile.max_context_tokens
        self._capacity_tokens = self.kv.capacity * bs

        self.now = -_INF
        self._step: Step | None = None
        self._jobs: dict[str, Job] = {}
        self._waiting: deque[Job] = deque()
        self._loading: dict[str, Job] = {}
        self._prefilling: dict[str, Job] = {}
        self._decoding: dict[str, Job] = {}
        self._streaming = 0  # decoding jobs with on_tokens
        self._waiting_tokens = 0  # prompt tokens of waiting jobs minus their GPU hits at arrival
        self._running_prefill = 0  # prompt tokens still to compute of scheduled jobs
        self._decode_ctx = 0  # context tokens of the decoding jobs
        self._inflight: dict[bytes, Transfer] = {}  # keys moving up by a started prefetch
        self._prefetches: dict[str, _Prefetch] = {}
        self._prefetched: dict[bytes, Tier] = {}  # landed by prefetch, not used yet -> source tier
        self._advancing = False
        self.stats = EngineStats()

    # ================================================================== public API

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request. Raises RequestTooLarge (→400), QueueFull (→429), BadRequest."""
        self.advance(now)
        P, M = req.prompt_tokens, req.max_tokens
        if P < 1:
            raise BadRequest("the prompt must have at least one token", param="prompt")
        if M < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        if P + M > self._max_tokens_ctx:
            self.stats.rejected_too_large += 1
            raise RequestTooLarge(
                f"this model's maximum context length is {self._max_tokens_ctx} tokens; the request has "
                f"{P} prompt tokens + {M} max_tokens",
                param="max_tokens",
            )
        need = -(-(P + M) // self.bs)
        if need > self.kv.capacity:
            self.stats.rejected_too_large += 1
            raise RequestTooLarge(
                f"the request needs {need} KV blocks ({P} prompt + {M} max_tokens tokens) but this worker "
                f"holds {self.kv.capacity} ({self._capacity_tokens} tokens)",
                param="prompt",
            )
        if req.request_id in self._jobs:
            raise BadRequest(f"request id {req.request_id!r} is already in flight", param="request_id")
        tokens = req.token_ids
        if tokens is not None and len(tokens) != P:
            raise BadRequest(f"token_ids has {len(tokens)} ids, prompt_tokens says {P}", param="prompt")
        if self.on_events is not None and tokens is None:
            raise ValueError("an engine that publishes KV events needs token_ids on every request")
        if len(self._waiting) >= self.max_waiting:
            self.stats.rejected_queue_full += 1
            raise QueueFull(
                f"worker {self.worker_id} has {len(self._waiting)} requests waiting (max_waiting)",
                retry_after=max(1.0, math.ceil(self.estimate_queue_s(now))),
            )
        keys = req.keys
        extra = None
        scoped = None
        if keys is None and tokens is not None:
            scoped = self.namespace.scoped(
                lora=req.lora, cache_salt=req.cache_salt or "", shared_prefix_blocks=req.shared_prefix_blocks
            )
            keys = self._hasher.keys_for(tokens, scoped)
        elif keys is None:
            keys = []
        elif len(keys) > P // self.bs:
            raise BadRequest(f"{len(keys)} block keys for a {P}-token prompt at block size {self.bs}", param="keys")
        if self.on_events is not None and keys:
            if scoped is None:
                scoped = self.namespace.scoped(
                    lora=req.lora, cache_salt=req.cache_salt or "", shared_prefix_blocks=req.shared_prefix_blocks
                )
            extra = scoped.extra_keys(len(keys))
        job = Job(
            req,
            req.request_id,
            P,
            M,
            keys,
            min(len(keys), (P - 1) // self.bs),
            extra,
            req.cache_salt or None,
            max(0, req.shared_prefix_blocks),
            now,
            Usage(P),
            streaming=req.on_tokens is not None,
        )
        if job.cacheable:
            job.gpu_hint = self.kv.gpu_prefix(keys, job.cacheable)
        self._jobs[job.rid] = job
        self._waiting.append(job)
        self._waiting_tokens += P - job.gpu_hint * self.bs
        self.stats.submitted += 1
        self.stats.prompt_tokens += P
        self._poke(now)
        self._flush()

    def next_event_time(self) -> float | None:
        t = self._step.end if self._step is not None else _INF
        for link in self._link_list:
            if link.busy is not None and link.busy.end < t:
                t = link.busy.end
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
        links = self._link_list
        while True:
            step = self._step
            t = step.end if step is not None else _INF
            first: Link | None = None
            for link in links:
                b = link.busy
                if b is not None and b.end <= t:
                    t = b.end
                    first = link
            if t > now:
                break
            self.now = t
            if first is not None:
                self._on_link(first, t)
            else:
                self._on_step_end(t)
            if self._step is None:
                self._start_step(t)
            self._flush()
        if now > self.now:
            self.now = now

    def cancel(self, request_id: str, now: float) -> bool:
        """Drop a request wherever it is (no callback); False if unknown or finished."""
        self.advance(now)
        job = self._jobs.pop(request_id, None)
        if job is None:
            return False
        ph = job.phase
        if ph is Phase.WAITING:
            self._waiting.remove(job)
            self._waiting_tokens -= job.prompt - job.gpu_hint * self.bs
        else:
            if ph is Phase.LOADING:
                del self._loading[job.rid]
                for link in self._link_list:
                    link.drop_owner(job)
                self._running_prefill -= job.prompt - job.computed
            elif ph is Phase.PREFILL:
                # (absent when cancelled from its own on_first_token callback)
                self._prefilling.pop(job.rid, None)
                self._running_prefill -= job.prompt - job.computed
            elif ph is Phase.DECODE:
                del self._decoding[job.rid]
                self._decode_ctx -= job.prompt + job.generated
                if job.streaming:
                    self._streaming -= 1
            self.kv.unpin(job.pinned)
            self.kv.release(job.anon)
            job.pinned = []
            job.anon = 0
        job.phase = Phase.DONE
        self.stats.cancelled += 1
        self._poke(now)
        self._flush()
        return True

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
        if prefetch_id in self._prefetches:
            raise BadRequest(f"prefetch {prefetch_id!r} is already in flight", param="prefetch_id")
        if len(keys) > self._max_tokens_ctx // self.bs:
            raise BadRequest(f"{len(keys)} blocks exceed the model's context", param="keys_b64")
        if len(self._prefetches) >= self.prefetch_limit:
            raise PrefetchQueueFull(f"worker {self.worker_id} has {len(self._prefetches)} prefetches queued")
        if source is self:
            source = None
        kv = self.kv
        gpu = kv.gpu
        inflight = self._inflight
        below = kv.below_tier_of
        peer_tiers: list[Tier | None] | None = None
        if source is not None and Tier.PEER in self._links:
            peer_tiers = source.match_tiers(keys)
        plan: dict[Tier, list[bytes]] = {}
        for i, k in enumerate(keys):
            if k in gpu or k in inflight:
                continue
            t = below(k)
            if t is None and peer_tiers is not None and peer_tiers[i] is not None:
                t = Tier.PEER
            if t is None:
                break
            lst = plan.get(t)
            if lst is None:
                plan[t] = [k]
            else:
                lst.append(k)
        accepted = sum(len(v) for v in plan.values())
        self.stats.prefetch_requests += 1
        if not accepted:
            self._flush()
            return 0
        pf = _Prefetch(prefetch_id, deadline, [], accepted, len(plan))
        if Tier.PEER in plan and kv.events_on and source is not None:
            pf.metas = source.block_metas(plan[Tier.PEER])
        self._prefetches[prefetch_id] = pf
        self.stats.prefetch_blocks_accepted += accepted
        for tier, ks in plan.items():
            kv.touch(tier, ks)
            tr = Transfer(tier, ks, len(ks) * self.block_bytes, pf, False, deadline)
            pf.transfers.append(tr)
            self._enqueue(tier, tr, now)
        self._flush()
        return accepted

    def cancel_prefetch(self, prefetch_id: str) -> bool:
        """Cancel a prefetch's transfers not yet moving; False if unknown or finished."""
        pf = self._prefetches.pop(prefetch_id, None)
        if pf is None:
            return False
        for tr in pf.transfers:
            if tr.start != tr.start:  # nan: not started
                tr.cancelled = True
        return True

    def load_report(self, now: float) -> LoadReport:
        """The /load body of docs/wire.md (`ts` in the caller's time domain)."""
        c = self.compute
        b = len(self._decoding)
        return LoadReport(
            worker_id=self.worker_id,
            ts=now,
            waiting_requests=len(self._waiting),
            waiting_prefill_tokens=self._waiting_tokens,
            running_requests=len(self._loading) + len(self._prefilling) + b,
            running_prefill_tokens=self._running_prefill,
            est_queue_s=self.estimate_queue_s(now),
            blocks=self.kv.blocks_report(),
            speeds=Speeds(
                prefill_tokens_per_s=c.prefill_tokens_per_s,
                prefill_attn_s_per_token2=c.prefill_attn_s_per_token2,
                prefill_overhead_s=c.prefill_overhead_s,
                decode_step_s=c.decode_step_s(max(b, 1), self._decode_ctx if b else 0),
            ),
            tiers={t.name: TierLink(link.read_Bps, link.latency_s) for t, link in self._links.items()},
            prefetch_queue=len(self._prefetches),
            max_waiting=self.max_waiting,
            block_size=self.bs,
            profile=self.profile.name,
        )

    def info(self) -> WorkerInfo:
        """The /info body of docs/wire.md, without the URLs and endpoints the server adds."""
        ns = self.namespace
        caps = ["prefetch", "purge"]
        if Tier.PEER in self._links:
            caps.insert(1, "peer_pull")
        return WorkerInfo(
            worker_id=self.worker_id,
            kind="kvroute",
            engine="sim",
            model=self.profile.model,
            served_model_names=list(self.profile.names()),
            namespace=NamespaceInfo(ns.model, ns.revision, ns.tokenizer_revision, ns.kv_dtype, ns.parallel, ns.block_size),
            namespace_digest=ns.digest.hex(),
            block_size=self.bs,
            block_bytes=self.block_bytes,
            max_context_tokens=self._max_tokens_ctx,
            kv_capacity_tokens=self._capacity_tokens,
            remote_group=self.remote.name if self.remote is not None else None,
            capabilities=caps,
            profile=self.profile.name,
        )

    def purge(self, cache_salt: str | None, everything: bool = False, *, lora: str | None = None) -> int:
        """Drop every block of chains salted with `cache_salt`, of LoRA adapter `lora` (an
        adapter version retired), or all blocks, from every tier; BlockRemoved is published."""
        dropped = self.kv.purge(cache_salt, everything, lora)
        if dropped:
            self._prefetched = {k: t for k, t in self._prefetched.items() if k in self.kv.gpu}
            # Requests still computing a purged chain must not cache what follows it:
            # their later blocks would hang off a parent that no longer exists.
            for group in (self._loading, self._prefilling):
                for job in group.values():
                    for i, key in enumerate(job.keys):
                        if key in dropped:
                            job.keys = job.keys[:i]
                            job.cacheable = min(job.cacheable, i)
                            job.cut = True
                            break
        self._flush()
        return len(dropped)

    def fail_all(self, now: float, message: str) -> int:
        """Abandon every accepted request (the worker is going away): each gets
        `on_error(now, message)`, all its blocks are released. Returns how many."""
        self.advance(now)
        jobs = list(self._jobs.values())
        for job in jobs:
            self.cancel(job.rid, now)
            self.stats.cancelled -= 1
            cb = job.req.on_error
            if cb is not None:
                cb(now, message)
        self._step = None  # the step in flight computed for requests that no longer exist
        return len(jobs)

    def corrupt(self, keys: list[bytes], tier: Tier) -> int:
        """Damage the stored copies of `keys` in `tier` (CPU, DISK or REMOTE), for failure
        scenarios: they stay listed (and published), a load reads them (its time is spent),
        verification fails, they are dropped with BlockRemoved, counted in
        `kv.checksum_errors`, and the request recomputes from the first damaged block.
        Returns how many copies were damaged."""
        return self.kv.mark_corrupt(keys, tier)

    def estimate_queue_s(self, now: float) -> float:
        """Wait before a request arriving now starts its prefill: the step in progress, the
        prompt work queued ahead (with the decode batch riding along in every step), and,
        when the GPU pool cannot hold the waiting requests, the decode time until enough
        running requests finish."""
        step = self._step
        left = 0.0
        if step is not None:
            end = step.end if step.k <= 1 else step.end_after(step.boundary_after(now))
            left = max(0.0, end - now)
        c = self.compute
        work = 0.0
        tokens = 0
        bs = self.bs
        for job in self._waiting:
            cached = job.gpu_hint * bs
            n = job.prompt - cached
            work += c.prefill_s(n, cached)
            tokens += n
        for group in (self._loading, self._prefilling):
            for job in group.values():
                n = job.prompt - job.computed
                work += c.prefill_s(n, job.computed)
                tokens += n
        b = len(self._decoding)
        if tokens and b:
            steps = math.ceil(tokens / max(1, self.max_batched - b))
            work += steps * c.decode_step_s(b, self._decode_ctx)
        return left + work + self._memory_wait_s()

    def tiers_snapshot(self) -> dict[Tier, set[bytes]]:
        return self.kv.snapshot()

    def match_tiers(self, keys: list[bytes]) -> list[Tier | None]:
        return self.kv.match_tiers(keys)

    # ---------------------------------------------------------------- peers, views

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

    def counts(self) -> dict[str, int]:
        return {
            "waiting": len(self._waiting),
            "loading": len(self._loading),
            "prefilling": len(self._prefilling),
            "decoding": len(self._decoding),
            "prefetches": len(self._prefetches),
        }

    def link_stats(self) -> dict[str, dict[str, float]]:
        return {
            t.name: {"bytes": l.bytes_moved, "busy_s": l.busy_s, "queued": l.queued(), "dropped": l.dropped}
            for t, l in self._links.items()
        }

    # ================================================================== internals

    def _flush(self) -> None:
        kv = self.kv
        if kv.events:
            ev = kv.take_events()
            if self.on_events is not None:
                self.on_events(ev)

    def _poke(self, now: float) -> None:
        """Something changed: let the GPU pick it up at the next step boundary."""
        if self._step is None:
            if not self._advancing:  # inside a callback, advance() starts the step afterwards
                self._start_step(now)
        else:
            self._step.cut(now)

    def _enqueue(self, tier: Tier, tr: Transfer, now: float) -> None:
        link = self._links[tier]
        dropped = link.enqueue(tr, now)
        self._link_changed(link, dropped)

    def _link_changed(self, link: Link, dropped: list[Transfer]) -> None:
        for d in dropped:
            self._prefetch_transfer_over(d, 0)
            self.stats.prefetch_transfers_dropped += 1
        b = link.busy
        if b is not None and not b.demand and b.owner is not None:
            inflight = self._inflight
            for k in b.keys:
                inflight[k] = b

    def _prefetch_transfer_over(self, tr: Transfer, landed: int) -> None:
        pf: _Prefetch = tr.owner
        pf.pending -= 1
        pf.landed += landed
        if pf.pending <= 0 and self._prefetches.get(pf.prefetch_id) is pf:
            del self._prefetches[pf.prefetch_id]

    # ------------------------------------------------------------------ steps

    def _start_step(self, t: float) -> None:
        budget = self.max_batched
        decode = list(self._decoding.values())
        budget -= len(decode)
        chunks: list[tuple[Job, int]] = []
        for job in self._prefilling.values():
            if budget <= 0:
                break
            n = min(job.prompt - job.computed, budget)
            chunks.append((job, n))
            budget -= n
        blocked = False
        waiting = self._waiting
        while waiting and budget > 0:
            if len(self._loading) + len(self._prefilling) + len(self._decoding) >= self.max_seqs:
                blocked = True
                break
            job = waiting[0]
            if not self._admit(job, t):
                blocked = True
                break
            waiting.popleft()
            if job.phase is Phase.PREFILL:
                n = min(job.prompt - job.computed, budget)
                chunks.append((job, n))
                budget -= n
        if not chunks and not decode:
            self._step = None
            return
        c = self.compute
        prefill_s = 0.0
        for job, n in chunks:
            prefill_s += c.prefill_s(n, job.computed)
        a = slope = 0.0
        k = 1
        if decode:
            b = len(decode)
            a = c.decode_step_s(b, self._decode_ctx)
            slope = c.decode_per_ctx_token_s * b
            if not chunks and not self._prefilling and not self._streaming and (blocked or not waiting):
                k = min(j.max_tokens - j.generated for j in decode)
        step = Step(t, 0.0, chunks, decode, max(k, 1), prefill_s, a, slope)
        step.end = step.end_after(step.k) if decode else t + prefill_s
        self._step = step
        self.stats.steps += 1

    def _on_step_end(self, t: float) -> None:
        step = self._step
        assert step is not None
        self._step = None
        kv = self.kv
        bs = self.bs
        events_on = kv.events_on
        stats = self.stats
        for job, n in step.prefill:
            if job.phase is not Phase.PREFILL:
                continue
            before = job.computed
            after = before + n
            job.computed = after
            self._running_prefill -= n
            stats.computed_tokens += n
            lo = before // bs
            hi = min(after // bs, len(job.keys))
            if hi > lo:
                if events_on:
                    kv.add_meta(job.keys, lo, hi, job.req.token_ids, job.extra, job.req.lora)
                ks = job.keys[lo:hi]
                job.anon -= kv.land_pinned(ks, True)
                job.pinned.extend(ks)
            if after >= job.prompt:
                self._first_token(job, t)
        k = step.k
        for job in step.decode:
            if job.phase is not Phase.DECODE:
                continue
            job.generated += k
            self._decode_ctx += k
            stats.generated_tokens += k
            cb = job.req.on_tokens
            if cb is not None:
                cb(t, k)
            if job.generated >= job.max_tokens and job.phase is Phase.DECODE:
                self._finish(job, t)

    def _first_token(self, job: Job, t: float) -> None:
        del self._prefilling[job.rid]
        job.generated = 1
        job.first_at = t
        u = job.usage
        u.completion_tokens = 1
        u.prefill_ms = (t - job.loaded_at) * 1000.0
        u.ttft_ms = (t - job.arrival) * 1000.0
        self.stats.generated_tokens += 1
        cb = job.req.on_first_token
        if cb is not None:
            cb(t, u)
        if job.phase is Phase.DONE:  # cancelled from the callback
            return
        if job.max_tokens <= 1:
            self._finish(job, t)
            return
        job.phase = Phase.DECODE
        self._decoding[job.rid] = job
        self._decode_ctx += job.prompt + 1
        if job.streaming:
            self._streaming += 1

    def _finish(self, job: Job, t: float) -> None:
        if job.phase is Phase.DECODE:
            del self._decoding[job.rid]
            self._decode_ctx -= job.prompt + job.generated
            if job.streaming:
                self._streaming -= 1
        job.phase = Phase.DONE
        self._jobs.pop(job.rid, None)
        self.kv.unpin(job.pinned)
        self.kv.release(job.anon)
        job.pinned = []
        job.anon = 0
        u = job.usage
        u.completion_tokens = job.generated
        u.decode_ms = (t - job.first_at) * 1000.0
        self.stats.finished += 1
        cb = job.req.on_finish
        if cb is not None:
            cb(t, u)

    # ------------------------------------------------------------------ scheduling

    def _admit(self, job: Job, t: float) -> bool:
        """Schedule the head of the queue if the GPU pool can hold it; plan its loads."""
        kv = self.kv
        bs = self.bs
        keys = job.keys
        cap = job.cacheable
        g = kv.gpu_prefix(keys, cap) if cap else 0
        plan: dict[Any, list[bytes]] = {}
        n_load = 0
        if g < cap and (self._has_below or self._inflight):
            plan, n_load = self._plan_loads(job, g, cap, t)
        need = -(-(job.prompt + job.max_tokens) // bs) - g
        if kv.available() - (kv.evictable_among(keys[:g]) if g else 0) < need:
            return False
        # commit
        adm = self.admission
        if adm is not None and adm.active and keys:
            adm.seen(keys, t)
        if job.salt and len(keys) > job.salt_from:
            kv.note_tag("salt", keys[job.salt_from :], job.salt)
        if job.req.lora and keys:
            kv.note_tag("lora", keys, job.req.lora)
        for src, ks in plan.items():
            if isinstance(src, Tier):
                kv.touch(src, ks)
        if g:
            hits = keys[:g]
            kv.pin(hits)
            job.pinned = hits
        kv.reserve(need)
        job.anon = need
        u = job.usage
        lt = u.loaded_tokens
        gpu_tokens = g * bs
        pfd = self._prefetched
        if pfd and g:
            for key in keys[:g]:
                src_tier = pfd.pop(key, None)
                if src_tier is not None:
                    lt[src_tier.name] += bs
                    u.prefetched_tokens += bs
                    gpu_tokens -= bs
            if len(pfd) > 2 * kv.capacity:
                self._prefetched = {k2: v for k2, v in pfd.items() if k2 in kv.gpu}
        lt["GPU"] += gpu_tokens
        job.load_from = g
        job.load_to = g + n_load
        if n_load and kv.events_on:
            kv.add_meta(keys, g, g + n_load, job.req.token_ids, job.extra, job.req.lora)
        for src, ks in plan.items():
            ntok = len(ks) * bs
            if isinstance(src, Transfer):
                src.waiters.append((job, ks))
                lt[src.tier.name] += ntok
                u.prefetched_tokens += ntok
                job.loads.append((src.tier.name, ks, True))
            else:
                lt[src.name] += ntok
                job.loads.append((src.name, ks, False))
                self.stats.loaded_blocks[src.name] += len(ks)
                self._enqueue(src, Transfer(src, ks, len(ks) * self.block_bytes, job, True), t)
            job.pending += 1
        job.computed = (g + n_load) * bs
        job.scheduled_at = t
        u.queue_ms = (t - job.arrival) * 1000.0
        u.recomputed_tokens = job.prompt - job.computed
        self._waiting_tokens -= job.prompt - job.gpu_hint * bs
        self._running_prefill += job.prompt - job.computed
        if job.pending:
            job.phase = Phase.LOADING
            self._loading[job.rid] = job
        else:
            job.phase = Phase.PREFILL
            job.loaded_at = t
            self._prefilling[job.rid] = job
        return True

    def _plan_loads(self, job: Job, g: int, cap: int, t: float) -> tuple[dict[Any, list[bytes]], int]:
        """Leading blocks below GPU and the cut: load blocks [g, k), recompute the rest.

        Cost of cut k = when the last load lands (each tier's link: its queue, latency,
        bytes/bandwidth; blocks a started prefetch is moving: that transfer's end) + the
        prefill of what remains after k. Load time is linear in k within a tier run and
        recompute is concave, so the minimum is at a run boundary: only those are tried.
        """
        keys = job.keys
        kv = self.kv
        inflight = self._inflight
        below = kv.below_tier_of
        runs: list[list[Any]] = []
        i = g
        while i < cap:
            key = keys[i]
            src: Any = inflight.get(key) if inflight else None
            if src is None:
                src = below(key)
                if src is None:
                    break
            if runs and runs[-1][0] is src:
                runs[-1][1] += 1
            else:
                runs.append([src, 1])
            i += 1
        if not runs:
            return {}, 0
        bs = self.bs
        P = job.prompt
        pre = self.compute.prefill_s
        best_k = g
        best = pre(P - g * bs, g * bs)
        waits: dict[Tier, float] = {}
        blocks: dict[Tier, int] = {}
        inflight_end = 0.0
        pos = g
        bb = self.block_bytes
        links = self._links
        for src, cnt in runs:
            pos += cnt
            if isinstance(src, Transfer):
                inflight_end = max(inflight_end, src.end - t)
            else:
                if src not in waits:
                    waits[src] = links[src].wait_s(t)
                    blocks[src] = 0
                blocks[src] += cnt
            load = inflight_end
            for tier, nb in blocks.items():
                lt = waits[tier] + links[tier].cost_s(nb * bb)
                if lt > load:
                    load = lt
            cost = load + pre(P - pos * bs, pos * bs)
            if cost <= best:
                best = cost
                best_k = pos
        plan: dict[Any, list[bytes]] = {}
        idx = g
        for src, cnt in runs:
            take = min(cnt, best_k - idx)
            if take <= 0:
                break
            lst = plan.get(src)
            if lst is None:
                plan[src] = keys[idx : idx + take]
            else:
                lst.extend(keys[idx : idx + take])
            idx += take
        return plan, best_k - g

    def _on_link(self, link: Link, t: float) -> None:
        done, dropped = link.complete(t)
        kv = self.kv
        if done.demand:
            job: Job = done.owner
            bad = kv.verify(done.tier, done.keys)
            if job.phase is Phase.LOADING:
                if bad:
                    self._cut_loads(job, bad)
                ks = self._still_keyed(job, done.keys)
                if kv.events_on:  # the source copy may have been evicted meanwhile
                    kv.add_meta(job.keys, job.load_from, min(job.load_to, len(job.keys)), job.req.token_ids, job.extra, job.req.lora)
                job.anon -= kv.land_pinned(ks, False)
                job.pinned.extend(ks)
                self._load_landed(job, t)
            else:  # cancelled meanwhile: the bytes arrived anyway
                self._land_cached(_before(done.keys, bad), done.tier, None)
        else:
            inflight = self._inflight
            for key in done.keys:
                if inflight.get(key) is done:
                    del inflight[key]
            bad = kv.verify(done.tier, done.keys)
            for job, ks in done.waiters:
                if job.phase is not Phase.LOADING:
                    continue
                if bad:
                    self._cut_loads(job, bad)
                ks = self._still_keyed(job, ks)
                if kv.events_on:
                    kv.add_meta(job.keys, job.load_from, min(job.load_to, len(job.keys)), job.req.token_ids, job.extra, job.req.lora)
                job.anon -= kv.land_pinned(ks, False)
                job.pinned.extend(ks)
                self._load_landed(job, t)
            landed = 0
            if not done.cancelled:
                pf: _Prefetch = done.owner
                landed = self._land_cached(_before(done.keys, bad), done.tier, pf.metas)
                self.stats.prefetch_blocks_landed += landed
            self._prefetch_transfer_over(done, landed)
        self._link_changed(link, dropped)

    def _still_keyed(self, job: Job, keys: list[bytes]) -> list[bytes]:
        """Loaded blocks still wanted: a purge may have cut the request's chain and a damaged
        block cuts its loads (what follows it is recomputed)."""
        if not job.cut:
            return keys
        keep = set(job.keys[job.load_from : min(job.load_to, len(job.keys))])
        return [k for k in keys if k in keep]

    def _cut_loads(self, job: Job, bad: list[bytes]) -> None:
        """A loaded block failed verification: use the loads before it, recompute from it."""
        badset = set(bad)
        keys = job.keys
        idx = next((i for i in range(job.load_from, min(job.load_to, len(keys))) if keys[i] in badset), None)
        if idx is None:
            return
        after = set(keys[idx : job.load_to])
        bs = self.bs
        u = job.usage
        for tname, ks, prefetched in job.loads:
            n = sum(1 for k in ks if k in after) * bs
            u.loaded_tokens[tname] -= n
            if prefetched:
                u.prefetched_tokens -= n
        job.load_to = idx
        job.cut = True
        lost = job.computed - idx * bs
        if lost > 0:
            job.computed = idx * bs
            self._running_prefill += lost
            u.recomputed_tokens += lost

    def _land_cached(self, keys: list[bytes], tier: Tier, metas: dict[bytes, BlockMeta] | None) -> int:
        kv = self.kv
        if kv.events_on:
            source = self.remote.meta if tier is Tier.REMOTE and self.remote is not None else metas
            if source is not None:
                kv.copy_meta(keys, source)
            meta = kv.meta
            # keys come in chain order: stop at a block whose metadata vanished with its
            # source copy, or its children would be published without a parent
            for i, k in enumerate(keys):
                if k not in meta:
                    keys = keys[:i]
                    break
        landed = kv.land_cached(keys)
        pfd = self._prefetched
        for key in landed:
            pfd[key] = tier
        return len(landed)

    def _load_landed(self, job: Job, t: float) -> None:
        job.pending -= 1
        if job.pending == 0:
            del self._loading[job.rid]
            job.phase = Phase.PREFILL
            job.loaded_at = t
            job.usage.load_ms = (t - job.scheduled_at) * 1000.0
            self._prefilling[job.rid] = job
            if self._step is not None:
                self._step.cut(t)

    def _memory_wait_s(self) -> float:
        """Decode time until finishing requests free the blocks the waiting queue needs."""
        if not self._waiting:
            return 0.0
        bs = self.bs
        need = 0
        for job in self._waiting:
            need += -(-(job.prompt + job.max_tokens) // bs) - job.gpu_hint
        deficit = need - self.kv.available()
        if deficit <= 0 or not self._decoding:
            return 0.0
        freed = 0
        c = self.compute
        step_s = c.decode_step_s(len(self._decoding), self._decode_ctx)
        for job in sorted(self._decoding.values(), key=lambda j: j.max_tokens - j.generated):
            freed += job.anon + len(job.pinned)
            if freed >= deficit:
                return (job.max_tokens - job.generated) * step_s
        return max(j.max_tokens - j.generated for j in self._decoding.values()) * step_s


def _before(keys: list[bytes], bad: list[bytes]) -> list[bytes]:
    """The leading keys before the first damaged one (all of them when none is)."""
    if not bad:
        return keys
    badset = set(bad)
    for i, k in enumerate(keys):
        if k in badset:
            return keys[:i]
    return keys
