"""The admin API: workers (list, add, drain, remove), index and calibration, explain, purge.

Every route checks the admin token (a separate secret from client keys). Adding a
worker takes the same fields as a `workers[]` entry of the config, validated the same
way.
"""
from __future__ import annotations

import time
from typing import Any

import msgspec
from pydantic import ValidationError

from ..config import format_validation_error
from ..fleet.dp_ranks import expand_ranks
from ..fleet.fleetconfig import WorkerConfig
from ..fleet.replica_sync import AdminChange
from ..gateway import Gateway
from ..intake.tenancy import Tenant
from . import admin_view as admin
from .admin_policy import check_new_worker
from .errors import ApiError, bad_request, not_found


def workers(gw: Gateway) -> dict[str, Any]:
    return {"workers": [_summary(gw, w) for w in gw.pool.workers.values()]}


def _summary(gw: Gateway, w: Any) -> dict[str, Any]:
    d: dict[str, Any] = w.summary()
    d["key_fidelity"] = gw.fidelity.summary(w.id)
    d["speeds"] = admin.speeds_summary(w)
    return d


async def add_worker(gw: Gateway, body: bytes) -> dict[str, Any]:
    try:
        wc = WorkerConfig.model_validate_json(body)
    except ValidationError as e:
        raise bad_request(f"Invalid worker: {format_validation_error(e)}") from None
    await check_new_worker(wc, gw.cfg.admin, gw.cfg.admin_token is not None)
    if wc.model is None:
        if len(gw.models.by_id) != 1:
            raise bad_request("`model` is required when several models are served.", "model")
        wc.model = next(iter(gw.models.by_id))
    rt = gw.models.get(wc.model)
    if rt is None:
        raise bad_request(f"Unknown model {wc.model!r}.", "model")
    wc.model = rt.id
    ranks = expand_ranks(wc)  # a data-parallel server: one worker per rank, all or none
    for r in ranks:
        if r.id in gw.pool.workers:
            raise ApiError(409, f"Worker {r.id!r} already exists.", "invalid_request_error", "id", "conflict")
    added = [gw.pool.add(r) for r in ranks]
    out = _summary(gw, added[0])
    if len(added) > 1:
        out["ranks"] = [w.id for w in added]
    return out


async def remove_worker(gw: Gateway, worker_id: str) -> dict[str, Any]:
    try:
        w = await gw.pool.remove(worker_id)
    except KeyError:
        raise not_found(f"Unknown worker {worker_id!r}.") from None
    gw.policy_forget(worker_id)
    return {"removed": w.id}


def drain_worker(gw: Gateway, worker_id: str, draining: bool) -> dict[str, Any]:
    try:
        return _summary(gw, gw.pool.drain(worker_id, draining))
    except KeyError:
        raise not_found(f"Unknown worker {worker_id!r}.") from None


async def replicate(gw: Gateway, change: AdminChange) -> dict[str, str]:
    """Apply a change made here in every other gateway process (router/fleet/replica_sync.py);
    the header that says how many processes have it. Nothing without `--processes`."""
    if gw.replicas is None:
        return {}
    have, n = await gw.replicas.publish(change)
    return {"x-kvroute-processes-applied": f"{have}/{n}"}


async def apply_change(gw: Gateway, change: AdminChange) -> None:
    """A change another process took (or the journal holds), applied here alone. Adding a
    worker that exists and removing one that does not are done already."""
    try:
        if change.op == "add":
            await add_worker(gw, change.arg.encode())
        elif change.op == "remove":
            await remove_worker(gw, change.arg)
        elif change.op in ("drain", "undrain"):
            drain_worker(gw, change.arg, change.op == "drain")
        else:
            await gw.purge_tenant(change.arg)
    except ApiError as e:
        if not ((change.op == "add" and e.status == 409) or (change.op == "remove" and e.status == 404)):
            raise


def calibration(gw: Gateway) -> dict[str, Any]:
    cal = getattr(gw.policy, "calibrator", None)
    snap = cal.snapshot() if cal is not None else {}
    return {"policy": gw.policy_name, "calibration": msgspec.to_builtins(snap)}


_UNSALTED = Tenant("(none)", "", 1 << 30)  # explain without a tenant: unsalted keys


async def explain(gw: Gateway, body: bytes, headers: dict[str, str], tenant_id: str | None) -> dict[str, Any]:
    """What routing would do for a chat or completion body now, without sending it."""
    if tenant_id:
        tenant = gw.tenancy.tenants.get(tenant_id)
        if tenant is None:
            raise not_found(f"Unknown tenant {tenant_id!r}.", "tenant")
    else:
        tenant = gw.tenancy.tenants.get("default") or _UNSALTED
    chat = "messages" in _keys(body)
    t0 = time.perf_counter()
    prep = await gw.prepare(chat, body, headers, tenant)
    result = gw.explain(prep)
    result["explain_ms"] = round((time.perf_counter() - t0) * 1000, 3)
    return result


def _keys(body: bytes) -> set[str]:
    try:
        d = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise bad_request("We could not parse the JSON body of your request.", None, "invalid_json") from None
    if not isinstance(d, dict):
        raise bad_request("The request body must be a JSON object.")
    return set(d)
