"""Who may use the admin API, and which workers it may add.

Without an admin token the admin API is for this host only, and only while the gateway
listens on loopback; a worker added through it passes the gateway's network policy
(router/netpolicy.py) as an untrusted source: its URL and event endpoints on an allowed
network, no `ipc://` file and no socket bound unless the config allows them.
"""
from __future__ import annotations

import ipaddress

from .config import AdminConfig
from .errors import bad_request, forbidden
from .fleetconfig import WorkerConfig
from .netpolicy import NetworkPolicy, NetworkRefused

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
    """Refuse (403 for a network, 400 otherwise) a worker the admin API must not add:
    the gateway's one network policy (router/netpolicy.py), the admin API untrusted."""
    net = network_policy(policy)
    try:
        await net.check_url(wc.url)
        ev = wc.events
        if ev is not None:
            await net.check_events(ev.endpoint, ev.replay_endpoint, ev.bind, trusted=False)
    except NetworkRefused as e:
        raise (forbidden(str(e)) if e.forbidden else bad_request(str(e), e.field)) from None


def network_policy(policy: AdminConfig) -> NetworkPolicy:
    return NetworkPolicy(policy.worker_networks, policy.allow_ipc_events, policy.allow_event_bind)
