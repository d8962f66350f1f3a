"""Generated text: incremental detokenization and stop strings.

Decoding the whole output again at every token is quadratic, and decoding tokens one by
one is wrong for tokenizers whose pieces depend on their neighbours (leading spaces, one
UTF-8 character split over byte tokens). So, as vLLM does, each token decodes a short
window `[prefix, end)` and keeps what it adds beyond `[prefix, read)`, holding back a
trailing U+FFFD (a character not complete yet).

Stop strings: only the text a new piece can complete is searched. Text that might still
turn out to be the start of a stop string is held back (longest stop - 1 characters)
until the request ends, so a client never receives part of a stop string.
"""
from __future__ import annotations

from collections.abc import Callable

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output tokens


class OutputText:
    """The text of one request's output; see the module doc."""

    __slots__ = ("text", "stopped", "_decode", "_ids", "_prefix", "_read", "_sent", "_stop", "_hold")

    def __init__(self, decode: Callable[[list[int]], str], prompt_tail: list[int], stop: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self._ids = list(prompt_tail[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._sent = 0
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stopped = False

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Take one generated token; returns the text that may be sent now. Without
        `check_stop` (a request short of its min_tokens) the new text ends nothing; a stop
        string it began may still be found once checking resumes."""
        self._ids.append(token_id)
        piece = self._piece()
        if piece:
            start = max(0, len(self.text) - self._hold)
            self.text += piece
            if self._stop and check_stop:
                self._cut_at_stop(start)
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The request ended: whatever was held back."""
        return self._release(final=True)

    def _piece(self) -> str:
        ids = self._ids
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return after[len(before) :]

    def _cut_at_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out
