"""Who may use the admin API, and which workers it may add.

Without an admin token the admin API is for this host only, and only while the gateway
listens on loopback; a worker added through it must sit on an allowed network (its URL
is fetched every second: the gateway must not become a way to reach arbitrary hosts),
and its event endpoint may neither name a file (`ipc://`) nor make the gateway bind.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

from .config import AdminConfig
from .errors import bad_request, forbidden
from .fleetconfig import WorkerConfig

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def open_admin_allowed(listen_host: str, client_host: str | None) -> bool:
    """An admin API without a token: only a local client of a gateway listening locally."""
    if listen_host not in LOOPBACK_HOSTS or client_host is None:
        return False
    try:
        return ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return False


async def check_new_worker(wc: WorkerConfig, policy: AdminConfig) -> None:
    """Refuse (400/403) a worker the admin API must not add (module doc)."""
    host = urlsplit(wc.url).hostname or ""
    nets = [ipaddress.ip_network(n, strict=False) for n in policy.worker_networks]
    for addr in await _addresses(host):
        if not any(addr in n for n in nets):
            raise forbidden(f"Worker address {addr} is outside the networks the admin API may add "
                            f"(config admin.worker_networks).")
    ev = wc.events
    if ev is not None:
        for ep in (ev.endpoint, ev.replay_endpoint):
            if ep is not None and not ep.startswith("tcp://") and not policy.allow_ipc_events:
                raise bad_request("Event endpoints added through the admin API must be tcp:// "
                                  "(config admin.allow_ipc_events).", "events.endpoint")
        if ev.bind and not policy.allow_event_bind:
            raise bad_request("The admin API may not make the gateway bind a socket "
                              "(config admin.allow_event_bind).", "events.bind")


async def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        raise bad_request(f"Worker host {host!r} does not resolve.", "url") from None
    return [ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos]
