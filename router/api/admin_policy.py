"""Who may use the admin API, and which workers it may add.

Without an admin token the admin API is for this host only, and only while the gateway
listens on loopback; a worker added through it passes the gateway's network policy
(router/fleet/netpolicy.py) as an untrusted source: its URL and event endpoints on an allowed
network, no `ipc://` file and no socket bound unless the config allows them.

"This host only" must also keep out the browser on this host, which runs any web
page's script: a page may POST `text/plain` to 127.0.0.1 without asking (no CORS
preflight), and through DNS rebinding read answers under its own host name. So an
admin request is refused when it comes from a foreign `Origin`, when it carries a body
that is not JSON (or a form's content type), and, without a token, when its `Host` is
not a loopback name; and without a token a worker may only be added on loopback.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

from ..config import AdminConfig
from ..fleet.fleetconfig import WorkerConfig
from ..fleet.netpolicy import NetworkPolicy, NetworkRefused
from .errors import ApiError, bad_request, forbidden

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")
JSON_TYPES = ("application/json",)
# the content types a web page may POST anywhere without a CORS preflight
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def open_admin_allowed(listen_host: str, client_host: str | None) -> bool:
    """An admin API without a token: only a local client of a gateway listening locally."""
    if listen_host not in LOOPBACK_HOSTS or client_host is None:
        return False
    try:
        return ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return False


def check_browser_safe(method: str, headers: Mapping[str, str], has_token: bool) -> None:
    """Refuse (403/415) an admin request a web page could have made (module doc).
    `headers`: lower-cased names."""
    host = headers.get("host", "")
    origin = headers.get("origin")
    if origin is not None and not _same_origin(origin, host):
        raise forbidden("Cross-origin requests to the admin API are refused.")
    if not has_token and not _is_loopback_name(host):
        raise forbidden("Without an admin token the admin API answers only requests addressed to a loopback "
                        "host name (Host: localhost, 127.0.0.1 or [::1]).")
    if method in ("POST", "PUT", "PATCH", "DELETE"):
        length = headers.get("content-length", "0")
        has_body = length not in ("", "0") or "transfer-encoding" in headers
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        # a body must be JSON; an empty one may be typed anything but what a page can send
        # cross-site without a preflight (clients label empty POSTs application/octet-stream)
        if (has_body or media in SIMPLE_TYPES) and media not in JSON_TYPES:
            raise ApiError(415, "The admin API takes JSON bodies only (Content-Type: application/json).",
                           "invalid_request_error", None, "unsupported_media_type")


def _authority(netloc: str, default_port: int) -> tuple[str, int] | None:
    """(host name, port) of a Host header or an origin's authority; None when malformed."""
    try:
        parts = urlsplit("//" + netloc.strip())
        return (parts.hostname or "", parts.port or default_port)
    except ValueError:
        return None


def _is_loopback_name(host_header: str) -> bool:
    auth = _authority(host_header, 80)
    if auth is None:
        return False
    if auth[0] == "localhost":
        return True
    try:
        return ipaddress.ip_address(auth[0]).is_loopback
    except ValueError:
        return False


def _same_origin(origin: str, host_header: str) -> bool:
    """The Origin names the host and port the request was sent to (the scheme aside: a
    gateway behind a TLS proxy sees http where the page saw https)."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (sandboxed pages, local files) and anything odd
    default = 443 if parts.scheme == "https" else 80
    o, h = _authority(parts.netloc, default), _authority(host_header, default)
    return o is not None and h is not None and bool(h[0]) and o == h


def worker_networks(policy: AdminConfig, has_token: bool) -> list[str]:
    """Where the admin API may add workers: the configured networks; without an admin
    token and without an explicit `admin.worker_networks`, loopback only (module doc)."""
    if not has_token and "worker_networks" not in policy.model_fields_set:
        return list(LOOPBACK_NETWORKS)
    return policy.worker_networks


async def check_new_worker(wc: WorkerConfig, policy: AdminConfig, has_token: bool = True) -> None:
    """Refuse (403 for a network, 400 otherwise) a worker the admin API must not add: the
    gateway's one network policy (router/fleet/netpolicy.py), the admin API untrusted, on the
    networks `worker_networks` allows it."""
    net = NetworkPolicy(worker_networks(policy, has_token), policy.allow_ipc_events, policy.allow_event_bind)
    try:
        await net.check_url(wc.url)
        ev = wc.events
        if ev is not None:
            await net.check_events(ev.endpoint, ev.replay_endpoint, ev.bind, trusted=False)
    except NetworkRefused as e:
        raise (forbidden(str(e)) if e.forbidden else bad_request(str(e), e.field)) from None


def network_policy(policy: AdminConfig) -> NetworkPolicy:
    return NetworkPolicy(policy.worker_networks, policy.allow_ipc_events, policy.allow_event_bind)
