"""Moving blocks up into the device pool: a request's loads, and prefetches ahead of it.

- **Loads** (`plan`/`start`, at admission, under the lock): a request's next blocks after
  its device prefix, from the in-flight prefetch moving them (it joins that transfer),
  CPU, DISK, or REMOTE (speculative: the link asks the server which exist, then reads
  them), up to the cut where loading stops beating recompute. One transfer per source
  tier, each into the request's own pool blocks; when all have landed the leading intact
  run is registered and the rest recomputed.
- **Prefetch** (`prefetch`, the /kv/prefetch handler, under the lock): the same from a
  bounded queue, into pool blocks the prefetch holds, landed as cached blocks in chain
  order when its transfers are done; `source_peer` pulls from a peer's /kv/blocks.

Both live here because they meet: a load joins a prefetch moving its blocks, and a
prefetch landing finishes the loads waiting on it. Link threads call `transfer_done`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvindex.tiers import Tier
from workers.blockmeta import BlockMeta
from workers.errors import BadRequest, PrefetchQueueFull

from .hostpool import Slot
from .links import Transfer
from .sequence import Sequence
from .tierstate import TierState

MIN_FIT_SAMPLES = 8  # prefill timings before the load-or-recompute cut trusts the fit (calibration gives 8)


@dataclass(slots=True, eq=False)
class Load:
    """A request's blocks [start, start + len(sources)) moving up before its prefill."""

    seq: Sequence
    start: int
    sources: list[Tier | Prefetch]
    ok: list[bool] = field(default_factory=list)
    absent: set[int] = field(default_factory=set)  # positions the source did not have (not a fault)
    pins: dict[int, int] = field(default_factory=dict)  # position -> prefetched pool block held for it
    cpu: dict[int, Slot] = field(default_factory=dict)  # position -> CPU slot pinned as its source
    transfers: list[Transfer] = field(default_factory=list)
    pending: int = 0
    done: bool = False


@dataclass(slots=True, eq=False)
class Prefetch:
    pid: str
    keys: list[bytes]
    tiers: list[Tier]
    dst: list[int]
    deadline: float
    pos: dict[bytes, int] = field(default_factory=dict)  # key -> index in keys
    transfers: list[Transfer] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    metas: list[Any] = field(default_factory=list)
    waiters: list[tuple[Load, list[int]]] = field(default_factory=list)
    pending: int = 0
    cancelled: bool = False
    void: bool = False  # a purge happened meanwhile: land nothing


