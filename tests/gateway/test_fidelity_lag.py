"""Key fidelity does not mistake KV-event lag for a mis-keyed worker (router/telemetry/observe.py).

A vLLM worker that reports more cached tokens than the index predicted at routing time
is mis-keyed only if the index, as it stands when the answer ends, still cannot explain
them: a concurrent request's blocks whose events arrive while this one runs are lag."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

from kvindex.index import PrefixIndex
from kvindex.keys import digests64
from router.telemetry.fidelity import MIN_SAMPLES, WINDOW, KeyFidelity
from router.telemetry.metrics import GatewayMetrics
from router.telemetry.observe import Observer

BS = 16  # index block
WB = 32  # the worker's engine block (two index blocks)


def _keys(n: int) -> list[bytes]:
    return [hashlib.sha256(b"block %d" % i).digest() for i in range(n)]


def _attempt(index: PrefixIndex, n_tokens: int) -> Any:
    keys = _keys(n_tokens // BS)
    plan = SimpleNamespace(digests=digests64(keys), vllm_digests=None)
    model = SimpleNamespace(block_size=BS, index=index)
    prep = SimpleNamespace(ids=list(range(n_tokens)), plan=plan, model=model)
    worker = SimpleNamespace(id="v", kind="vllm", block_size=WB)
    return SimpleNamespace(prep=prep, worker=worker), keys


def _observer() -> Observer:
    return Observer(SimpleNamespace(), GatewayMetrics(), None, KeyFidelity())  # type: ignore[arg-type]


def test_blocks_that_arrived_during_the_request_are_lag_not_mis_keying() -> None:
    index = PrefixIndex(BS)
    index.add_worker("v", b"\0" * 32, WB)
    obs = _observer()
    for _ in range(10):
        a, keys = _attempt(index, 160)
        # Routed with nothing indexed; the worker then served the first engine block from a
        # concurrent request, whose event reached the index before this answer ended.
        index.store_keys("v", keys[:2])
        obs._fidelity(a, SimpleNamespace(prompt_tokens=160, cached_tokens=32), None)  # type: ignore[arg-type]
    wf = obs.fidelity.workers["v"]
    assert wf.cached_mismatches == 0 and not wf.mis_keyed


def test_cached_tokens_the_index_never_sees_still_flag_the_worker() -> None:
    index = PrefixIndex(BS)
    index.add_worker("v", b"\0" * 32, WB)
    obs = _observer()
    for i in range(WINDOW):
        a, _keys_ = _attempt(index, 160)
        obs._fidelity(a, SimpleNamespace(prompt_tokens=160, cached_tokens=64), None)  # type: ignore[arg-type]
        # cached tokens alone convict only over a whole window (a burst's lag is short)
        assert obs.fidelity.workers["v"].mis_keyed is (i == WINDOW - 1)
    assert obs.fidelity.workers["v"].cached_mismatches == WINDOW


def test_a_prompt_counted_differently_convicts_within_a_few_answers() -> None:
    index = PrefixIndex(BS)
    index.add_worker("v", b"\0" * 32, WB)
    obs = _observer()
    for _ in range(MIN_SAMPLES):
        a, _keys_ = _attempt(index, 160)
        obs._fidelity(a, SimpleNamespace(prompt_tokens=167, cached_tokens=0), None)  # type: ignore[arg-type]
    assert obs.fidelity.workers["v"].mis_keyed
