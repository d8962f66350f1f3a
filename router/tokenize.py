"""Prompt tokenization with the model's own Hugging Face tokenizer and chat template.

Loaded offline from a local folder laid out as a real model's (tokenizer.json +
tokenizer_config.json), with `PreTrainedTokenizerFast` so the gateway never imports
torch. A conversation resends its history every turn, so rendered text is split at
added-token boundaries (where BPE cannot merge across) and each segment's ids are
cached in a bounded LRU: old turns are dict hits. Long uncached text is encoded in a
worker thread (`encode_batch` releases the GIL). Details: docs/gateway.md.
"""
from __future__ import annotations

import re
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    """A prompt the tokenizer or template cannot handle (→ 400)."""


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0


class SegmentCache:
    """Bounded LRU: text segment → token ids. Bounded by entries and by total tokens."""

    __slots__ = ("_d", "max_entries", "max_tokens", "tokens", "stats")

    def __init__(self, max_entries: int = 65536, max_tokens: int = 8_000_000) -> None:
        self._d: OrderedDict[str, array[int]] = OrderedDict()
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.tokens = 0
        self.stats = CacheStats()

    def get(self, seg: str) -> array[int] | None:
        ids = self._d.get(seg)
        if ids is not None:
            self._d.move_to_end(seg)
        return ids

    def put(self, seg: str, ids: array[int]) -> None:
        n = len(ids)
        if n > self.max_tokens // 4 or seg in self._d:
            return
        self._d[seg] = ids
        self.tokens += n
        while len(self._d) > self.max_entries or self.tokens > self.max_tokens:
            _, old = self._d.popitem(last=False)
            self.tokens -= len(old)
            self.stats.evictions += 1

    def __len__(self) -> int:
        return len(self._d)


def _ids(seq: Sequence[int]) -> array[int]:
    return array("I", seq)


