"""The one network policy for every address the gateway connects to.

A worker's URL is fetched every second and its KV-event endpoints are connected to
(ZMQ), whether they come from the config file, DNS discovery, the admin API or a
worker's own `/info`. Each of those addresses must lie on an allowed network
(`admin.worker_networks`; host names are resolved and every address checked), or the
gateway becomes a way to reach arbitrary hosts (a cloud's metadata service at
169.254.169.254). What only the operator may ask for — an `ipc://` path, which names a
file on the gateway's host, and a socket the gateway binds — is refused from the
admin API and from a worker's `/info` unless `admin.allow_ipc_events` /
`admin.allow_event_bind` say otherwise; the config file may use them.

Where a refusal shows: a 4xx at admin add, a config error at start (addresses written
as IPs; names are resolved when the worker registers), a refused worker otherwise. A
name is checked again each time the gateway's HTTP client resolves it (`PolicyResolver`):
one that resolved into the networks at registration and elsewhere later (DNS
rebinding) is not connected to.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class NetworkRefused(ValueError):
    """An address the policy refuses; `field` names where it came from (`url`,
    `events.endpoint`, ...), `forbidden`: a network refusal rather than a malformed one,
    `transient`: the name does not resolve (a worker not up yet is not refused for it)."""

    def __init__(self, message: str, field: str, forbidden: bool = True, transient: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.forbidden = forbidden
        self.transient = transient  # a name that does not resolve (yet): nothing is known against it


class NetworkPolicy:
    """Allowed networks plus what untrusted sources may ask for (module doc)."""

    def __init__(self, networks: Sequence[str], allow_ipc: bool = False, allow_bind: bool = False) -> None:
        self.networks: list[IPNetwork] = [ipaddress.ip_network(n, strict=False) for n in networks]
        self.allow_ipc = allow_ipc
        self.allow_bind = allow_bind

    # ------------------------------------------------------------------ addresses

    def check_ip(self, addr: IPAddress, field: str) -> None:
        a = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped else addr
        if not any(a in n for n in self.networks):
            raise NetworkRefused(f"{field}: address {a} is outside the networks the gateway may connect to "
                                 f"(config admin.worker_networks).", field)

    async def check_host(self, host: str, field: str) -> None:
        """Every address `host` resolves to must be allowed."""
        for addr in await resolve(host, field):
            self.check_ip(addr, field)

    def check_literal(self, host: str, field: str) -> None:
        """`host` when it is an IP address (names are checked when resolved)."""
        addr = literal_ip(host)
        if addr is not None:
            self.check_ip(addr, field)

    # ------------------------------------------------------------------ what a worker names

    async def check_url(self, url: str, field: str = "url") -> None:
        await self.check_host(urlsplit(url).hostname or "", field)

    async def check_events(self, endpoint: str | None, replay: str | None, bind: bool, trusted: bool,
                           prefix: str = "events") -> None:
        """A worker's event endpoints. `trusted`: they come from the config file."""
        for name, ep in (("endpoint", endpoint), ("replay_endpoint", replay)):
            if ep is None:
                continue
            field = f"{prefix}.{name}"
            host = self.endpoint_host(ep, bind, trusted, field)
            if host is not None and not bind:
                await self.check_host(host, field)

    def check_events_literal(self, endpoint: str | None, replay: str | None, bind: bool, prefix: str) -> None:
        """`check_events` for the config file at start: IP addresses only, nothing resolved."""
        for name, ep in (("endpoint", endpoint), ("replay_endpoint", replay)):
            if ep is None:
                continue
            field = f"{prefix}.{name}"
            host = self.endpoint_host(ep, bind, True, field)
            if host is not None and not bind:
                self.check_literal(host, field)

    def endpoint_host(self, ep: str, bind: bool, trusted: bool, field: str) -> str | None:
        """The host a `tcp://` endpoint connects to (None for `ipc://`, when allowed);
        raises NetworkRefused for what the source may not ask for."""
        scheme, sep, rest = ep.partition("://")
        if not sep:
            raise NetworkRefused(f"{field}: not a ZMQ endpoint: {ep!r}", field, False)
        if bind and not (trusted or self.allow_bind):
            raise NetworkRefused(f"{field}: only the config file may make the gateway bind a socket "
                                 f"(config admin.allow_event_bind).", "events.bind", False)
        if scheme == "ipc":
            if not (trusted or self.allow_ipc):
                raise NetworkRefused(f"{field}: must be tcp:// (an ipc:// path names a file on the gateway's "
                                     f"host; config admin.allow_ipc_events).", field, False)
            return None
        if scheme == "inproc" and trusted:  # within the gateway's own process
            return None
        if scheme != "tcp":
            raise NetworkRefused(f"{field}: must be tcp://host:port (or ipc:// from the config file).", field, False)
        dest = rest.rsplit(";", 1)[-1]  # ZMQ's `tcp://source;dest:port`: the gateway connects to dest
        host, colon, port = dest.rpartition(":")
        if not colon or not port.isdigit() or not host:
            raise NetworkRefused(f"{field}: must be tcp://host:port, not {ep!r}", field, False)
        return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def literal_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


async def resolve(host: str, field: str) -> list[IPAddress]:
    addr = literal_ip(host)
    if addr is not None:
        return [addr]
    if not host or host == "*":
        raise NetworkRefused(f"{field}: no host to connect to.", field, False)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        raise NetworkRefused(f"{field}: host {host!r} does not resolve.", field, False, True) from None
    return [ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos]


class PolicyResolver(AbstractResolver):
    """aiohttp's resolver, keeping only the addresses the policy allows (module doc)."""

    def __init__(self, policy: NetworkPolicy, inner: AbstractResolver | None = None) -> None:
        self.policy = policy
        self.inner = inner if inner is not None else DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET,
                      ) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        allowed = [r for r in found if self._allows(r["host"])]
        if not allowed:
            raise OSError(f"{host}: every address it resolves to is outside the networks the gateway may "
                          f"connect to (config admin.worker_networks)")
        return allowed

    def _allows(self, host: str) -> bool:
        try:
            self.policy.check_literal(host, "host")
        except NetworkRefused:
            return False
        return True

    async def close(self) -> None:
        await self.inner.close()
