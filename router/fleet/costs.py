"""A worker's starting cost coefficients, and which of them its reports may change.

The model's config (or hardware profile) gives the defaults, a worker's `cost` block
overrides them; what the worker later reports in `/load` replaces the defaults but
never an override (`Pins`): an operator's number is a deliberate correction.
"""
from __future__ import annotations

from ..intake.model import ModelRuntime
from ..planner.fleet import SPEED_FIELDS, TIER_BY_NAME, Pins
from ..planner.types import CostParams, Link
from .fleetconfig import CostConfig

DEFAULT_PREFILL_TPS = 10_000.0
DEFAULT_BLOCK_BYTES_PER_TOKEN = 131_072  # Llama-3-8B in bf16, when nothing better is known


def cost_params(
    model: ModelRuntime, over: CostConfig | None, worker_block: tuple[int, int] | None = None
) -> CostParams:
    """The model's cost defaults with the worker's overrides.

    `block_size` is the model's index block size (matches are counted in index blocks);
    `worker_block` = (engine block size, bytes per engine block) from `/info`, scaled to
    bytes per index block; else the config's `block_bytes`."""
    base = model.cost.merged(over)
    bs = model.block_size
    bb = base.block_bytes
    if worker_block is not None and worker_block[0] and worker_block[1]:
        bb = worker_block[1] * bs // worker_block[0]
    return CostParams(
        block_size=bs,
        block_bytes=bb or bs * DEFAULT_BLOCK_BYTES_PER_TOKEN,
        prefill_tokens_per_s=base.prefill_tokens_per_s or DEFAULT_PREFILL_TPS,
        prefill_attn_s_per_token2=base.prefill_attn_s_per_token2 or 0.0,
        prefill_overhead_s=base.prefill_overhead_s or 0.0,
        decode_step_s=base.decode_step_s or 0.0,
        links={TIER_BY_NAME[k]: Link(v.read_Bps, v.latency_s) for k, v in base.links.items()},
    )


def pins(over: CostConfig | None) -> Pins:
    """The coefficients the worker's own `cost` block fixes."""
    if over is None:
        return Pins()
    return Pins(
        speeds=frozenset(f for f in SPEED_FIELDS if getattr(over, f) is not None),
        tiers=frozenset(TIER_BY_NAME[k] for k in over.links),
    )


def speeds_stated(model: ModelRuntime, over: CostConfig | None, kind: str) -> bool:
    """Whether anyone stated this worker's prefill speed: our workers report what they
    measure, a model profile or a `cost:` block gives one; otherwise only the router's
    defaults are known until the worker is measured (router/fleet/speed_probe.py)."""
    return kind == "kvroute" or bool(model.cost.merged(over).prefill_tokens_per_s)
