"""A simulated fleet of data-parallel servers: S servers of R ranks, each rank an
independent SimEngine (its own KV cache, queue and KV-event stream), routed two ways.

- `rank` (what the gateway does, router/fleet/dp_ranks.py): every rank is a worker of
  its own, `<server>.dp<r>`; its events feed its own index entry, its report its own
  view, and the policy picks a rank.
- `server` (worker-level routing: a router that does not know ranks): the router sees
  one worker per server, a `DPServer`. Every rank's KV events go to the server's one
  index entry (a block one rank holds counts for the whole server; a block one rank
  stored and another removed is gone), its load report sums the ranks', and the
  request it is sent goes to the rank the server's own balancer picks (`DPBalancer`,
  vLLM's rule), whatever the caches hold.

In both modes a server's ranks share one REMOTE group (servers are dealt round-robin
into `remote_groups`). Adding or removing workers by scenario action is not modelled
for such a fleet. Results: docs/simulator.md, "Data-parallel ranks".
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from kvindex.events import KVEvent
from kvindex.tiers import Tier
from kvwire.info import WorkerInfo
from kvwire.load import BlockCounts, LoadReport
from workers.sim import SimEngine, SimProfile, SimRequest

from .fleet import Fleet, FleetSpec
from .trace import TraceError

DP_ROUTINGS = ("rank", "server")

# vLLM v1's data-parallel client (`DPLBAsyncMPClient.get_core_engine_for_request` in
# vllm/v1/engine/core_client.py) scores each engine `waiting * 4 + running` from the
# counts its coordinator publishes (every 100 ms while they change), takes the lowest
# (ties: the first from the client's start index, 0 for a single API server) and adds
# one to the chosen engine's waiting count until the next publication.
WAITING_WEIGHT = 4
PUBLISH_INTERVAL_S = 0.1


def rank_id(server_id: str, rank: int) -> str:
    """A rank's worker id, as the gateway names it (router/fleet/dp_ranks.py)."""
    return f"{server_id}.dp{rank}"


class DPBalancer:
    """A server's own choice of rank for a request that names none (vLLM's rule above)."""

    def __init__(self, ranks: Sequence[SimEngine], publish_interval_s: float = PUBLISH_INTERVAL_S) -> None:
        self.ranks = list(ranks)
        self.publish_interval_s = publish_interval_s
        self.counts: list[list[int]] = [[0, 0] for _ in self.ranks]
        self._next_publish = -float("inf")

    def _publish(self, now: float) -> None:
        for c, eng in zip(self.counts, self.ranks, strict=True):
            s = eng.sched
            c[0] = len(s.waiting)
            c[1] = len(s.loading) + len(s.prefilling) + len(s.decoding)
        self._next_publish = now + self.publish_interval_s

    def pick(self, now: float) -> int:
        """The rank the next request goes to; counts it as waiting there."""
        if now >= self._next_publish:
            self._publish(now)
        best, best_score = 0, None
        for i, (waiting, running) in enumerate(self.counts):
            score = waiting * WAITING_WEIGHT + running
            if best_score is None or score < best_score:
                best, best_score = i, score
        self.counts[best][0] += 1
        return best


