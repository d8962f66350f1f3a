"""Memory pressure: GPU memory a request would take past the worker's KV capacity.

New blocks that do not fit wait for running requests to finish and free theirs, which
greedy TTFT routing did not see: in saturation it piled requests onto workers whose
memory was already committed. Priced in decode time, so kv_cost can weigh it against
T_ttft (MEMORY_WEIGHT; docs/planner.md, "Saturation").
"""
from __future__ import annotations

from ..context import RequestContext
from ..types import WorkerView


def memory_seconds(ctx: RequestContext, w: WorkerView, gpu_held: int, bound: float = 1.0) -> float:
    """GPU memory this request would take on `w` beyond what it has, in decode time.

    Committed: the KV of the router's requests in flight there (prompt + output tokens;
    the report's used blocks when the router has no count). New: this request's prompt and
    output blocks less the `gpu_held` leading blocks it would share. The part of the new
    blocks that pushes the committed ones past `bound` x the GPU's capacity C has to wait
    for running requests to finish; they free about C blocks per decode lifetime
    (max_tokens x decode step), so that excess costs excess / C lifetimes. Zero while it
    fits, and for a worker whose GPU block size is unknown (`gpu_block_tokens` 0: vLLM)
    or that has no decode speed (docs/planner.md, "Saturation"). Counted in tokens: the
    worker's blocks may be larger than the index's. Output is counted at `max_tokens`, the
    client's budget, which over-declaring clients make larger than what they use."""
    gbt = w.gpu_block_tokens
    c = w.cost
    cap = w.gpu_capacity_blocks * gbt * bound  # in tokens from here on
    if cap <= 0.0 or c.decode_step_s <= 0.0:
        return 0.0
    if w.active_kv_tokens is not None:
        used = float(w.active_kv_tokens)
    else:
        used = float((w.gpu_capacity_blocks - w.gpu_free_blocks) * gbt)
    new = ctx.prompt_tokens + ctx.max_tokens - gpu_held * c.block_size
    if new <= 0 or used + new <= cap:
        return 0.0
    excess = new if used > cap else used + new - cap  # only what this request adds past capacity
    return excess / cap * max(ctx.max_tokens, 1) * c.decode_step_s
