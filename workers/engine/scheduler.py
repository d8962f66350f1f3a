"""The scheduler: which sequences compute how many tokens in the next step.

FCFS under a token budget (`max_num_batched_tokens`), as vLLM's v1 scheduler with chunked
prefill: running sequences first, in admission order (a decode costs one token, a
prefill what is left of the budget), then waiting ones from the head of the queue while
budget, sequence slots and blocks last. The head never gets overtaken: a request that
does not fit blocks those behind it, so none starves.

With lower tiers (workers/engine/tiers.py), a waiting sequence whose next blocks sit
below the device pool (or are being prefetched) is admitted into `loading` instead: it
gets its blocks, its loads are started, and it joins `running` when they land (vLLM's
WAITING_FOR_REMOTE_KVS). It takes no token budget meanwhile, so loads start even in a
step whose budget is spent, overlapped with that step's compute; it counts against
`max_num_seqs`.

When a running sequence cannot get a block, the most recently admitted running sequence
is preempted (its blocks released, its tokens kept, recomputed later: cheap when its
blocks are still cached) and goes back to the head of the queue; no one is admitted in
a step that preempted.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from .blocks import BlockManager
from .sequence import SeqStatus, Sequence


class LoadPlanner(Protocol):
    """What the scheduler needs from the lower tiers (workers/engine/tiers.py `KVTiers`)."""

    def plan(self, seq: Sequence, gpu_blocks: int) -> Any | None:
        """A load of the sequence's blocks after its `gpu_blocks` leading ones, or None."""
        ...

    def load_blocks(self, load: Any) -> int: ...

    def abandon(self, load: Any) -> None: ...

    def start(self, load: Any) -> None: ...


@dataclass(slots=True)
class StepPlan:
    """One step: prefill chunks (sequence, tokens) and one-token sequences (batched)."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    loading: list[Sequence] = field(default_factory=list)  # admitted to load first (no tokens this step)

    def add(self, seq: Sequence, n: int) -> None:
        if n == 1:
            self.decodes.append(seq)
        else:
            self.prefills.append((seq, n))

    def items(self) -> Iterator[tuple[Sequence, int]]:
        yield from self.prefills
        for seq in self.decodes:
            yield seq, 1

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 tiers: LoadPlanner | None = None) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        self.blocks = blocks
        self.max_batched = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.tiers = tiers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._continue_running(plan, self.max_batched)
        if not plan.preempted:
            self._admit_waiting(plan, budget)
        return plan

    def _continue_running(self, plan: StepPlan, budget: int) -> int:
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.can_grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, n)
                plan.add(seq, n)
                budget -= n
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        bs = self.blocks.block_size
        while self.waiting and len(self.running) + len(self.loading) < self.max_seqs:
            seq = self.waiting[0]
            matched = self.blocks.match(seq)
            load = self.tiers.plan(seq, len(matched)) if self.tiers is not None else None
            if load is not None and self.tiers is not None:
                n = self.tiers.load_blocks(load) * bs
                if not self.blocks.can_admit(seq, matched, n):
                    self.tiers.abandon(load)
                    break
                self.waiting.popleft()
                self.blocks.admit(seq, matched, n)
                seq.status = SeqStatus.LOADING
                self.loading.append(seq)
                plan.loading.append(seq)
                self.tiers.start(load)
                continue
            if budget <= 0:
                break
            n = min(seq.num_tokens - len(matched) * bs, budget)
            if not self.blocks.can_admit(seq, matched, n):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, matched, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.admitted.append(seq)
            plan.add(seq, n)
            budget -= n

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
