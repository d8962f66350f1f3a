"""The gateway's configuration: one YAML file, pydantic-validated, env overrides (docs/design.md §4.6).

Why pydantic at this edge: a bad config must fail at start with the field path and the
reason (`workers[1].url: ...`), not as an AttributeError on the first request.

Environment overrides: a variable `KVROUTE_A__B__C=value` sets `a.b.c`; a numeric part
indexes a list (`KVROUTE_WORKERS__0__URL=...`). Values are parsed as YAML scalars, so
`8080`, `true`, `[a, b]` and `null` have their YAML types. Only a variable whose first
part names a top-level field (`listen`, `routing`, `admin_token`, ...) is an override:
Kubernetes puts service-link variables into every pod (`KVROUTE_GATEWAY_PORT=tcp://...`
for a Service `kvroute-gateway`), and those, like any other unknown `KVROUTE_*`
variable, are logged and ignored rather than stopping the gateway. Relative paths in the file
(tokenizer folders, trace files, profiles) are resolved against the file's folder (a
tokenizer folder found only under the project root resolves there).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from .fleet.fleetconfig import (
    CostConfig,
    EventsConfig,
    ModelConfig,
    NamespaceConfig,
    SharedPrefixConfig,
    Strict,
    WorkerConfig,
)
from .fleet.netpolicy import NetworkPolicy
from .planner.registry import make_policy, policy_params

ENV_PREFIX = "KVROUTE_"
# KVROUTE_* variables that belong to the workers, not to the gateway's config.
NOT_CONFIG_ENV = frozenset({"KVROUTE_PEER_TOKEN", "KVROUTE_PROFILES_DIR"})
REPO_ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("kvroute.config")
PROFILES_DIR = REPO_ROOT / "configs" / "profiles"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path and the reason."""


class DiscoveryConfig(Strict):
    """Workers behind a DNS name (a Kubernetes headless Service, a Consul name): re-resolved
    every `interval_s`; each address becomes a worker `<id_prefix>-<host>-<port>` with the
    fields below, added when it appears and removed when it is gone. `srv`: read SRV
    records (their targets and ports) instead of A/AAAA records on `port`. `events`
    endpoints may use `{host}`, replaced by each worker's address (for a vLLM worker, and
    for our engines, whose /info names the address they bind)."""

    name: str = Field(min_length=1)
    port: int | None = Field(default=None, ge=1, le=65535)
    srv: bool = False
    scheme: Literal["http", "https"] = "http"
    id_prefix: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    interval_s: float = Field(default=10.0, gt=0)
    kind: Literal["kvroute", "vllm", "sglang"] = "kvroute"
    model: str | None = None
    events: EventsConfig | None = None
    block_size: int | None = Field(default=None, gt=0)
    max_inflight: int | None = Field(default=None, gt=0)
    cost: CostConfig | None = None

    @model_validator(mode="after")
    def _port(self) -> DiscoveryConfig:
        if not self.srv and self.port is None:
            raise ValueError("port: required unless srv is true (A/AAAA records carry no port)")
        return self

    @property
    def prefix(self) -> str:
        """The name's first label that is not an SRV service or protocol label (`_http._tcp.`)."""
        labels = [x for x in self.name.split(".") if x and not x.startswith("_")]
        return self.id_prefix or (labels[0] if labels else "dns")


class ShutdownConfig(Strict):
    """On SIGTERM: /ready answers 503 at once; requests are still taken for `grace_s` (a
    load balancer notices and stops sending), then the listener closes and requests in
    flight get up to `drain_timeout_s` to finish; then the process exits."""

    grace_s: float = Field(default=5.0, ge=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)


class PrefetchConfig(Strict):
    enabled: bool = True
    min_blocks: int = Field(default=1, ge=1)
    margin_s: float = Field(default=0.05, ge=0)  # added to the predicted queue time for the deadline
    min_deadline_s: float = Field(default=0.2, gt=0)
    # how long dispatch waits at most for the 202 of a peer-pull prefetch before forwarding
    ack_timeout_s: float = Field(default=0.05, gt=0)


