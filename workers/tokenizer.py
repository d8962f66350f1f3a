"""The simulated worker's tokenizer: the model's Hugging Face tokenizer folder, applied as
the gateway applies it (router/intake/tokenize.py, met on the wire only), so a client or a peer
router that sends text or chat to a simulated fleet gets the gateway's token ids, hence
the same block keys and token counts.

Loaded with `PreTrainedTokenizerFast` from tokenizer.json: `AutoTokenizer` imports torch
whenever torch is installed, and a simulated worker must never import torch. Generated
text is a fixed filler sentence in that vocabulary, detokenized once, piece by piece.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.errors import BadRequest

FILLER_TEXT = "The quick brown fox jumps over the lazy dog. "


class TokenizerError(ValueError):
    """A tokenizer folder that cannot be loaded (missing, no tokenizer.json, unreadable)."""


class SimTokenizer:
    """Text → ids (completions), messages → ids (chat template), ids → text, filler output."""

    # The simulated engine never looks an id up, and a router may key prompts with a larger
    # vocabulary than the one bundled here: any u32 id is accepted in a token-id prompt.
    max_token_id: int = 2**32 - 1

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.hf = _load(self.folder)
        self._backend = self.hf.backend_tokenizer
        self._filler_ids, self._filler_pieces = self._filler()

    def encode(self, text: str) -> list[int]:
        """A completion prompt: with the special tokens the post-processor adds (e.g. BOS)."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=True).ids
        return ids

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the chat template with the generation prompt, then encode without
        post-processor tokens: the template writes every special token itself."""
        if not getattr(self.hf, "chat_template", None):
            raise BadRequest(
                f"the tokenizer in {self.folder} has no chat template; use /v1/completions", param="messages"
            )
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raise_exception() and template errors: the messages are at fault
            raise BadRequest(f"chat template rejected the messages: {e}", param="messages") from None
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.hf.decode(ids)
        return text

    def filler(self, start: int, n: int) -> tuple[list[int], str]:
        """Output tokens `start .. start+n` of a simulated completion and their text."""
        if n <= 0:
            return [], ""
        ids, pieces = self._filler_ids, self._filler_pieces
        size = len(ids)
        idx = [(start + i) % size for i in range(n)]
        return [ids[i] for i in idx], "".join(pieces[i] for i in idx)

    def _filler(self) -> tuple[list[int], list[str]]:
        """The filler's ids and the text each adds (incremental detokenization, exact for
        any tokenizer since the filler is plain ASCII)."""
        ids: list[int] = self._backend.encode(FILLER_TEXT, add_special_tokens=False).ids
        if not ids:
            raise TokenizerError(f"the tokenizer in {self.folder} encodes the filler text to nothing")
        pieces: list[str] = []
        done = ""
        for i in range(1, len(ids) + 1):
            text = self.hf.decode(ids[:i])
            pieces.append(text[len(done) :])
            done = text
        return ids, pieces


def _load(folder: Path) -> Any:
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerError(f"tokenizer folder {folder} has no tokenizer.json (a fast tokenizer is needed)")
    from transformers import PreTrainedTokenizerFast  # imported on first use: the offline simulator never needs it

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise TokenizerError(f"cannot load the tokenizer in {folder}: {e}") from None