class DPServer:
    """One data-parallel server as a rank-unaware router sees it: one worker whose
    engine is R engines behind a balancer (the module doc). It offers the surface the
    simulator and `SimRouter` use of an engine; it advertises no prefetch (a request
    to the server cannot say which rank's cache to fill)."""

    def __init__(self, worker_id: str, ranks: Sequence[SimEngine]) -> None:
        if not ranks:
            raise TraceError("a data-parallel server needs at least one rank")
        self.worker_id = worker_id
        self.ranks = list(ranks)
        r0 = self.ranks[0]
        self.profile = r0.profile
        self.role = r0.role
        self.bs = r0.bs
        self.block_bytes = r0.block_bytes
        self.balancer = DPBalancer(self.ranks)
        self.chosen = [0] * len(self.ranks)  # requests the balancer sent to each rank
        self._placed: dict[str, str] = {}  # request id -> the rank it went to, until asked

    @property
    def now(self) -> float:
        return max(e.now for e in self.ranks)

    def info(self) -> WorkerInfo:
        i = self.ranks[0].info()
        caps = [c for c in i.capabilities if c not in ("prefetch", "peer_pull")]
        caps_tokens = [e.info().kv_capacity_tokens for e in self.ranks]
        total = None if any(c is None for c in caps_tokens) else sum(c or 0 for c in caps_tokens)
        return msgspec.structs.replace(i, worker_id=self.worker_id, capabilities=caps, kv_capacity_tokens=total)

    def submit(self, req: SimRequest, now: float) -> None:
        r = self.balancer.pick(now)
        self.ranks[r].submit(req, now)  # a refusal (429/400) is the server's
        self.chosen[r] += 1
        self._placed[req.request_id] = self.ranks[r].worker_id

    def placed(self, request_id: str) -> str:
        """The rank a request just submitted went to (asked once, as vLLM's response
        headers would tell)."""
        return self._placed.pop(request_id, self.worker_id)

    def cancel_prefetch(self, prefetch_id: str) -> bool:
        return any([e.cancel_prefetch(prefetch_id) for e in self.ranks])

    def next_event_time(self) -> float | None:
        ts = [t for t in (e.next_event_time() for e in self.ranks) if t is not None]
        return min(ts) if ts else None

    def advance(self, now: float) -> None:
        for e in self.ranks:
            e.advance(now)

    def match_tiers(self, keys: list[bytes]) -> list[Tier | None]:
        """Per block, a tier some rank holds it in (what the server's index entry claims)."""
        out: list[Tier | None] = [None] * len(keys)
        for e in self.ranks:
            for i, t in enumerate(e.match_tiers(keys)):
                if out[i] is None and t is not None:
                    out[i] = t
        return out

    def load_report(self, now: float) -> LoadReport:
        """The ranks' reports summed; the queue estimate is their mean (the server's
        pending work over its R ranks); speeds and links are one rank's (a request's
        prefill runs on one rank)."""
        reps = [e.load_report(now) for e in self.ranks]
        r0 = reps[0]
        blocks: dict[str, BlockCounts] = {}
        for rep in reps:
            for tier, bc in rep.blocks.items():
                acc = blocks.setdefault(tier, BlockCounts())
                acc.used += bc.used
                acc.free += bc.free
                acc.capacity += bc.capacity
        mw = [rep.max_waiting for rep in reps]
        return LoadReport(
            worker_id=self.worker_id,
            ts=now,
            waiting_requests=sum(rep.waiting_requests for rep in reps),
            waiting_prefill_tokens=sum(rep.waiting_prefill_tokens for rep in reps),
            running_requests=sum(rep.running_requests for rep in reps),
            running_prefill_tokens=sum(rep.running_prefill_tokens for rep in reps),
            est_queue_s=sum(rep.est_queue_s for rep in reps) / len(reps),
            blocks=blocks,
            speeds=r0.speeds,
            tiers=r0.tiers,
            prefetch_queue=sum(rep.prefetch_queue for rep in reps),
            max_waiting=None if any(m is None for m in mw) else sum(m for m in mw if m is not None),
            block_size=r0.block_size,
            profile=r0.profile,
        )


class DPFleet(Fleet):
    """`spec.workers` servers of `spec.dp` ranks (the module doc): `engines` holds the
    ranks (`rank` routing) or one `DPServer` per server (`server` routing); `ranks`
    holds every rank either way."""

    def __init__(
        self,
        spec: FleetSpec,
        on_events: Callable[[str], Callable[[list[KVEvent]], None] | None] | None = None,
    ) -> None:
        if spec.dp < 1:
            raise TraceError("dp (ranks per server) must be >= 1")
        if spec.dp_routing not in DP_ROUTINGS:
            raise TraceError(f"unknown dp routing {spec.dp_routing!r}; choose one of: {', '.join(DP_ROUTINGS)}")
        if spec.pd is not None:
            raise TraceError("a data-parallel fleet with prefill/decode roles is not modelled")
        if spec.workers * spec.dp > 1024:
            raise TraceError("servers x ranks must be at most 1024")
        self.ranks: dict[str, SimEngine] = {}
        self.servers: dict[str, DPServer] = {}
        self._built = False
        super().__init__(spec, on_events)
        self._built = True

    def add(self, worker_id: str | None = None, profile: SimProfile | None = None) -> SimEngine:
        if self._built:
            raise TraceError("adding a worker to a data-parallel fleet is not modelled")
        sid = worker_id or f"w{self._next}"
        remote = self.remotes[self._next % len(self.remotes)] if self.remotes else None
        self._next += 1
        server_mode = self.spec.dp_routing == "server"
        ranks = []
        for r in range(self.spec.dp):
            rid = rank_id(sid, r)
            sink_id = sid if server_mode else rid
            cb = self._on_events(sink_id) if self._on_events is not None else None
            eng = SimEngine(rid, profile or self.profile, remote=remote, on_events=cb,
                            max_waiting=self.spec.max_waiting)
            self.ranks[rid] = eng
            ranks.append(eng)
            if not server_mode:
                self.engines[rid] = eng
        if server_mode:
            srv = DPServer(sid, ranks)
            self.servers[sid] = srv
            self.engines[sid] = srv  # type: ignore[assignment]  # an engine's surface, over its ranks
        return ranks[0]

    def all_engines(self) -> list[SimEngine]:
        return list(self.ranks.values())


def make_fleet(
    spec: FleetSpec, on_events: Callable[[str], Callable[[list[KVEvent]], None] | None] | None = None
) -> Fleet:
    """The fleet `spec` describes: data-parallel servers when `spec.dp` > 1, else plain workers."""
    if spec.dp > 1:
        return DPFleet(spec, on_events)
    return Fleet(spec, on_events)