class GatewayQueueConfig(Strict):
    """The gateway's own queue (router/binding.py, docs/planner.md "Scheduling"): while
    every worker of a model predicts a queue over `hold_target_s`, requests wait at the
    gateway and bind, in `order`, to the worker that frees first. Off when
    `hold_target_s` is null."""

    hold_target_s: float | None = Field(default=None, ge=0)
    order: Literal["fifo", "spf"] = "fifo"
    max_hold_s: float = Field(default=20.0, ge=0)  # the fairness bound: held this long, bound anyway
    max_held: int = Field(default=4096, gt=0)  # per model; beyond it, requests route on arrival


class RoutingConfig(Strict):
    policy: str = "kv_cost"
    params: dict[str, Any] = Field(default_factory=dict)
    prefetch: PrefetchConfig = Field(default_factory=PrefetchConfig)
    max_ttft_s: float | None = Field(default=None, gt=0)  # SLO: shed (429) when every worker predicts more
    retries: int = Field(default=1, ge=0, le=3)
    default_retry_after_s: float = Field(default=1.0, gt=0)
    # Gateway replicas sharing the fleet behind one balancer (`kvroute serve --processes N` sets
    # at least N): each counts its dispatches not yet in a load report this many times.
    replicas: int = Field(default=1, ge=1, le=1024)
    gateway_queue: GatewayQueueConfig = Field(default_factory=GatewayQueueConfig)
    # Each dispatch revises the predicted TTFT of the requests sent to the same worker before
    # it that it will delay (FleetWorker.revise_ahead); calibration learns from the revised one.
    revise_predictions: bool = True

    def policy_kwargs(self) -> dict[str, Any]:
        """The policy's keyword arguments: `params`, with `max_ttft_s` when the policy takes it."""
        params = dict(self.params)
        if self.max_ttft_s is not None and "max_ttft_s" in policy_params(self.policy):
            params.setdefault("max_ttft_s", self.max_ttft_s)
        return params

    @model_validator(mode="after")
    def _policy(self) -> RoutingConfig:
        """A typo in the policy or its parameters fails at start, with the valid choices."""
        make_policy(self.policy, **self.policy_kwargs())
        return self


class TenantConfig(Strict):
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    api_keys: list[str] = Field(min_length=1)
    # Isolation salt: enters every key of this tenant's requests. Default: derived from
    # the id (isolates tenants from each other; set a secret one to make keys unguessable).
    salt: str | None = None
    max_concurrency: int | None = Field(default=None, gt=0)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        if any(len(k) < 8 for k in v):
            raise ValueError("API keys must be at least 8 characters")
        return v


class LimitsConfig(Strict):
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    max_prompt_tokens: int | None = Field(default=None, gt=0)  # default: the model's context
    default_max_tokens: int = Field(default=1024, gt=0)
    max_messages: int = Field(default=4096, gt=0)
    tenant_max_concurrency: int = Field(default=1024, gt=0)
    worker_max_inflight: int | None = Field(default=None, gt=0)
    max_stop_sequences: int = Field(default=4, ge=0)
    # Request bodies in flight at once, all requests together (router/intake/budget.py): bounds memory.
    max_inflight_body_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    # An embeddings answer the gateway relays (held whole, counted in the budget above).
    max_embeddings_answer_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # Bodies of 64 KiB or more, per tenant (router/intake/bodyrate.py): 16 MiB/s is ~4 M prompt tokens
    # a second, more than a hundred workers prefill; null: no limit.
    tenant_large_body_bytes_per_s: float | None = Field(default=16 * 1024 * 1024, gt=0)


class TraceConfig(Strict):
    enabled: bool = False
    path: Path = Path("runs/gateway-trace.jsonl")
    # Keyed-hash salt: without it hash ids cannot be linked to content. Default: random per run.
    salt: str | None = None
    block_tokens: int = Field(default=512, gt=0)
    max_ids: int = Field(default=10_000_000, gt=0)


class OtelConfig(Strict):
    """OpenTelemetry traces (router/telemetry/tracing.py): a span per request when the SDK is installed.
    `endpoint`: an OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces); without it
    the process's global tracer provider is used."""

    enabled: bool = False
    endpoint: str | None = None
    service_name: str = "kvroute-gateway"


