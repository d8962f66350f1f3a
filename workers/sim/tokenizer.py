"""The simulated engine's tokenizer: UTF-8 bytes as token ids, a ChatML-style template.

The router always sends token ids (docs/wire.md), so a simulated worker only needs a
tokenizer for clients that talk to it directly with text. A byte tokenizer is exact,
dependency-free and deterministic: the same text always gives the same ids, hence the
same block keys. Generated text is a fixed filler sentence, one byte per token.
"""
from __future__ import annotations

IM_START = 256
IM_END = 257
_FILLER = b"The quick brown fox jumps over the lazy dog. "


class ByteTokenizer:
    max_token_id = 2**32 - 1  # accepts any u32 id from a router with a real vocabulary

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids.append(IM_START)
            ids.extend(f"{m['role']}\n{m['content']}".encode())
            ids.append(IM_END)
            ids.append(10)
        ids.append(IM_START)
        ids.extend(b"assistant\n")
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def filler_tokens(start: int, n: int) -> tuple[list[int], str]:
    """Output tokens `start .. start+n` of a simulated completion and their text."""
    f = _FILLER
    L = len(f)
    if n <= 0:
        return [], ""
    s = start % L
    raw = (f[s:] + f * (1 + n // L))[:n]
    return list(raw), raw.decode("ascii")
