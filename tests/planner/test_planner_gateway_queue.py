"""The gateway queue: order, per-tenant fairness, late binding and its fairness bound."""
from __future__ import annotations

import random

import pytest

from router.planner.gateway_queue import GatewayQueue


def drain(q: GatewayQueue[str], now: float = 0.0) -> list[str]:
    out = []
    while len(q):
        item = q.pop(now)
        assert item is not None
        out.append(item)
    assert q.pop(now) is None
    return out


def test_spf_binds_the_fewest_tokens_first_and_fifo_keeps_arrival_order() -> None:
    spf: GatewayQueue[str] = GatewayQueue(order="spf")
    fifo: GatewayQueue[str] = GatewayQueue(order="fifo")
    for name, size in (("long", 80_000), ("short", 900), ("mid", 7_000), ("short2", 900)):
        spf.push(name, size, 0.0)
        fifo.push(name, size, 0.0)
    assert drain(spf) == ["short", "short2", "mid", "long"]  # equal sizes: arrival order
    assert drain(fifo) == ["long", "short", "mid", "short2"]


def test_a_request_that_waited_max_wait_goes_first() -> None:
    q: GatewayQueue[str] = GatewayQueue(order="spf", max_wait_s=2.0)
    q.push("long", 80_000, 0.0)
    for i in range(3):
        q.push(f"s{i}", 100, 1.0)
    assert q.pop(1.5) == "s0"  # not overdue yet: shortest first
    assert q.pop(2.0) == "long"  # overdue: first, whatever its size
    assert drain(q, 2.0) == ["s1", "s2"]


def test_tenants_take_turns_by_work_served() -> None:
    q: GatewayQueue[str] = GatewayQueue(order="spf")
    for i in range(4):
        q.push(f"a{i}", 1_000, 0.0, tenant="a")
    q.push("b0", 3_000, 0.0, tenant="b")
    q.push("b1", 3_000, 0.0, tenant="b")
    # a and b start even; then whoever has been served less prefill work goes next
    assert drain(q) == ["a0", "b0", "a1", "a2", "a3", "b1"]


def test_late_binding_holds_only_while_every_worker_is_over_target() -> None:
    q: GatewayQueue[str] = GatewayQueue(order="fifo", hold_target_s=0.5, max_wait_s=3.0)
    assert not q.should_hold([9.0, 9.0], 0.0)  # nothing held: nothing to hold back
    q.push("r", 100, 0.0)
    assert q.should_hold([0.6, 2.0], 1.0)
    assert not q.should_hold([0.6, 0.4], 1.0)  # a worker drained below the target
    assert not q.should_hold([5.0, 5.0], 3.0)  # the fairness bound: waited max_wait_s
    assert not GatewayQueue(order="spf").should_hold([5.0], 0.0)  # no target: never holds


def test_every_request_comes_out_once() -> None:
    rng = random.Random(3)
    q: GatewayQueue[int] = GatewayQueue(order="spf", max_wait_s=1.0)
    out: list[int] = []
    n = 0
    for step in range(200):
        now = step * 0.1
        for _ in range(rng.randrange(3)):
            q.push(n, rng.randrange(1, 10_000), now, tenant=rng.choice("xyz"))
            n += 1
        for _ in range(rng.randrange(3)):
            item = q.pop(now)
            if item is not None:
                out.append(item)
    out += drain(q, 100.0)
    assert sorted(out) == list(range(n))


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="order"):
        GatewayQueue(order="lifo")
    with pytest.raises(ValueError, match="hold_target_s"):
        GatewayQueue(hold_target_s=-1.0)
    with pytest.raises(ValueError, match="max_wait_s"):
        GatewayQueue(max_wait_s=-1.0)