class ObservabilityConfig(Strict):
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"  # JSON lines (router/telemetry/logs.py) or plain text
    # One line per completion request (request id, tenant, worker, decision reason, timings)
    request_log: bool = True
    access_log: bool = False  # uvicorn's own line per HTTP request (every route)
    trace: TraceConfig = Field(default_factory=TraceConfig)
    otel: OtelConfig = Field(default_factory=OtelConfig)
    # When set, GET /metrics needs `Authorization: Bearer <token>` (tenants cannot read it).
    metrics_token: str | None = None


class AdminConfig(Strict):
    """What the admin API may do. Without `admin_token` it answers only clients on this
    host, and only while the gateway itself listens on loopback (the embedded default).

    `worker_networks` is the gateway's one network policy (router/fleet/netpolicy.py): every
    address it connects to — worker URLs and KV-event endpoints, from this file, DNS
    discovery, the admin API or a worker's `/info` — must lie on one of them (host
    names are resolved and every address checked): the gateway is not a proxy to
    anywhere. Event endpoints from the admin API or `/info` are `tcp://` and connected
    to, never bound, unless `allow_ipc_events` / `allow_event_bind`."""

    worker_networks: list[str] = Field(default_factory=lambda: [
        "127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"])
    allow_event_bind: bool = False
    allow_ipc_events: bool = False

    @field_validator("worker_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        import ipaddress

        for n in v:
            try:
                ipaddress.ip_network(n, strict=False)
            except ValueError:
                raise ValueError(f"not a network: {n!r} (CIDR, e.g. 10.0.0.0/8)") from None
        return v


KVROUTE_POLL_S = 0.1
METRICS_POLL_S = 2.0


class PoolConfig(Strict):
    """Worker health, the circuit breaker, and the timeouts of a request upstream.

    Health is decided by `/health` probes only: `unhealthy_after` consecutive failures
    spanning at least `unhealthy_min_s` (a busy worker answering slowly for a moment is
    not dead), or a refused connection (nothing listens). Failures the proxy sees
    (timeouts, resets, 5xx) open the worker's circuit breaker after `breaker_failures`
    in a row: out of routing for `breaker_open_s` (doubling while trials fail, up to
    `breaker_max_open_s`), its index entries kept."""

    # None: 0.1 s for our workers' `/load` (a few hundred bytes), 2 s for a vLLM server's
    # `/metrics` (~50 KB it renders in Python for each poll; the gateway's own ledger
    # covers what it sent between polls).
    load_poll_interval_s: float | None = Field(default=None, gt=0)

    def poll_interval_s(self, kind: str) -> float:
        if self.load_poll_interval_s is not None:
            return self.load_poll_interval_s
        return KVROUTE_POLL_S if kind == "kvroute" else METRICS_POLL_S
    health_interval_s: float = Field(default=1.0, gt=0)
    unhealthy_after: int = Field(default=3, ge=1)  # consecutive failed health probes
    unhealthy_min_s: float = Field(default=3.0, ge=0)  # ... failing for at least this long
    breaker_failures: int = Field(default=5, ge=1)
    breaker_open_s: float = Field(default=1.0, gt=0)
    breaker_max_open_s: float = Field(default=30.0, gt=0)
    # Slow to accept is overload (the breaker does not count it), so the bound is generous.
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # First byte: the predicted TTFT times `first_byte_factor`, never under `first_byte_min_s`.
    first_byte_min_s: float = Field(default=30.0, gt=0)
    first_byte_factor: float = Field(default=4.0, ge=1)
    idle_timeout_s: float = Field(default=30.0, gt=0)  # between chunks of a stream
    request_timeout_s: float = Field(default=600.0, gt=0)  # a whole request
    # A whole (non-streamed) answer comes only when it is done: it may take the first-byte
    # window plus this much per token it may generate (slower is a stuck worker), and
    # never more than request_timeout_s.
    whole_answer_token_s: float = Field(default=0.5, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    max_connections: int = Field(default=1024, gt=0)
    # /ready waits for each registered worker's cache to be in the index, at most this long
    index_ready_timeout_s: float = Field(default=10.0, ge=0)

    def first_byte_s(self, predicted_ttft_s: float | None) -> float:
        if predicted_ttft_s is None:
            return max(self.first_byte_min_s, self.idle_timeout_s)
        return max(self.first_byte_min_s, self.first_byte_factor * predicted_ttft_s)

    def whole_answer_s(self, predicted_ttft_s: float | None, max_tokens: int) -> float:
        return min(self.request_timeout_s,
                   self.first_byte_s(predicted_ttft_s) + max(1, max_tokens) * self.whole_answer_token_s)


class ListenConfig(Strict):
    """Where the gateway listens, and what a client connection may cost it before it is
    a request (router/api/edge.py): the request line, the header fields (count and bytes;
    414/431 past them), the time a request's head may take to arrive (408, then closed:
    slow-loris), and how long a keep-alive connection may sit idle."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_request_line_bytes: int = Field(default=8192, ge=256)
    max_header_count: int = Field(default=100, ge=8)
    max_header_bytes: int = Field(default=32768, ge=1024)
    header_timeout_s: float = Field(default=10.0, gt=0)
    idle_timeout_s: float = Field(default=30.0, gt=0)


class Config(Strict):
    listen: ListenConfig = Field(default_factory=ListenConfig)
    admin_token: str | None = None
    admin: AdminConfig = Field(default_factory=AdminConfig)
    models: list[ModelConfig] = Field(min_length=1)
    workers: list[WorkerConfig] = Field(default_factory=list)
    discovery: list[DiscoveryConfig] = Field(default_factory=list)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    tenants: list[TenantConfig] = Field(default_factory=list)
    shared_prefixes: list[SharedPrefixConfig] = Field(default_factory=list)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    shutdown: ShutdownConfig = Field(default_factory=ShutdownConfig)

    def _model_id(self, where: str, name: str | None, names: dict[str, str]) -> str:
        """A worker's (or discovery entry's) model: the only one when unnamed, else the id
        its name (id or served name) stands for."""
        if name is None:
            if len(self.models) != 1:
                raise ValueError(f"{where}: required when several models are configured")
            return self.models[0].id
        if name not in names:
            raise ValueError(f"{where}: unknown model {name!r}")
        return names[name]

    def _check_addresses(self) -> None:
        """Addresses written as IPs pass the network policy now (router/fleet/netpolicy.py); names
        are resolved and checked when their worker registers."""
        net = NetworkPolicy(self.admin.worker_networks)
        for i, w in enumerate(self.workers):
            net.check_literal(urlsplit(w.url).hostname or "", f"workers[{i}].url")
            if w.events is not None:
                net.check_events_literal(w.events.endpoint, w.events.replay_endpoint, w.events.bind,
                                         f"workers[{i}].events")
        for i, d in enumerate(self.discovery):
            e = d.events
            if e is not None and "{host}" not in e.endpoint + (e.replay_endpoint or ""):
                net.check_events_literal(e.endpoint, e.replay_endpoint, e.bind, f"discovery[{i}].events")

    @model_validator(mode="after")
    def _cross(self) -> Config:
        names: dict[str, str] = {}
        for m in self.models:
            for n in (m.id, *m.served_names):
                if n in names and names[n] != m.id:
                    raise ValueError(f"model name {n!r} is served by both {names[n]!r} and {m.id!r}")
                names[n] = m.id
        ids = set()
        for i, w in enumerate(self.workers):
            if w.id in ids:
                raise ValueError(f"workers[{i}].id: duplicate worker id {w.id!r}")
            ids.add(w.id)
            w.model = self._model_id(f"workers[{i}].model", w.model, names)
            # a vLLM worker without `events` is allowed: routed by load alone (no index entries)
        for i, d in enumerate(self.discovery):
            d.model = self._model_id(f"discovery[{i}].model", d.model, names)
        self._check_addresses()
        keys: dict[str, str] = {}
        tids = set()
        for t in self.tenants:
            if t.id in tids:
                raise ValueError(f"duplicate tenant id {t.id!r}")
            tids.add(t.id)
            for k in t.api_keys:
                if k in keys:
                    raise ValueError(f"API key of tenant {t.id!r} is also given to {keys[k]!r}")
                keys[k] = t.id
        for s in self.shared_prefixes:
            if s.model is not None and s.model not in names:
                raise ValueError(f"shared prefix {s.name!r}: unknown model {s.model!r}")
        return self


# --------------------------------------------------------------------------- loading


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        lines.append(f"{_fmt_loc(tuple(err['loc']))}: {err['msg']}")
    return "; ".join(lines)


def apply_env_overrides(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """Set `a.b.c` from `KVROUTE_A__B__C` (lists indexed by number). Returns `data`.
    A variable whose first part is no top-level field is not an override (module doc)."""
    ignored = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in NOT_CONFIG_ENV:
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts or parts[0] not in Config.model_fields:
            ignored.append(name)
            continue
        try:
            value = yaml.safe_load(environ[name])
        except yaml.YAMLError:
            value = environ[name]
        node: Any = data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                # Element i of a list overrides it; i == its length appends one (so that
                # KVROUTE_WORKERS__0__ID/..URL work on a config with no workers).
                if not part.isdigit() or int(part) > len(node):
                    raise ConfigError(f"{name}: no list element {part!r} to override (the list has {len(node)})")
                key: Any = int(part)
                if key == len(node):
                    node.append(None if last else {})
            else:
                key = part
            if last:
                node[key] = value
            else:
                if isinstance(node, dict) and node.get(key) is None:
                    node[key] = [] if parts[i + 1].isdigit() else {}
                node = node[key]
                if not isinstance(node, (dict, list)):
                    raise ConfigError(f"{name}: {'.'.join(parts[: i + 1])} is not a section")
    if ignored:
        log.warning("ignored environment variables that name no config section (an override is "
                    "KVROUTE_<SECTION>__<FIELD>; Kubernetes service links look like these): %s", ", ".join(ignored))
    return data


def _resolve_paths(cfg: Config, base: Path) -> None:
    for m in cfg.models:
        if not m.tokenizer.is_absolute():
            cand = base / m.tokenizer
            m.tokenizer = cand if cand.exists() or not (REPO_ROOT / m.tokenizer).exists() else REPO_ROOT / m.tokenizer
    t = cfg.observability.trace
    if not t.path.is_absolute():
        t.path = base / t.path


def profile_path(name_or_path: str, base: Path) -> Path:
    p = Path(name_or_path)
    for cand in (base / p, p, PROFILES_DIR / p, PROFILES_DIR / f"{name_or_path}.yaml"):
        if cand.is_file():
            return cand
    raise ConfigError(f"profile {name_or_path!r}: no such file (looked in {base} and {PROFILES_DIR})")


def read_profile(name_or_path: str, base: Path = REPO_ROOT) -> dict[str, Any]:
    """A simulated-worker profile as plain data (the gateway reads the YAML; it never imports workers)."""
    path = profile_path(name_or_path, base)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"profile {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"profile {path}: not a mapping")
    return data


def apply_profiles(cfg: Config, base: Path) -> None:
    """Seed a model's namespace, context and cost defaults from its profile (explicit fields win)."""
    from .profile import cost_from_profile, namespace_from_profile

    for i, m in enumerate(cfg.models):
        if m.profile is None:
            continue
        data = read_profile(m.profile, base)
        try:
            seeded = cost_from_profile(data)
            ns = namespace_from_profile(data)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"models[{i}].profile: {m.profile!r} is not a usable profile: {e}") from None
        m.cost = seeded.merged(m.cost)
        explicit = m.namespace.model_fields_set if "namespace" in m.model_fields_set else set()
        for f in NamespaceConfig.model_fields:
            if f not in explicit:
                setattr(m.namespace, f, getattr(ns, f))
        if "max_context_tokens" not in m.model_fields_set and "max_context_tokens" in data:
            m.max_context_tokens = int(data["max_context_tokens"])


def build_config(data: Mapping[str, Any], base: Path = REPO_ROOT, environ: Mapping[str, str] | None = None) -> Config:
    """Validate plain data (+ env overrides) into a Config, or raise ConfigError with field paths."""
    raw = apply_env_overrides(_deepcopy(dict(data)), os.environ if environ is None else environ)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    _resolve_paths(cfg, base)
    apply_profiles(cfg, base)
    for i, m in enumerate(cfg.models):
        if not m.tokenizer.is_dir():
            raise ConfigError(f"models[{i}].tokenizer: {m.tokenizer} is not a folder")
    return cfg


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    try:
        return build_config(data, p.resolve().parent, environ)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x
