"""The cost model's terms, one concept per module, each a small pure function.

`router.planner.cost.estimate_worker` composes the time to first token from them
(queue, KV load, the cut between loading and recomputing, recompute, decode ride);
kv_cost (`router.planner.kv_cost`) adds the terms it ranks by besides (interference,
co-scheduling, memory) and its saturation rule. The queue wait is
`router.planner.load.queue_seconds` (with the load counts the guards share).
docs/planner.md, "The cost model", gives the derivations.
"""
