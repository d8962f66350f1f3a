"""Moving KV into GPU memory for the simulated engine: demand loads of scheduled
requests and prefetches, over one serialised link per tier (links.py).

Why apart from the scheduler: a load is priced and verified per transfer, and its
outcome (landed, damaged, dropped past its deadline) is link business; the scheduler
only learns which requests have their prefix in place (and how many prompt tokens a
damaged block now makes it recompute). The cut between loading and recomputing is
docs/sim-engine.md § Loads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvindex.tiers import Tier
from workers.blockmeta import BlockMeta

from .job import Job, Phase
from .kvcache import TieredKV
from .links import Link, Transfer
from .profile import SimProfile
from .remote import RemoteStore
from .stats import EngineStats

_INF = float("inf")

# Where each run of a request's leading blocks comes from: a tier below GPU (a new
# demand transfer) or a prefetch transfer already moving them.
LoadPlan = dict[Tier | Transfer, list[bytes]]


class PeerSource(Protocol):
    """What a prefetch needs from the worker it pulls from (a SimEngine, or a peer seen over HTTP)."""

    def match_tiers(self, keys: list[bytes]) -> list[Tier | None]: ...

    def block_metas(self, keys: list[bytes]) -> dict[bytes, BlockMeta]: ...


@dataclass(slots=True, eq=False)
class Prefetch:
    """One /kv/prefetch in flight: one transfer per source tier."""

    prefetch_id: str
    deadline: float
    transfers: list[Transfer]
    accepted: int
    pending: int
    metas: dict[bytes, BlockMeta] = field(default_factory=dict)
    landed: int = 0


def _links(profile: SimProfile, remote: RemoteStore | None) -> dict[Tier, Link]:
    links: dict[Tier, Link] = {}
    for tier, spec in ((Tier.CPU, profile.cpu), (Tier.DISK, profile.disk)):
        if spec is not None and profile.tier_blocks(spec) > 0:
            links[tier] = Link(tier, spec.read_Bps, spec.latency_s)
    if remote is not None and profile.remote is not None:
        links[Tier.REMOTE] = Link(Tier.REMOTE, profile.remote.read_Bps, profile.remote.latency_s)
    if profile.peer is not None:
        links[Tier.PEER] = Link(Tier.PEER, profile.peer.read_Bps, profile.peer.latency_s)
    return links


class Loader:
    """The links of one worker and everything moving on them; see the module doc."""

    def __init__(self, profile: SimProfile, kv: TieredKV, remote: RemoteStore | None, stats: EngineStats) -> None:
        self.kv = kv
        self.bs = profile.block_size
        self.block_bytes = profile.block_bytes
        self.compute = profile.compute
        self.remote = remote
        self.stats = stats
        self.links = _links(profile, remote)
        self.link_list = list(self.links.values())
        self.has_below = bool(kv.cpu is not None or kv.disk is not None or remote is not None)
        self.inflight: dict[bytes, Transfer] = {}  # keys moving up by a started prefetch
        self.prefetches: dict[str, Prefetch] = {}
        self.prefetched: dict[bytes, Tier] = {}  # landed by prefetch, not used yet -> source tier

    # ------------------------------------------------------------------ clock

    def next_end(self) -> float:
        """When the first transfer now moving completes (inf when every link is idle)."""
        t = _INF
        for link in self.link_list:
            b = link.busy
            if b is not None and b.end < t:
                t = b.end
        return t

    def first_due(self, t: float) -> tuple[Link | None, float]:
        """The link whose transfer completes first if that is at or before `t`, and when.
        On a tie the later link wins, and a link wins over a step ending at `t`."""
        first: Link | None = None
        for link in self.link_list:
            b = link.busy
            if b is not None and b.end <= t:
                t = b.end
                first = link
        return first, t

    # ------------------------------------------------------------------ demand loads

    def can_load(self) -> bool:
        return self.has_below or bool(self.inflight)

    def plan(self, job: Job, g: int, cap: int, t: float) -> tuple[LoadPlan, int]:
        """Leading blocks below GPU and the cut: load blocks [g, k), recompute the rest.

        Cost of cut k = when the last load lands + the prefill of what remains after k.
        Load time is linear in k within a run of one source and recompute is concave, so
        the minimum is at a run boundary: only those are tried. Returns (plan, k - g).
        """
        runs = self._runs(job.keys, g, cap)
        if not runs:
            return {}, 0
        best_k = self._best_cut(job.prompt, g, runs, t)
        keys = job.keys
        plan: LoadPlan = {}
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

    def _runs(self, keys: list[bytes], g: int, cap: int) -> list[tuple[Tier | Transfer, int]]:
        """(source, blocks) runs of the leading blocks from `g` that sit below GPU or are moving up."""
        inflight = self.inflight
        below = self.kv.below_tier_of
        srcs: list[Tier | Transfer] = []
        counts: list[int] = []
        i = g
        while i < cap:
            key = keys[i]
            src: Tier | Transfer | None = inflight.get(key) if inflight else None
            if src is None:
                src = below(key)
                if src is None:
                    break
            if srcs and srcs[-1] is src:
                counts[-1] += 1
            else:
                srcs.append(src)
                counts.append(1)
            i += 1
        return list(zip(srcs, counts, strict=True))

    def _best_cut(self, prompt: int, g: int, runs: list[tuple[Tier | Transfer, int]], t: float) -> int:
        """The block count to load up to that makes the first token earliest."""
        bs = self.bs
        pre = self.compute.prefill_s
        best_k = g
        best = pre(prompt - g * bs, g * bs)
        waits: dict[Tier, float] = {}
        blocks: dict[Tier, int] = {}
        inflight_end = 0.0
        pos = g
        bb = self.block_bytes
        links = self.links
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
            cost = load + pre(prompt - pos * bs, pos * bs)
            if cost <= best:
                best = cost
                best_k = pos
        return best_k

    def touch(self, plan: LoadPlan) -> None:
        """The planned source copies were just used (their tiers' LRU order)."""
        for src, ks in plan.items():
            if isinstance(src, Tier):
                self.kv.touch(src, ks)

    def count_gpu_hits(self, job: Job, g: int) -> None:
        """Usage of the `g` leading blocks found on GPU: those a prefetch landed count as
        loaded from the prefetch's source tier."""
        bs = self.bs
        u = job.usage
        lt = u.loaded_tokens
        gpu_tokens = g * bs
        pfd = self.prefetched
        if pfd and g:
            for key in job.keys[:g]:
                src_tier = pfd.pop(key, None)
                if src_tier is not None:
                    lt[src_tier.name] += bs
                    u.prefetched_tokens += bs
                    gpu_tokens -= bs
            if len(pfd) > 2 * self.kv.capacity:
                self.prefetched = {k: v for k, v in pfd.items() if k in self.kv.gpu}
        lt["GPU"] += gpu_tokens

    def start(self, job: Job, plan: LoadPlan, g: int, n_load: int, t: float) -> None:
        """Start a scheduled job's loads of blocks [g, g + n_load): join the prefetch
        transfers already moving some, queue demand transfers for the rest."""
        kv = self.kv
        bs = self.bs
        u = job.usage
        lt = u.loaded_tokens
        job.load_from = g
        job.load_to = g + n_load
        if n_load and kv.events_on:
            kv.add_meta(job.keys, g, g + n_load, job.tokens, job.extra, job.req.lora)
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

    def drop_job(self, job: Job) -> None:
        """A cancelled job's transfers not yet moving are dropped (moving ones land anyway)."""
        for link in self.link_list:
            link.drop_owner(job)

    # ------------------------------------------------------------------ completions

    def complete(self, link: Link, t: float) -> list[tuple[Job, int]]:
        """The transfer on `link` ends at `t`: land its blocks, start the next one.
        Returns the jobs that received a load, each with the prompt tokens a damaged
        block now makes it recompute."""
        done, dropped = link.complete(t)
        landed = self._demand_done(done) if done.demand else self._prefetch_done(done)
        self._link_changed(link, dropped)
        return landed

    def _demand_done(self, done: Transfer) -> list[tuple[Job, int]]:
        job: Job = done.owner
        bad = self.kv.verify(done.tier, done.keys)
        if job.phase is Phase.LOADING:
            return [(job, self._land_for(job, done.keys, bad))]
        self._land_cached(_before(done.keys, bad), done.tier, None)  # cancelled meanwhile: the bytes arrived anyway
        return []

    def _prefetch_done(self, done: Transfer) -> list[tuple[Job, int]]:
        inflight = self.inflight
        for key in done.keys:
            if inflight.get(key) is done:
                del inflight[key]
        bad = self.kv.verify(done.tier, done.keys)
        landed = [(job, self._land_for(job, ks, bad)) for job, ks in done.waiters if job.phase is Phase.LOADING]
        n = 0
        if not done.cancelled:
            pf: Prefetch = done.owner
            n = self._land_cached(_before(done.keys, bad), done.tier, pf.metas)
            self.stats.prefetch_blocks_landed += n
        self._prefetch_transfer_over(done, n)
        return landed

    def _land_for(self, job: Job, keys: list[bytes], bad: list[bytes]) -> int:
        """Land blocks a job loaded, pinned for it; returns the tokens it must now recompute."""
        lost = self._cut(job, bad) if bad else 0
        ks = self._still_keyed(job, keys)
        kv = self.kv
        if kv.events_on:  # the source copy may have been evicted meanwhile
            hi = min(job.load_to, len(job.keys))
            kv.add_meta(job.keys, job.load_from, hi, job.tokens, job.extra, job.req.lora)
        job.anon -= kv.land_pinned(ks, False)
        job.pinned.extend(ks)
        return lost

    def _still_keyed(self, job: Job, keys: list[bytes]) -> list[bytes]:
        """Loaded blocks still wanted: a purge may have cut the request's chain and a damaged
        block cuts its loads (what follows it is recomputed)."""
        if not job.cut:
            return keys
        keep = set(job.keys[job.load_from : min(job.load_to, len(job.keys))])
        return [k for k in keys if k in keep]

    def _cut(self, job: Job, bad: list[bytes]) -> int:
        """A loaded block failed verification: keep the loads before it, recompute from it.
        Returns the prompt tokens that became work again."""
        badset = set(bad)
        keys = job.keys
        idx = next((i for i in range(job.load_from, min(job.load_to, len(keys))) if keys[i] in badset), None)
        if idx is None:
            return 0
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
        if lost <= 0:
            return 0
        job.computed = idx * bs
        u.recomputed_tokens += lost
        return lost

    def _land_cached(self, keys: list[bytes], tier: Tier, metas: dict[bytes, BlockMeta] | None) -> int:
        """Land blocks nobody waits for as evictable GPU cache; returns how many landed."""
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
        pfd = self.prefetched
        for key in landed:
            pfd[key] = tier
        return len(landed)

    # ------------------------------------------------------------------ prefetches

    def prefetch(
        self, keys: list[bytes], now: float, deadline: float, prefetch_id: str, source: PeerSource | None
    ) -> int:
        """Queue transfers raising the leading `keys` not on GPU nor moving (from their
        tier, or over the PEER link from `source`); returns the blocks accepted."""
        plan = self._prefetch_plan(keys, source)
        accepted = sum(len(v) for v in plan.values())
        self.stats.prefetch_requests += 1
        if not accepted:
            return 0
        pf = Prefetch(prefetch_id, deadline, [], accepted, len(plan))
        if Tier.PEER in plan and self.kv.events_on and source is not None:
            pf.metas = source.block_metas(plan[Tier.PEER])
        self.prefetches[prefetch_id] = pf
        self.stats.prefetch_blocks_accepted += accepted
        for tier, ks in plan.items():
            self.kv.touch(tier, ks)
            tr = Transfer(tier, ks, len(ks) * self.block_bytes, pf, False, deadline)
            pf.transfers.append(tr)
            self._enqueue(tier, tr, now)
        return accepted

    def _prefetch_plan(self, keys: list[bytes], source: PeerSource | None) -> dict[Tier, list[bytes]]:
        gpu = self.kv.gpu
        inflight = self.inflight
        below = self.kv.below_tier_of
        peer_tiers: list[Tier | None] | None = None
        if source is not None and Tier.PEER in self.links:
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
        return plan

    def cancel_prefetch(self, prefetch_id: str) -> bool:
        """Cancel a prefetch's transfers not yet moving; False if unknown or finished."""
        pf = self.prefetches.pop(prefetch_id, None)
        if pf is None:
            return False
        for tr in pf.transfers:
            if tr.start != tr.start:  # nan: not started
                tr.cancelled = True
        return True

    def forget_purged(self) -> None:
        """After a purge: prefetched blocks no longer on GPU are no longer to be credited."""
        gpu = self.kv.gpu
        self.prefetched = {k: t for k, t in self.prefetched.items() if k in gpu}

    # ------------------------------------------------------------------ links

    def _enqueue(self, tier: Tier, tr: Transfer, now: float) -> None:
        link = self.links[tier]
        dropped = link.enqueue(tr, now)
        self._link_changed(link, dropped)

    def _link_changed(self, link: Link, dropped: list[Transfer]) -> None:
        for d in dropped:
            self._prefetch_transfer_over(d, 0)
            self.stats.prefetch_transfers_dropped += 1
        b = link.busy
        if b is not None and not b.demand and b.owner is not None:
            inflight = self.inflight
            for k in b.keys:
                inflight[k] = b

    def _prefetch_transfer_over(self, tr: Transfer, landed: int) -> None:
        pf: Prefetch = tr.owner
        pf.pending -= 1
        pf.landed += landed
        if pf.pending <= 0 and self.prefetches.get(pf.prefetch_id) is pf:
            del self.prefetches[pf.prefetch_id]

    def link_stats(self) -> dict[str, dict[str, float]]:
        return {
            t.name: {"bytes": link.bytes_moved, "busy_s": link.busy_s, "queued": link.queued(), "dropped": link.dropped}
            for t, link in self.links.items()
        }


def _before(keys: list[bytes], bad: list[bytes]) -> list[bytes]:
    """The leading keys before the first damaged one (all of them when none is)."""
    if not bad:
        return keys
    badset = set(bad)
    for i, k in enumerate(keys):
        if k in badset:
            return keys[:i]
    return keys
