"""A gateway-wide budget of request-body bytes in flight: memory bounded whatever is sent.

A request holds its body, the decoded JSON, the rendered prompt and its token ids, all
proportional to the body, until it ends. Reserving the body's size before reading it
bounds their sum over every request at once; past the budget a request is refused with
a 429 (the gateway is busy), never by running out of memory.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ByteBudget:
    limit: int
    used: int = 0
    refused: int = 0

    def try_take(self, n: int) -> bool:
        if self.used + n > self.limit:
            self.refused += 1
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