class Loads:
    """Loads and prefetches over a `TierState` (see the module doc)."""

    def __init__(self, st: TierState, *, on_loaded: Callable[[Sequence, int, dict[Tier, int], int], None],
                 prefill_cost: Callable[[int, int], float | None], prefill_samples: Callable[[], int]) -> None:
        self.st = st
        self.on_loaded = on_loaded
        self.prefill_cost = prefill_cost
        self.prefill_samples = prefill_samples

    # ------------------------------------------------------------------ loads (under the lock)

    def plan(self, seq: Sequence, gpu_blocks: int) -> Load | None:
        """The blocks after the device prefix that lower tiers (or a prefetch) can provide,
        up to the cut where loading stops paying; None when nothing is worth loading."""
        st = self.st
        host = st.host
        remote_ok = st.remote is not None and not st.remote.breaker.is_open
        srcs: list[Tier | Prefetch] = []
        for i in range(gpu_blocks, seq.cacheable_blocks):
            k = seq.key(i)
            src: Tier | Prefetch | None = st.inflight.get(k)
            if src is None:
                src = st.below_tier(k)
            if src is None:
                if not remote_ok:
                    break
                src = Tier.REMOTE
            srcs.append(src)
        cut = self._best_cut(seq, gpu_blocks, srcs) if srcs else 0
        if not cut:
            return None
        load = Load(seq, gpu_blocks, srcs[:cut])
        if host is not None:  # pinned now: admitting the request makes room, which may evict CPU blocks
            for j, src in enumerate(load.sources):
                if src is Tier.CPU:
                    s = host.by_key[seq.key(gpu_blocks + j)]
                    host.pin(s)
                    load.cpu[j] = s
        return load

    def abandon(self, load: Load) -> None:
        """A planned load the scheduler could not admit (no room yet): unpin its sources."""
        if self.st.host is not None:
            for s in load.cpu.values():
                self.st.host.unpin(s)
        load.cpu.clear()

    def _best_cut(self, seq: Sequence, g: int, srcs: list[Tier | Prefetch]) -> int:
        """How many blocks to load so that the first token comes earliest: each tier's link
        loads its share (latency + bytes / bandwidth, links side by side), the rest is
        prefilled after them. Only run boundaries are candidates (load time is linear within
        a run, recompute concave)."""
        st = self.st
        bs = st.bs
        n = seq.num_tokens
        base = self.prefill_cost(n - g * bs, g * bs)
        if base is None or self.prefill_samples() < MIN_FIT_SAMPLES:
            return len(srcs)  # the prefill fit is not to be trusted yet: load everything
        best, best_k = base, 0
        count: dict[Tier, int] = {}
        for j, src in enumerate(srcs):
            if isinstance(src, Tier):
                count[src] = count.get(src, 0) + 1
            if j + 1 < len(srcs) and srcs[j + 1] is src:
                continue
            load_s = max((st.links[t].meter.cost_s(c * st.block_bytes) for t, c in count.items()), default=0.0)
            pos = g + j + 1
            cost = load_s + (self.prefill_cost(n - pos * bs, pos * bs) or 0.0)
            if cost <= best:
                best, best_k = cost, j + 1
        return best_k

    def start(self, load: Load) -> None:
        """Start the loads of an admitted request into its pool blocks (it holds them now)."""
        st = self.st
        seq = load.seq
        load.ok = [False] * len(load.sources)
        seq.loading = load
        groups: dict[Tier, list[int]] = {}
        joined: dict[int, tuple[Prefetch, list[int]]] = {}
        for j, src in enumerate(load.sources):
            if isinstance(src, Prefetch):
                joined.setdefault(id(src), (src, []))[1].append(j)
            else:
                groups.setdefault(src, []).append(j)
        for pf, js in joined.values():
            pf.waiters.append((load, js))
            load.pending += 1
        for tier, js in groups.items():
            keys = [seq.key(load.start + j) for j in js]
            dst = [seq.block_table[load.start + j] for j in js]
            t = Transfer(tier, keys, dst, (load, js), True, after=st.offload_event)
            if tier is Tier.CPU:
                t.source = [load.cpu[j] for j in js]  # pinned by `plan`, unpinned when it lands
                assert st.host is not None
                st.host.touch(keys)
            load.transfers.append(t)
            load.pending += 1
            st.links[tier].enqueue(t)

    def cancel(self, seq: Sequence) -> None:
        """The request went away while loading: its transfers not started are dropped (those
        moving land; the request is released when all are done)."""
        load: Load | None = seq.loading
        if load is None:
            return
        for t in list(load.transfers):
            if not t.started and self.st.links[t.tier].remove(t):
                t.cancelled = True
                self.transfer_done(t)

    def transfer_done(self, t: Transfer) -> None:
        """A transfer ended (landed, failed, cancelled or expired): under the lock."""
        st = self.st
        if t.tier is Tier.CPU and t.source is not None:
            assert st.host is not None
            for s in t.source:
                st.host.unpin(s)
            t.source = None
        owner, js = t.owner
        if isinstance(owner, Prefetch):
            for j, ok, m in zip(js, t.ok, t.metas, strict=True):
                owner.ok[j] = ok
                owner.metas[j] = m
            owner.pending -= 1
            if owner.pending == 0:
                self._land_prefetch(owner)
        else:
            for j, ok in zip(js, t.ok, strict=True):
                owner.ok[j] = ok
            if t.absent_from is not None:
                owner.absent.update(js[t.absent_from:])
            owner.pending -= 1
            if owner.pending == 0:
                self._finish_load(owner)
        st.changed()

    def _finish_load(self, load: Load) -> None:
        st = self.st
        seq = load.seq
        landed = 0
        while landed < len(load.ok) and load.ok[landed]:
            landed += 1
        for j, owner in load.pins.items():
            pos = load.start + j
            if j < landed:
                mine = seq.block_table[pos]
                seq.block_table[pos] = owner
                st.blocks.release_block(mine)
            else:
                st.blocks.release_block(owner)
        load.pins.clear()
        by_tier, prefetched = self._count_landed(load, landed)
        if st.host is not None:
            st.host.touch([seq.key(load.start + j) for j in range(landed) if load.sources[j] is Tier.CPU])
        load.done = True
        seq.loading = None
        self.on_loaded(seq, landed, by_tier, prefetched)
        st.wake.notify_all()

    def _count_landed(self, load: Load, landed: int) -> tuple[dict[Tier, int], int]:
        """Blocks landed per source tier (a joined prefetch's block by the prefetch's tier),
        and how many came through a prefetch; the counters updated."""
        stats = self.st.stats
        by_tier: dict[Tier, int] = {}
        prefetched = 0
        for j, src in enumerate(load.sources):
            if isinstance(src, Tier):
                tier = src
            else:
                tier = src.tiers[src.pos[load.seq.key(load.start + j)]]
                prefetched += j < landed
            if j < landed:
                by_tier[tier] = by_tier.get(tier, 0) + 1
                stats.loaded_blocks[tier.name] += 1
            elif j not in load.absent:
                stats.load_fallback_blocks[tier.name] += 1  # there, recomputed: a load before it failed
        return by_tier, prefetched

    def credit_gpu_hits(self, keys: list[bytes]) -> dict[Tier, int]:
        """Of a request's leading device blocks, those a prefetch landed (not used since):
        counted as loaded from the prefetch's source tier (under the lock)."""
        st = self.st
        out: dict[Tier, int] = {}
        pfd = st.prefetched
        if not pfd:
            return out
        for k in keys:
            t = pfd.pop(k, None)
            if t is not None:
                out[t] = out.get(t, 0) + 1
        if len(pfd) > 2 * st.blocks.num_blocks:
            st.prefetched = {k: t for k, t in pfd.items() if k in st.blocks.by_key}
        return out

    # ------------------------------------------------------------------ prefetch (under the lock)

    def prefetch(self, pid: str, keys: list[bytes], deadline_s: float, *, remote_present: set[bytes] | None = None,
                 peer_url: str | None = None, peer_held: set[bytes] | None = None) -> int:
        """Raise the leading `keys` toward the device pool from wherever they sit (REMOTE:
        those the server said it holds; PEER: those the peer said it holds). Returns the
        blocks accepted (not counting those on the device or moving already)."""
        st = self.st
        if pid in st.prefetches:
            raise BadRequest(f"prefetch {pid!r} is already in flight", param="prefetch_id")
        if len(st.prefetches) >= st.cfg.prefetch_queue:
            raise PrefetchQueueFull(f"{len(st.prefetches)} prefetches in flight (the queue holds "
                                    f"{st.cfg.prefetch_queue})", retry_after=1.0)
        st.stats.prefetch_requests += 1
        plan, on_gpu = self._prefetch_plan(keys, remote_present, peer_held)
        for bid in on_gpu:  # the chain's device blocks must survive the room made below
            st.blocks.acquire(bid)
        plan = plan[: st.blocks.available()]
        if not plan:
            for bid in reversed(on_gpu):
                st.blocks.release_block(bid)
            return 0
        pkeys = [k for k, _ in plan]
        pf = Prefetch(pid, pkeys, [t for _, t in plan], [], time.monotonic() + deadline_s)
        pf.pos = {k: j for j, k in enumerate(pkeys)}
        pf.ok = [False] * len(plan)
        pf.metas = [None] * len(plan)
        cpu_keys = [k for k, t in plan if t is Tier.CPU]
        cpu_slots = self._pin_cpu(cpu_keys) if cpu_keys else []  # before making room (which may evict them)
        pf.dst = st.blocks.take(len(plan))
        for bid in reversed(on_gpu):
            st.blocks.release_block(bid)
        for k in pkeys:
            st.inflight[k] = pf
        st.prefetches[pid] = pf
        st.stats.prefetch_blocks_accepted += len(plan)
        for tier in dict.fromkeys(pf.tiers):
            js = [j for j, t in enumerate(pf.tiers) if t is tier]
            t = Transfer(tier, [pkeys[j] for j in js], [pf.dst[j] for j in js], (pf, js), False, pf.deadline,
                         after=st.offload_event)
            if tier is Tier.CPU:
                t.source = cpu_slots
            elif tier is Tier.PEER:
                t.source = peer_url
            pf.transfers.append(t)
            pf.pending += 1
            st.links[tier].enqueue(t)
        return len(plan)

    def _prefetch_plan(self, keys: list[bytes], remote_present: set[bytes] | None,
                       peer_held: set[bytes] | None) -> tuple[list[tuple[bytes, Tier]], list[int]]:
        """The leading keys not on the device nor moving, each with the tier to raise it
        from (up to the first held nowhere), and the device blocks of the chain."""
        st = self.st
        plan: list[tuple[bytes, Tier]] = []
        on_gpu: list[int] = []
        for k in keys:
            bid = st.blocks.by_key.get(k)
            if bid is not None:
                on_gpu.append(bid)
                continue
            if k in st.inflight:
                continue
            tier = st.below_tier(k)
            if tier is None:
                if remote_present is not None and k in remote_present and Tier.REMOTE in st.links:
                    tier = Tier.REMOTE
                elif peer_held is not None and k in peer_held and Tier.PEER in st.links:
                    tier = Tier.PEER
                else:
                    break
            plan.append((k, tier))
        return plan, on_gpu

    def _pin_cpu(self, keys: list[bytes]) -> list[Slot]:
        host = self.st.host
        assert host is not None
        slots = [host.by_key[k] for k in keys]
        for s in slots:
            host.pin(s)
        host.touch(keys)
        return slots

    def cancel_prefetch(self, pid: str) -> bool:
        """Drop a prefetch's transfers not started (moving ones land). False when unknown or done."""
        st = self.st
        pf = st.prefetches.get(pid)
        if pf is None or pf.cancelled:
            return False
        pf.cancelled = True
        st.stats.prefetch_cancelled += 1
        for t in pf.transfers:
            t.cancelled = True
            if not t.started and st.links[t.tier].remove(t):
                self.transfer_done(t)
        return True

    def _land_prefetch(self, pf: Prefetch) -> None:
        """All of a prefetch's transfers ended: register what arrived, in chain order, as
        cached device blocks; hand them to the requests that joined it."""
        st = self.st
        if st.prefetches.get(pf.pid) is pf:
            del st.prefetches[pf.pid]
        for k in pf.keys:
            if st.inflight.get(k) is pf:
                del st.inflight[k]
        self._register(pf)
        for load, js in pf.waiters:
            for j in js:
                bid = st.blocks.by_key.get(load.seq.key(load.start + j))
                if bid is not None:
                    st.blocks.acquire(bid)
                    load.pins[j] = bid
                    load.ok[j] = True
                    st.prefetched.pop(load.seq.key(load.start + j), None)
            load.pending -= 1
        for bid in reversed(pf.dst):  # tail first: parents stay the most recent
            st.blocks.release_block(bid)
        for load, _ in pf.waiters:
            if load.pending == 0 and not load.done:
                self._finish_load(load)
        st.wake.notify_all()  # its blocks are cached now: a request waiting for room may go

    def _register(self, pf: Prefetch) -> None:
        """What arrived intact (and not voided by a purge) becomes cached device blocks."""
        st = self.st
        items: list[tuple[int, bytes, BlockMeta, str | None]] = []
        idx: list[int] = []
        for j, k in enumerate(pf.keys):
            m = pf.metas[j]
            if pf.ok[j] and m is not None and not pf.void:
                items.append((pf.dst[j], k, m[0], m[1]))
                idx.append(j)
        landed = 0
        for j, ok in zip(idx, st.blocks.adopt(items), strict=True):
            if ok:
                landed += 1
                st.prefetched[pf.keys[j]] = pf.tiers[j]
        st.stats.prefetch_blocks_landed += landed