class Tokenizer:
    """One model's tokenizer + chat template + prefix cache. Not thread-safe for `put`:
    the cache is touched on the event loop only; worker threads only run `encode_batch`."""

    def __init__(
        self,
        folder: str | Path,
        *,
        cache_entries: int = 65536,
        cache_tokens: int = 8_000_000,
        thread_min_chars: int = 4_000,
    ) -> None:
        self.folder = Path(folder)
        self.hf = _load(self.folder)
        self.backend = self.hf.backend_tokenizer  # the Rust tokenizers.Tokenizer
        self.cache = SegmentCache(cache_entries, cache_tokens)
        self.thread_min_chars = thread_min_chars
        self.vocab_size = len(self.hf)
        self.chat_template: str | None = getattr(self.hf, "chat_template", None)
        self._split_ids: dict[str, int] = {}
        for tid, tok in self.backend.get_added_tokens_decoder().items():
            if not (tok.normalized or tok.lstrip or tok.rstrip or tok.single_word):
                self._split_ids[tok.content] = tid
        self._special_ids = {s: array("I", (tid,)) for s, tid in self._split_ids.items()}
        pattern = "|".join(re.escape(s) for s in sorted(self._split_ids, key=len, reverse=True))
        self._split = re.compile(f"({pattern})") if pattern else None
        self._pp_prefix, self._pp_suffix, self._pp_exact = self._learn_post_processor()

    # ------------------------------------------------------------------ helpers

    def _learn_post_processor(self) -> tuple[array[int], array[int], bool]:
        """What `add_special_tokens=True` adds around a text (e.g. BOS), if it is that simple."""
        probes = ["a", "hello world", "x\ny"]
        pre: list[int] | None = None
        suf: list[int] | None = None
        for p in probes:
            plain = self.backend.encode(p, add_special_tokens=False).ids
            full = self.backend.encode(p, add_special_tokens=True).ids
            for i in range(len(full) - len(plain) + 1):
                if full[i : i + len(plain)] == plain:
                    a, b = full[:i], full[i + len(plain) :]
                    break
            else:
                return _ids([]), _ids([]), False
            if pre is None:
                pre, suf = a, b
            elif (pre, suf) != (a, b):
                return _ids([]), _ids([]), False
        return _ids(pre or []), _ids(suf or []), True

    def segments(self, text: str) -> list[str]:
        """The text cut at added-token boundaries (special tokens are their own items)."""
        if self._split is None:
            return [text] if text else []
        return [s for s in self._split.split(text) if s]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        if not self.chat_template:
            raise TokenizerError(f"the tokenizer in {self.folder} has no chat template; use /v1/completions")
        try:
            out = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
            )
        except Exception as e:  # jinja raise_exception() and template errors: the user's input is at fault
            raise TokenizerError(f"chat template rejected the messages: {e}") from None
        if not isinstance(out, str):  # pragma: no cover - tokenize=False always gives text
            raise TokenizerError("chat template did not render to text")
        return out

    # ------------------------------------------------------------------ encode

    def plan(self, text: str) -> tuple[list[array[int] | str], list[str]]:
        """Split `text`, serve what the cache holds; returns (parts, segments still to encode).

        Each part is either cached ids or the segment text awaiting `finish`.
        """
        parts: list[array[int] | str] = []
        todo: list[str] = []
        get = self.cache.get
        split_ids = self._split_ids
        st = self.cache.stats
        for seg in self.segments(text):
            if seg in split_ids:
                parts.append(self._special_ids[seg])
                continue
            ids = get(seg)
            if ids is None:
                parts.append(seg)
                todo.append(seg)
                st.misses += 1
            else:
                parts.append(ids)
                st.hits += 1
                st.hit_tokens += len(ids)
        return parts, todo

    def encode_segments(self, todo: list[str]) -> list[array[int]]:
        """Encode uncached segments (GIL released: safe to run in a worker thread)."""
        encs = self.backend.encode_batch(todo, add_special_tokens=False)
        return [_ids(e.ids) for e in encs]

    def finish(
        self, parts: list[array[int] | str], todo: list[str], encoded: list[array[int]], specials: bool
    ) -> array[int]:
        """Assemble the ids, caching the newly encoded segments (event-loop side)."""
        new = dict(zip(todo, encoded, strict=False))
        put = self.cache.put
        st = self.cache.stats
        for seg, ids in new.items():
            put(seg, ids)
            st.miss_tokens += len(ids)
        out = array("I", self._pp_prefix) if specials else array("I")
        for p in parts:
            out.extend(new[p] if isinstance(p, str) else p)
        if specials:
            out.extend(self._pp_suffix)
        return out

    def needs_thread(self, todo: list[str]) -> bool:
        return sum(map(len, todo)) >= self.thread_min_chars

    def encode_text(self, text: str, add_special_tokens: bool) -> array[int]:
        """Synchronous cached encode (the thread decision is the caller's; see `Tokenization`)."""
        if add_special_tokens and not self._pp_exact:
            return _ids(self.backend.encode(text, add_special_tokens=True).ids)
        parts, todo = self.plan(text)
        encoded = self.encode_segments(todo) if todo else []
        return self.finish(parts, todo, encoded, add_special_tokens)

    def encode_uncached(self, text: str, add_special_tokens: bool) -> list[int]:
        """The reference: the whole text through the tokenizer at once (tests, explain)."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    @property
    def exact_specials(self) -> bool:
        return self._pp_exact


def _load(folder: Path) -> Any:
    """Load a tokenizer folder without importing torch (see the module docstring)."""
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer folder {folder} does not exist")
    try:
        if (folder / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        from transformers import AutoTokenizer  # imports torch if installed; only for legacy folders

        print(f"warning: {folder} has no tokenizer.json; loading through AutoTokenizer", file=sys.stderr)
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except TokenizerError:
        raise
    except Exception as e:
        raise TokenizerError(f"cannot load the tokenizer in {folder}: {e}") from None


class Tokenization:
    """Runs cached encodes for the event loop, sending long uncached text to a thread.

    Measured on a 2-core machine: encoding costs ~0.9–1.7 µs
    per token inline and the thread handoff ~0.2 ms. From ~4k characters of uncached
    text (~1.5k tokens, 1.5–2.5 ms of encode) blocking the loop would delay every other
    request by more than the handoff costs this one, so that is the threshold; cached
    segments never go to the thread.
    """

    def __init__(self, max_threads: int = 2) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="tokenize")
        self.threaded = 0

    async def encode_text(self, tok: Tokenizer, text: str, add_special_tokens: bool) -> array[int]:
        import asyncio

        if add_special_tokens and not tok.exact_specials:
            if len(text) >= tok.thread_min_chars:
                self.threaded += 1
                ids = await asyncio.get_running_loop().run_in_executor(
                    self._pool, lambda: tok.backend.encode_batch([text], add_special_tokens=True)[0].ids
                )
                return _ids(ids)
            return tok.encode_text(text, True)
        parts, todo = tok.plan(text)
        if not todo:
            encoded: list[array[int]] = []
        elif tok.needs_thread(todo):
            self.threaded += 1
            encoded = await asyncio.get_running_loop().run_in_executor(self._pool, tok.encode_segments, todo)
        else:
            encoded = tok.encode_segments(todo)
        return tok.finish(parts, todo, encoded, add_special_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
