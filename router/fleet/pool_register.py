"""A worker's registration and identity: who it is (kvroute: `/info`, whose namespace
digest and block size must match the model's; vLLM: everything from config), that it
serves the configured model (`/v1/models`), what the network policy lets the gateway
reach, and its cache made known to the index (KV events, a republish on joining)."""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec

from kvindex.index import IndexError_

from ..config import PoolConfig
from .costs import cost_params, speeds_stated
from .fleetconfig import EventsConfig
from .netpolicy import NetworkPolicy, NetworkRefused
from .pool_health import Health
from .pool_roster import IngestLike, Roster
from .probe import BadAnswer, Probe
from .worker import State, Worker

log = logging.getLogger("kvroute.pool")


class Registration:
    def __init__(
        self,
        cfg: PoolConfig,
        roster: Roster,
        health: Health,
        probe: Probe,
        session: aiohttp.ClientSession,
        ingest: IngestLike | None,
        poll: Callable[[Worker], Awaitable[bool]],
        on_refused: Callable[[Worker, str], None] | None,
    ) -> None:
        self.cfg = cfg
        self.roster = roster
        self.health = health
        self.probe = probe
        self.session = session
        self.ingest = ingest
        self._poll = poll  # a first load report before the worker is routable
        self._on_refused = on_refused
        self.network: NetworkPolicy | None = None  # set by the gateway: what registration may connect to

    async def register(self, w: Worker) -> bool:
        model = w.model
        if not await self.network_allows(w, False):
            return False
        if not await self.health.check(w):
            return False
        if w.kind == "kvroute":
            try:
                info = await self.probe.info(w)
            except BadAnswer as e:
                self.refuse(w, str(e), "bad_info")
                return False
            if info is None:
                return False
            if info.namespace_digest != model.digest_hex:
                self.refuse(
                    w,
                    f"namespace digest {info.namespace_digest[:16]}… differs from model {model.id!r}'s "
                    f"{model.digest_hex[:16]}… (worker model {info.model!r}); check model id, revision, "
                    f"kv_dtype, parallel and block_size in both configs",
                    "namespace_mismatch",
                )
                return False
            w.info = info
            w.block_size = info.block_size
            w.block_bytes = info.block_bytes or 0
            w.remote_group = w.cfg.remote_group or info.remote_group
            w.capabilities = set(info.capabilities)
            if w.cfg.events is not None:
                w.events = w.cfg.events
            elif info.events is not None and info.events.endpoint:
                ev = info.events
                w.events = EventsConfig(endpoint=ev.endpoint, replay_endpoint=ev.replay_endpoint,
                                        topic=ev.topic or "kv")
            else:
                w.events = None
            w.view.supports_prefetch = "prefetch" in w.capabilities
            w.view.supports_peer_pull = "peer_pull" in w.capabilities
            w.view.gpu_block_tokens = info.block_size
        else:
            w.block_size = w.cfg.block_size or model.block_size
            w.remote_group = w.cfg.remote_group
            w.events = w.cfg.events
            w.capabilities = set()
            w.view.supports_prefetch = False
            w.view.supports_peer_pull = False
            w.view.gpu_block_tokens = 0
        if w.block_size % model.block_size and (w.kind != "sglang" or model.block_size % w.block_size):
            self.refuse(
                w,
                f"block size {w.block_size} is not a multiple of model {model.id!r}'s index block size "
                f"{model.block_size}" + (" nor a page size dividing it" if w.kind == "sglang" else ""),
                "block_size",
            )
            return False
        if not await self.check_identity(w):
            return False
        w.view.cost = cost_params(model, w.cfg.cost, (w.block_size, w.block_bytes))
        # A (re)started process is measured anew: its speeds may not be the last one's.
        w.fleet.speed = None
        w.view.speeds_fitted = False
        w.view.speeds_known = speeds_stated(model, w.cfg.cost, w.kind)
        if not await self.network_allows(w, True):
            return False
        try:
            self.roster.join(w)
        except (IndexError_, ValueError, OSError) as e:
            self.refuse(w, f"cannot index this worker: {e}", "index")
            return False
        except Exception as e:  # zmq.ZMQError: an events endpoint that cannot be bound/parsed
            where = w.events.endpoint if w.events else "?"
            self.refuse(w, f"cannot subscribe to its KV events at {where}: {e}", "events")
            return False
        w.fails = 0
        await self._poll(w)
        w.index_target = await self.republish(w)
        w.registered_at = time.monotonic()
        if w.admin_drained:  # drained through the admin API before it (re)registered
            self.roster.set_state(w, State.DRAINING, "drained by admin")
            if w.in_index:
                w.model.index.set_draining(w.id, True)
        else:
            self.roster.set_state(w, State.HEALTHY, "")
        return True

    async def network_allows(self, w: Worker, events: bool) -> bool:
        """Its URL (or, `events`, its event endpoints, trusted only as configured) passes the
        network policy (router/fleet/netpolicy.py); refused otherwise, before anything connects."""
        if self.network is None:
            return True
        try:
            if not events:
                await self.network.check_url(w.cfg.url)
            elif w.events is not None:
                ev = w.events
                await self.network.check_events(ev.endpoint, ev.replay_endpoint, ev.bind, ev is w.cfg.events)
        except NetworkRefused as e:
            if e.transient:  # its name does not resolve yet: tried again, as an unreachable worker is
                w.last_error = str(e)
                return False
            self.refuse(w, str(e), "network_policy")
            return False
        return True

    async def republish(self, w: Worker) -> int | None:
        """Ask our worker to publish everything it holds, so the index knows its cache now
        rather than when it next happens to store a block (a gateway restarted next to a
        warm fleet); returns the sequence number to wait for, None when there is none."""
        if w.kind != "kvroute" or w.events is None or self.ingest is None:
            return None
        try:
            async with self.session.post(w.url + "/kv/republish", headers=w.headers(), timeout=self.probe.timeout) as r:
                body = await r.read()
                if r.status != 200:
                    log.info("worker %s cannot republish its blocks (HTTP %d): its index fills as it works",
                             w.id, r.status)
                    return None
            seq = msgspec.json.decode(body).get("seq")
            return seq if isinstance(seq, int) and seq >= 0 else None
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError, AttributeError) as e:
            log.info("worker %s: republish failed (%s): its index fills as it works", w.id, e)
            return None

    def indexed(self, w: Worker) -> bool:
        """The worker's cache is known to the index (or it is past waiting for it)."""
        if self.ingest is None or w.events is None:
            return True
        if time.monotonic() - w.registered_at > self.cfg.index_ready_timeout_s:
            return True
        return self.ingest.indexed(w, w.index_target)

    async def check_identity(self, w: Worker) -> bool:
        """The worker must serve the configured model (its `/v1/models`): a worker started on
        another model would answer for it. Refused otherwise; False also when unreadable."""
        try:
            listed = await self.probe.models(w)
        except BadAnswer as e:
            self.refuse(w, str(e), "bad_models")
            return False
        if listed is None:
            self.health.failed(w, w.last_error, w.last_refused)
            return False
        names, adapters = listed
        model = w.model
        wanted = [model.id, *model.cfg.served_names]
        served = next((n for n in wanted if n in names), None)
        if served is None:
            self.refuse(w, f"serves {sorted(set(names))}, not model {model.id!r} (or its names "
                           f"{model.cfg.served_names})", "model_mismatch")
            return False
        w.served_model = served
        w.adapters = frozenset(a for a, parent in adapters.items() if parent in wanted)
        model.adapters |= w.adapters
        return True

    def refuse(self, w: Worker, why: str, code: str) -> None:
        first = w.state is not State.REFUSED or w.reason != why
        if first:
            log.error("worker %s refused: %s", w.id, why)
            if self._on_refused is not None:
                self._on_refused(w, code)
        self.roster.leave(w)
        self.roster.set_state(w, State.REFUSED, why)
