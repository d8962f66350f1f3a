"""The cases, one module per concern. Importing this package registers them all in
`runner.CASES`, in the order the table lists them (docs/harden.md's order)."""
from __future__ import annotations

from ..runner import CASES
from . import (  # noqa: F401
    admin,
    browser,
    busy,
    clients,
    deploy,
    drain,
    edge,
    embeddings,
    events,
    faults,
    fuzz,
    headers,
    huge_prompts,
    memory,
    network_policy,
    overload,
    shared_kv,
    tenants,
    timeouts,
)

ORDER = (
    # 1. bursts
    "burst_at_start", "burst_slo", "burst_3x", "overload_rate",
    # 2. timeouts
    "hanging_worker", "stalled_stream", "unhealthy_inflight",
    # 3. one tenant stalls every tenant
    "noisy_tenant", "special_tokens",
    # 4. tenants probing each other
    "tenant_probe",
    # 5, 6. the admin API
    "admin_ipc_bind", "admin_ssrf",
    # the connection's edge, the admin API against a browser, how the gateway is deployed
    "header_flood", "slow_loris", "admin_cross_site", "processes_admin", "k8s_service_links",
    # 7. deep JSON
    "deep_json",
    # workers failing
    "worker_killed_mid_stream", "worker_killed_first_byte", "worker_reset", "worker_garbage_sse",
    "worker_truncated_sse", "worker_500", "worker_429", "vllm_passthrough_faults",
    # the index across failures
    "event_gap", "publisher_restart", "gateway_restart", "busy_machine",
    # clients
    "slow_readers", "client_disconnects", "body_413_keepalive",
    # fuzzing
    "fuzz_schemathesis", "fuzz_mutation",
    # workers' own surface
    "sim_peer_pull", "shared_kv_forged",
    # memory
    "memory_hostile", "huge_prompts",
    # the edge: the drain's end, embeddings, one network policy, details
    "drain_streams", "embeddings_path", "network_policy", "edge_details",
)

_missing = [n for n in CASES if n not in ORDER]
assert not _missing and set(ORDER) <= set(CASES), (_missing, set(ORDER) - set(CASES))
_ordered = {n: CASES[n] for n in ORDER}
CASES.clear()
CASES.update(_ordered)
