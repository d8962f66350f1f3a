"""Hardware/model profiles of the simulated engine (configs/profiles/*.yaml).

A profile fixes what a real worker would measure: KV geometry (so block bytes are
`2·layers·kv_heads·head_dim·dtype_bytes·block_size`), device memory left for KV,
compute speed (prefill linear + attention terms, decode step cost), scheduler limits
and the tiers below GPU (capacity, read bandwidth, latency). Capacities are stored in
bytes so a block-size override keeps memory the same and only changes the block count.

The YAML is validated with pydantic (field paths in errors); inside, profiles are
frozen dataclasses. A profile also names the model's tokenizer folder (relative paths:
next to the profile file if found there, else under the repository's configs/).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError

from kvindex.keys import Namespace

_STRICT = ConfigDict(extra="forbid")
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
PROFILES_DIR = CONFIGS_DIR / "profiles"
DEFAULT_TOKENIZER = "assets/tiny-tokenizer"  # under CONFIGS_DIR: the gateway's default too


class ProfileError(ValueError):
    """A profile that cannot be loaded: unknown name, bad YAML, bad field (with its path)."""


@dataclass(frozen=True)
class KVGeometry:
    """What one token's KV occupies: `2 (K and V) · layers · kv_heads · head_dim · dtype_bytes`."""

    __pydantic_config__ = _STRICT
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class ComputeModel:
    """Step costs. Prefill of `n` new tokens after `c` cached ones (one chunk) costs
    `prefill_overhead_s + n / prefill_tokens_per_s + prefill_attn_s_per_token2 · n · (c + n/2)`
    (docs/wire.md); a decode step of `b` sequences holding `ctx` tokens in all costs
    `decode_base_s + decode_per_seq_s · b + decode_per_ctx_token_s · ctx`."""

    __pydantic_config__ = _STRICT
    prefill_tokens_per_s: float
    prefill_attn_s_per_token2: float
    prefill_overhead_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float

    def prefill_s(self, n: int, c: int) -> float:
        if n <= 0:
            return 0.0
        return (
            self.prefill_overhead_s + n / self.prefill_tokens_per_s + self.prefill_attn_s_per_token2 * n * (c + n / 2)
        )

    def decode_step_s(self, batch: int, ctx_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * ctx_tokens


@dataclass(frozen=True)
class DeviceMemory:
    """Device memory left for KV = `device_bytes · memory_utilization − weights − reserved`."""

    __pydantic_config__ = _STRICT
    device_bytes: float
    memory_utilization: float
    weights_bytes: float
    reserved_bytes: float = 0.0

    @property
    def kv_bytes(self) -> float:
        return self.device_bytes * self.memory_utilization - self.weights_bytes - self.reserved_bytes


@dataclass(frozen=True)
class TierSpec:
    """A storage tier below GPU and the link KV is read over into GPU memory.

    A load of `b` bytes costs `latency_s + b / read_Bps` and transfers on one link run
    one after another (a link is a PCIe direction, a disk, a NIC)."""

    __pydantic_config__ = _STRICT
    capacity_bytes: float
    read_Bps: float
    latency_s: float
    # DISK only: a block is written to disk only once it was used this many times within
    # `admit_window_s` (an SSD admission filter, as Dynamo's KVBM has): one-off prompts
    # never wear the SSD.
    admit_after_uses: int = 1
    admit_window_s: float = 600.0


@dataclass(frozen=True)
class LinkSpec:
    """A link without storage behind it (PEER: another worker's memory over the network)."""

    __pydantic_config__ = _STRICT
    read_Bps: float
    latency_s: float


@dataclass(frozen=True)
class SchedulerSpec:
    """vLLM-like limits: token budget per step (chunked prefill), running and waiting caps."""

    __pydantic_config__ = _STRICT
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_waiting: int = 256
    prefetch_queue: int = 64


@dataclass(frozen=True)
class SimProfile:
    """One simulated worker's model, hardware and limits (see the module doc)."""

    __pydantic_config__ = _STRICT
    name: str
    model: str
    geometry: KVGeometry
    memory: DeviceMemory
    compute: ComputeModel
    block_size: int = 16
    max_context_tokens: int = 131072
    served_model_names: tuple[str, ...] = ()
    revision: str = ""
    tokenizer_revision: str = ""
    kv_dtype: str = "bfloat16"
    parallel: str = "tp1"
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    cpu: TierSpec | None = None
    disk: TierSpec | None = None
    remote: TierSpec | None = None
    peer: LinkSpec | None = None
    # When blocks reach the group's REMOTE store: as they leave GPU ("evict", with the CPU
    # copy) or as soon as they are computed ("compute", LMCache-style write-through).
    remote_write: Literal["evict", "compute"] = "evict"
    event_replay_buffer: int = 10000
    # The model's Hugging Face tokenizer folder (tokenizer.json + chat template), for
    # clients that send text: absolute, or relative to configs/.
    tokenizer: str = DEFAULT_TOKENIZER
    notes: str = ""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.max_context_tokens <= 0:
            raise ValueError("max_context_tokens must be positive")
        if self.gpu_blocks() <= 0:
            raise ValueError(
                f"profile {self.name!r}: no device memory left for KV "
                f"({self.memory.kv_bytes:.3g} bytes after weights and reserve)"
            )

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block: `2·layers·kv_heads·head_dim·dtype_bytes·block_size`."""
        return self.geometry.bytes_per_token * self.block_size

    def gpu_blocks(self) -> int:
        return int(self.memory.kv_bytes // self.block_bytes)

    def refusal(self, prompt_tokens: int, max_tokens: int) -> tuple[str, str] | None:
        """Why a worker of this profile refuses a request outright as too large (400), as
        `(param, message)`, or None: prompt + max_tokens over the model's context, or more
        KV blocks than its whole GPU pool. One rule for the engine (`SimEngine.submit`) and
        for what must leave out the requests it refuses (the `ideal` bound, loadtest/ideal.py)."""
        if prompt_tokens + max_tokens > self.max_context_tokens:
            return ("max_tokens", f"this model's maximum context length is {self.max_context_tokens} tokens; the "
                    f"request has {prompt_tokens} prompt tokens + {max_tokens} max_tokens")
        need = -(-(prompt_tokens + max_tokens) // self.block_size)
        cap = self.gpu_blocks()
        if need > cap:
            return ("prompt", f"the request needs {need} KV blocks ({prompt_tokens} prompt + {max_tokens} max_tokens "
                    f"tokens) but this worker holds {cap} ({cap * self.block_size} tokens)")
        return None

    def tier_blocks(self, spec: TierSpec | None) -> int:
        return 0 if spec is None else int(spec.capacity_bytes // self.block_bytes)

    def namespace(self) -> Namespace:
        """The model-level key namespace of this deployment (docs/wire.md § Block keys)."""
        return Namespace(
            self.model, self.revision, self.tokenizer_revision, self.kv_dtype, self.parallel, self.block_size
        )

    def with_block_size(self, block_size: int) -> SimProfile:
        """The same hardware at another block size (capacities are bytes, so they hold)."""
        return replace(self, block_size=block_size)

    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)

    def tokenizer_dir(self) -> Path:
        """The tokenizer folder, whatever the working directory."""
        p = Path(self.tokenizer)
        return p if p.is_absolute() else CONFIGS_DIR / p


_ADAPTER = TypeAdapter(SimProfile)


def profile_from_dict(data: dict[str, Any]) -> SimProfile:
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as e:
        raise ProfileError(str(e)) from None


def load_profile(name_or_path: str | os.PathLike[str]) -> SimProfile:
    """Load a profile by file path or by name from configs/profiles (or $KVROUTE_PROFILES_DIR)."""
    p = Path(name_or_path)
    if not p.is_file():
        base = Path(os.environ.get("KVROUTE_PROFILES_DIR", PROFILES_DIR))
        p = base / f"{name_or_path}.yaml"
        if not p.is_file():
            known = sorted(x.stem for x in base.glob("*.yaml")) if base.is_dir() else []
            raise ProfileError(f"unknown profile {str(name_or_path)!r}; known: {', '.join(known) or 'none'}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{p}: a profile is a mapping")
    tok = data.get("tokenizer")
    if isinstance(tok, str) and not Path(tok).is_absolute() and (p.parent / tok).is_dir():
        data["tokenizer"] = str((p.parent / tok).resolve())
    try:
        return profile_from_dict(data)
    except ProfileError as e:
        raise ProfileError(f"{p}: {e}") from None
