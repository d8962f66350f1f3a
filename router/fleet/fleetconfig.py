"""What the config says a model and a worker are: ids, tokenizer, namespace, costs, KV events.

Split from config.py (the whole file's schema and loading) because these sections are
what the pool and the workers' registration read; config.py composes them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..planner.pd import check_role
from .credentials import AuthConfig

TIER_NAMES = ("CPU", "DISK", "REMOTE", "PEER")


class Strict(BaseModel):
    """Unknown fields are errors: a typo in the config fails at start, naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=False)


class LinkConfig(Strict):
    read_Bps: float = Field(gt=0)
    latency_s: float = Field(default=0.0, ge=0)


class CostConfig(Strict):
    """A worker's speed coefficients before its reports (or instead of them, for vLLM)."""

    block_bytes: int | None = Field(default=None, gt=0)
    prefill_tokens_per_s: float | None = Field(default=None, gt=0)
    prefill_attn_s_per_token2: float | None = Field(default=None, ge=0)
    prefill_overhead_s: float | None = Field(default=None, ge=0)
    decode_step_s: float | None = Field(default=None, ge=0)
    links: dict[str, LinkConfig] = Field(default_factory=dict)

    @field_validator("links")
    @classmethod
    def _tiers(cls, v: dict[str, LinkConfig]) -> dict[str, LinkConfig]:
        out = {}
        for k, link in v.items():
            if k.upper() not in TIER_NAMES:
                raise ValueError(f"unknown tier {k!r}; expected one of {', '.join(TIER_NAMES)}")
            out[k.upper()] = link
        return out

    def merged(self, over: CostConfig | None) -> CostConfig:
        """This config with every field `over` sets replaced (links merged per tier)."""
        if over is None:
            return self
        data = self.model_dump()
        for k, v in over.model_dump(exclude={"links"}).items():
            if v is not None:
                data[k] = v
        links = {k: LinkConfig(**v) for k, v in data.pop("links").items()}
        links.update(over.links)
        return CostConfig(**data, links=links)


class NamespaceConfig(Strict):
    """The model-level fields of `kvindex.keys.Namespace` (everything but the model id)."""

    revision: str = ""
    tokenizer_revision: str = ""
    kv_dtype: str = "auto"
    parallel: str = "tp1"
    block_size: int = Field(default=16, gt=0, le=4096)


class SharedPrefixConfig(Strict):
    """A prefix shared on purpose across tenants (a public system prompt).

    Exactly one of `token_ids` (as sent), `text` (a completion prompt's start, tokenized
    like a prompt) or `messages` (a chat's first messages, rendered with the model's
    template) is given. Only its full blocks stay unsalted.
    """

    name: str
    model: str | None = None
    token_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, str]] | None = None

    @model_validator(mode="after")
    def _one(self) -> SharedPrefixConfig:
        given = [x for x in (self.token_ids, self.text, self.messages) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of token_ids, text, messages")
        return self


class ModelConfig(Strict):
    id: str = Field(min_length=1)
    served_names: list[str] = Field(default_factory=list)
    tokenizer: Path
    max_context_tokens: int = Field(default=131072, gt=0)
    namespace: NamespaceConfig = Field(default_factory=NamespaceConfig)
    # A simulated-worker profile (name in configs/profiles/ or a path) whose `cost`
    # section seeds this model's cost defaults; explicit `cost` fields win.
    profile: str | None = None
    cost: CostConfig = Field(default_factory=CostConfig)


class EventsConfig(Strict):
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = "kv"
    # vLLM publishing to `tcp://127.0.0.1:P` connects, so the subscriber must bind.
    bind: bool = False

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(tcp|ipc|inproc)://", v):
            raise ValueError("must be a ZMQ endpoint (tcp://host:port, ipc://path)")
        return v


# SGLang's default `--page-size`: its radix cache publishes one event hash per token.
SGLANG_PAGE_SIZE = 1


class WorkerConfig(Strict):
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str
    kind: Literal["kvroute", "vllm", "sglang"] = "kvroute"
    model: str | None = None  # defaults to the only model
    events: EventsConfig | None = None  # kvroute: learned from /info unless given
    # a vLLM engine's block size or an SGLang engine's page size (default: the model's)
    block_size: int | None = Field(default=None, gt=0)
    remote_group: str | None = None
    max_inflight: int | None = Field(default=None, gt=0)
    cost: CostConfig | None = None
    auth: AuthConfig | None = None  # an API key / headers for every call (router/fleet/credentials.py)
    # a vLLM server's data-parallel ranks behind one URL: the gateway routes to each rank
    # as a worker of its own, `<id>.dp<r>` (router/fleet/dp_ranks.py)
    data_parallel_size: int = Field(default=1, ge=1, le=256)
    data_parallel_rank: int | None = Field(default=None, ge=0)  # this entry is that one rank
    # prefill/decode disaggregation (router/planner/pd.py): "prefill", "decode" or "both"
    role: str = "both"

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        return check_role(v)

    @model_validator(mode="after")
    def _ranks(self) -> WorkerConfig:
        if self.kind == "sglang":
            if self.block_size is None:
                self.block_size = SGLANG_PAGE_SIZE
            if self.events is not None and "topic" not in self.events.model_fields_set:
                # SGLang's default topic is empty; an empty subscription takes every topic
                self.events = self.events.model_copy(update={"topic": ""})
        if self.data_parallel_rank is not None and self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} is not below data_parallel_size "
                             f"{self.data_parallel_size}")
        if (self.data_parallel_size > 1 or self.data_parallel_rank is not None) and self.kind == "kvroute":
            raise ValueError("data-parallel ranks are for kind: vllm or sglang workers")
        if self.data_parallel_size > 1 and self.data_parallel_rank is None and self.events is not None:
            for ep in (self.events.endpoint, self.events.replay_endpoint):
                if ep is not None and not re.match(r"^(tcp://.+:\d+|inproc://.+)$", ep):
                    raise ValueError(f"events endpoint {ep!r}: each rank's is derived from a tcp://host:port or "
                                     f"inproc:// one; give each rank its own entry with data_parallel_rank")
        return self

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        """A plain origin: the gateway appends the worker API's paths itself."""
        from urllib.parse import urlsplit

        u = urlsplit(v)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError("must be an http(s) URL like http://127.0.0.1:9000")
        if u.username is not None or u.password is not None:
            raise ValueError("must not carry credentials")
        if u.path not in ("", "/") or u.query or u.fragment:
            raise ValueError("must be a bare origin (no path, query or fragment), like http://127.0.0.1:9000")
        try:
            u.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise ValueError("has an invalid port") from None
        return v.rstrip("/")
