"""Workers from DNS: a name's A/AAAA (or SRV) records, re-resolved on a timer.

A Kubernetes headless Service answers its name with one address per ready pod, so
re-resolving it is how a gateway learns that workers came and went. Each address is
a worker built from the entry's template (`DiscoveryConfig`); the membership
reconciler (router/fleet/membership.py) adds and removes them in the pool. A failed
lookup keeps the last answer: a DNS hiccup must not empty the fleet.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

import dns.asyncresolver
import dns.exception
import dns.rdatatype

from ..config import DiscoveryConfig
from .fleetconfig import EventsConfig, WorkerConfig

log = logging.getLogger("kvroute.discovery")

Target = tuple[str, int]  # (host, port)
Resolver = Callable[[DiscoveryConfig], Awaitable[list[Target]]]


class LookupFailed(Exception):
    """The name could not be resolved now (the caller keeps its last answer)."""


async def resolve(entry: DiscoveryConfig, nameservers: list[tuple[str, int]] | None = None) -> list[Target]:
    """The entry's (host, port) targets, sorted; SRV through dnspython, A/AAAA through
    the system resolver (so /etc/hosts and the pod's search domains apply)."""
    if entry.srv:
        return await _srv(entry.name, nameservers)
    assert entry.port is not None
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(entry.name, entry.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, OSError) as e:
        raise LookupFailed(f"{entry.name}: {e}") from None
    return sorted({(str(info[4][0]), entry.port) for info in infos})


async def _srv(name: str, nameservers: list[tuple[str, int]] | None) -> list[Target]:
    r = dns.asyncresolver.Resolver()
    if nameservers:
        r.nameservers = [h for h, _ in nameservers]
        r.port = nameservers[0][1]
    try:
        answer = await r.resolve(name, dns.rdatatype.SRV, lifetime=5.0)
    except dns.resolver.NXDOMAIN:
        return []  # the name exists no more: no workers
    except dns.resolver.NoAnswer:
        return []
    except dns.exception.DNSException as e:
        raise LookupFailed(f"{name} SRV: {e}") from None
    return sorted({(rec.target.to_text(omit_final_dot=True), int(rec.port)) for rec in answer})


def worker_for(entry: DiscoveryConfig, host: str, port: int) -> WorkerConfig:
    """The worker at one discovered address, from the entry's template."""
    shown = f"[{host}]" if _is_v6(host) else host
    safe = host.replace(":", "_")
    events = None
    if entry.events is not None:
        e = entry.events
        events = EventsConfig(endpoint=e.endpoint.replace("{host}", shown),
                              replay_endpoint=e.replay_endpoint.replace("{host}", shown) if e.replay_endpoint else None,
                              topic=e.topic, bind=e.bind)
    return WorkerConfig(id=f"{entry.prefix}-{safe}-{port}", url=f"{entry.scheme}://{shown}:{port}", kind=entry.kind,
                        model=entry.model, events=events, block_size=entry.block_size,
                        max_inflight=entry.max_inflight, cost=entry.cost)


def _is_v6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


class Discovery:
    """Re-resolves every entry on its own timer and hands the union of their workers to
    `on_change` whenever it differs from the last one."""

    def __init__(self, entries: list[DiscoveryConfig], on_change: Callable[[dict[str, WorkerConfig]], None],
                 resolver: Resolver = resolve) -> None:
        self.entries = entries
        self.on_change = on_change
        self.resolver = resolver
        self.found: dict[int, list[Target]] = {}  # per entry: its last good answer
        self.failures = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._last: dict[str, WorkerConfig] | None = None

    async def start(self) -> None:
        """One lookup of every entry now (the first workers are known at start), then timers."""
        await asyncio.gather(*(self._lookup(i) for i in range(len(self.entries))))
        self._publish()
        self._tasks = [asyncio.get_running_loop().create_task(self._loop(i), name=f"discovery-{i}")
                       for i in range(len(self.entries))]

    async def _loop(self, i: int) -> None:
        while True:
            await asyncio.sleep(self.entries[i].interval_s)
            if await self._lookup(i):
                self._publish()

    async def _lookup(self, i: int) -> bool:
        """True when entry `i`'s targets changed."""
        e = self.entries[i]
        try:
            targets = await self.resolver(e)
        except LookupFailed as err:
            self.failures += 1
            log.warning("discovery %s: lookup failed, keeping %d known worker(s): %s", e.name,
                        len(self.found.get(i, [])), err)
            return False
        changed = self.found.get(i) != targets
        self.found[i] = targets
        return changed

    def workers(self) -> dict[str, WorkerConfig]:
        out: dict[str, WorkerConfig] = {}
        for i, targets in sorted(self.found.items()):
            for host, port in targets:
                wc = worker_for(self.entries[i], host, port)
                out.setdefault(wc.id, wc)
        return out

    def _publish(self) -> None:
        now = self.workers()
        if now != self._last:
            self._last = now
            self.on_change(now)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
