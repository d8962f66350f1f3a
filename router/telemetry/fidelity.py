"""Key fidelity: does each worker see the prompt the way the gateway keyed it?

The gateway routes on block keys from its own tokenizer and chat template; a worker
with another template or tokenizer (a vLLM server started on a different model
folder) would count other tokens, cache other blocks, and every cache prediction for
it would be wrong while routing silently works around it. So every answer's
`usage.prompt_tokens` is compared with the gateway's count, and where the worker
reports cached tokens, with what the index predicted; a worker whose answers keep
disagreeing is flagged mis-keyed (metrics, `/admin/workers`, one log line).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvroute.fidelity")

WINDOW = 20  # the last answers per worker the verdict looks at
MIN_SAMPLES = 5  # no verdict on fewer
MISKEYED_SHARE = 0.5  # at least this share of the window disagreeing: mis-keyed
CLEAR_SHARE = 0.1  # at most this share: keyed right again


@dataclass(slots=True)
class Sample:
    prompt_diff: int  # worker's prompt tokens minus the gateway's
    cached_diff: int | None  # worker's cached tokens minus the index's prediction (None: not reported)
    cached_tolerance: int  # one worker block: a smaller difference is rounding, not drift


@dataclass(slots=True)
class WorkerFidelity:
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=WINDOW))
    mis_keyed: bool = False
    prompt_mismatches: int = 0  # all time
    cached_mismatches: int = 0  # all time
    example: str = ""

    def share_wrong(self) -> float:
        wrong = sum(1 for s in self.samples if _wrong(s))
        return wrong / len(self.samples) if self.samples else 0.0

    def summary(self) -> dict[str, Any]:
        return {"mis_keyed": self.mis_keyed, "samples": len(self.samples), "share_wrong": round(self.share_wrong(), 3),
                "prompt_mismatches": self.prompt_mismatches, "cached_mismatches": self.cached_mismatches,
                "example": self.example}


def _wrong(s: Sample) -> bool:
    return s.prompt_diff != 0 or (s.cached_diff is not None and abs(s.cached_diff) >= s.cached_tolerance)


class KeyFidelity:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerFidelity] = {}

    def record(self, worker_id: str, sample: Sample) -> bool | None:
        """Add one answer; returns the new verdict when it changed (True: mis-keyed)."""
        wf = self.workers.setdefault(worker_id, WorkerFidelity())
        wf.samples.append(sample)
        if sample.prompt_diff:
            wf.prompt_mismatches += 1
            wf.example = f"worker counted {sample.prompt_diff:+d} prompt tokens"
        if sample.cached_diff is not None and abs(sample.cached_diff) >= sample.cached_tolerance:
            wf.cached_mismatches += 1
            wf.example = wf.example or f"worker reported {sample.cached_diff:+d} cached tokens vs the index"
        # A prompt counted differently is a different tokenizer or template at once; cached
        # tokens alone also drift with event lag (a burst sharing a first block), so they
        # need a whole window to convict.
        prompt_wrong = any(s.prompt_diff for s in wf.samples)
        if len(wf.samples) < (MIN_SAMPLES if prompt_wrong else WINDOW):
            return None
        share = wf.share_wrong()
        if not wf.mis_keyed and share >= MISKEYED_SHARE:
            wf.mis_keyed = True
            log.error("worker %s looks mis-keyed: %.0f%% of its last %d answers disagree with the gateway's keys "
                      "(%s); check that it serves the same model folder, tokenizer and chat template",
                      worker_id, 100 * share, len(wf.samples), wf.example)
            return True
        if wf.mis_keyed and share <= CLEAR_SHARE:
            wf.mis_keyed = False
            log.warning("worker %s: its answers agree with the gateway's keys again", worker_id)
            return False
        return None

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def summary(self, worker_id: str) -> dict[str, Any] | None:
        wf = self.workers.get(worker_id)
        return wf.summary() if wf is not None else None
