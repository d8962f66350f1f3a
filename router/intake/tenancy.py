"""Tenants: API keys → tenant, its isolation salt, its concurrency cap, the admin token.

The tenant's salt enters the request's namespace, so its block keys (the router's and,
through the wire `cache_salt`, the worker's) differ from every other tenant's: one
tenant can neither hit nor time another's cache (docs/design.md §8). Purge must name every
wire salt a tenant used, so the gateway remembers them (bounded). Declared shared
prefixes stay unsalted on our workers; vLLM workers are salted from block 0. With no
tenants, auth is off. Details: docs/gateway.md.
"""
from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvindex.keys import Namespace

from ..api.errors import ApiError, forbidden, rate_limited, unauthorized
from ..config import Config

DEFAULT_TENANT = "default"


@dataclass(slots=True)
class Tenant:
    id: str
    salt: str
    max_concurrency: int
    inflight: int = 0
    requests: int = 0
    rejected: int = 0
    cache_salts: OrderedDict[str, None] = field(default_factory=OrderedDict)


class Tenancy:
    def __init__(self, cfg: Config, max_salts_per_tenant: int = 4096) -> None:
        self.auth_enabled = bool(cfg.tenants)
        self._by_key: dict[str, Tenant] = {}
        self.tenants: dict[str, Tenant] = {}
        self.max_salts = max_salts_per_tenant
        cap = cfg.limits.tenant_max_concurrency
        for t in cfg.tenants:
            salt = t.salt if t.salt is not None else "tenant:" + hashlib.sha256(t.id.encode()).hexdigest()[:32]
            ten = Tenant(t.id, salt, t.max_concurrency or cap)
            self.tenants[t.id] = ten
            for k in t.api_keys:
                self._by_key[k] = ten
        if not self.auth_enabled:
            self.tenants[DEFAULT_TENANT] = Tenant(DEFAULT_TENANT, "", cap)
        self._default = self.tenants.get(DEFAULT_TENANT)
        self._admin = cfg.admin_token.encode() if cfg.admin_token else None

    # ------------------------------------------------------------------ auth

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request's `Authorization: Bearer <key>` (or `api-key`), else 401."""
        if not self.auth_enabled:
            assert self._default is not None
            return self._default
        key = _bearer(headers)
        if key is None:
            raise unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        t = self._by_key.get(key)
        if t is None:
            raise unauthorized()
        return t

    def check_admin(self, headers: Mapping[str, str], local: bool = False) -> None:
        """Admin endpoints need the admin token. Without one configured they answer only a
        local client of a gateway listening locally (`local`, router/api/admin_policy.py)."""
        if self._admin is None:
            if not local:
                raise forbidden("Admin API disabled: set `admin_token` in the config "
                                "(without one it answers only local clients of a gateway listening on loopback).")
            return
        tok = headers.get("x-admin-token") or _bearer(headers)
        if tok is None or not hmac.compare_digest(tok.encode(), self._admin):
            raise ApiError(401, "Missing or wrong admin token.", "authentication_error", None, "invalid_admin_token")

    # ------------------------------------------------------------------ concurrency

    def acquire(self, t: Tenant) -> None:
        if t.inflight >= t.max_concurrency:
            t.rejected += 1
            raise rate_limited(
                f"Tenant {t.id!r} has {t.inflight} requests in flight (limit {t.max_concurrency}).",
                1.0,
                "tenant_concurrency",
            )
        t.inflight += 1
        t.requests += 1

    @staticmethod
    def release(t: Tenant) -> None:
        t.inflight -= 1

    # ------------------------------------------------------------------ purge support

    def remember_salt(self, t: Tenant, cache_salt: str | None) -> None:
        if not cache_salt or not t.salt:
            return
        s = t.cache_salts
        if cache_salt in s:
            s.move_to_end(cache_salt)
            return
        s[cache_salt] = None
        if len(s) > self.max_salts:
            s.popitem(last=False)

    def wire_salts(self, t: Tenant) -> list[str]:
        """Every wire salt this tenant's requests used (as far as this process knows)."""
        out = []
        for cs in ("", *t.cache_salts):
            w = Namespace("x", tenant_salt=t.salt, cache_salt=cs).wire_salt
            if w:
                out.append(w)
        return out


def _bearer(headers: Mapping[str, str]) -> str | None:
    a = headers.get("authorization")
    if a:
        scheme, _, tok = a.partition(" ")
        if scheme.lower() == "bearer" and tok.strip():
            return tok.strip()
        return None
    return headers.get("api-key") or None
