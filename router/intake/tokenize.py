"""Prompt tokenization with the model's own Hugging Face tokenizer and chat template.

Loaded offline from a local folder laid out as a real model's (tokenizer.json +
tokenizer_config.json), with `PreTrainedTokenizerFast` so the gateway never imports
torch. A conversation resends its history every turn, so rendered text is split at
added-token boundaries (where BPE cannot merge across) and each segment's ids are
cached in a bounded LRU: old turns are dict hits. Long uncached text is encoded in a
worker thread (`encode_batch` releases the GIL). Details: docs/gateway.md.
"""
from __future__ import annotations

import asyncio
import re
import sys
import threading
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


CacheKey = tuple[str, str]  # (scope, segment): one tenant never hits another's text


class SegmentCache:
    """Bounded LRU: (scope, text segment) → token ids. Bounded by entries and by total tokens.

    Keyed per tenant scope: a shared cache would let one tenant learn, from timing or
    the hit counters, whether another sent a given text."""

    __slots__ = ("_d", "max_entries", "max_tokens", "tokens", "stats")

    def __init__(self, max_entries: int = 65536, max_tokens: int = 8_000_000) -> None:
        self._d: OrderedDict[CacheKey, array[int]] = OrderedDict()
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.tokens = 0
        self.stats = CacheStats()

    def get(self, key: CacheKey) -> array[int] | None:
        ids = self._d.get(key)
        if ids is not None:
            self._d.move_to_end(key)
        return ids

    def put(self, key: CacheKey, ids: array[int]) -> None:
        n = len(ids)
        if n > self.max_tokens // 4 or key in self._d:
            return
        self._d[key] = ids
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
    """One model's tokenizer + chat template + prefix cache. The cache is guarded by a
    lock: short inputs are tokenized on the event loop, long ones wholly in a thread."""

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
        # The same ids without character offsets (tokenizers >= 0.21): ~25% less per encode.
        self._encode_batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        self.cache = SegmentCache(cache_entries, cache_tokens)
        self._lock = threading.Lock()
        self.thread_min_chars = thread_min_chars
        self.vocab_size = len(self.hf)
        self.chat_template: str | None = getattr(self.hf, "chat_template", None)
        self._render_plain = self._plain_renderer()
        self._split_ids: dict[str, int] = {}
        for tid, tok in self.backend.get_added_tokens_decoder().items():
            if not (tok.normalized or tok.lstrip or tok.rstrip or tok.single_word):
                self._split_ids[tok.content] = tid
        self._special_ids = {s: array("I", (tid,)) for s, tid in self._split_ids.items()}
        pattern = "|".join(re.escape(s) for s in sorted(self._split_ids, key=len, reverse=True))
        self._split = re.compile(f"({pattern})") if pattern else None
        self._pp_prefix, self._pp_suffix, self._pp_exact = self._learn_post_processor()
        # No token spans more characters than its string in the vocabulary (byte-level and
        # sentencepiece pieces are at least as long as what they decode to), so a text of
        # more than `n * max_token_chars` characters has more than n tokens: refused unread.
        self.max_token_chars = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

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

    def _plain_renderer(self) -> Any:
        """The compiled chat template, called as `apply_chat_template` calls it, for plain
        conversations (each message exactly {role, content} strings; no tools or extra
        variables): transformers' own wrapper copies and checks every message and costs
        several times the rendering itself. Used only if it renders the probe
        conversations exactly as `apply_chat_template` does; None otherwise."""
        if not isinstance(self.chat_template, str) or not self.chat_template:
            return None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.chat_template)
            specials = {k: v for k, v in self.hf.special_tokens_map.items() if type(v) is str}
            if len(specials) != len(self.hf.special_tokens_map):
                return None
        except Exception:
            return None

        def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            out: str = compiled.render(messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                                       tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                                       **specials)
            return out

        probes = [
            [{"role": "user", "content": "hello"}],
            [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there\nhow  are you? "}],
            [{"role": "system", "content": ""}, {"role": "user", "content": "a"},
             {"role": "assistant", "content": " b\n"}, {"role": "user", "content": "{{ c }} <tag> 'q' \"d\""}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        ]
        try:
            for msgs in probes:
                for agp in (True, False):
                    want = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
                    if render(msgs, agp) != want:
                        return None
        except Exception:
            return None
        return render

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        if not self.chat_template:
            raise TokenizerError(f"the tokenizer in {self.folder} has no chat template; use /v1/completions")
        if self._render_plain is not None and not kw and all(
                len(m) == 2 and type(m.get("role")) is str and type(m.get("content")) is str for m in messages):
            try:
                out: str = self._render_plain(messages, add_generation_prompt)
                return out
            except Exception:
                pass  # the template's own error: apply_chat_template below words it
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

    def plan(self, text: str, scope: str = "") -> tuple[list[array[int] | str], list[str]]:
        """Split `text`, serve what `scope`'s cache holds; returns (parts, segments still to
        encode). Each part is either cached ids or the segment text awaiting `finish`."""
        segments = self.segments(text)
        with self._lock:
            return self._plan(segments, scope)

    def _plan(self, segments: list[str], scope: str) -> tuple[list[array[int] | str], list[str]]:
        parts: list[array[int] | str] = []
        todo: list[str] = []
        get = self.cache.get
        split_ids = self._split_ids
        st = self.cache.stats
        for seg in segments:
            if seg in split_ids:
                parts.append(self._special_ids[seg])
                continue
            ids = get((scope, seg))
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
        encs = self._encode_batch(todo, add_special_tokens=False)
        return [_ids(e.ids) for e in encs]

    def finish(
        self, parts: list[array[int] | str], todo: list[str], encoded: list[array[int]], specials: bool,
        scope: str = "",
    ) -> array[int]:
        """Assemble the ids, caching the newly encoded segments under `scope`."""
        new = dict(zip(todo, encoded, strict=True))
        with self._lock:
            put = self.cache.put
            st = self.cache.stats
            for seg, ids in new.items():
                put((scope, seg), ids)
                st.miss_tokens += len(ids)
        out = array("I", self._pp_prefix) if specials else array("I")
        for p in parts:
            out.extend(new[p] if isinstance(p, str) else p)
        if specials:
            out.extend(self._pp_suffix)
        return out

    def needs_thread(self, todo: list[str]) -> bool:
        return sum(map(len, todo)) >= self.thread_min_chars

    def encode_text(self, text: str, add_special_tokens: bool, scope: str = "") -> array[int]:
        """Synchronous cached encode (where it runs is the caller's call; see `Tokenization`)."""
        if add_special_tokens and not self._pp_exact:
            return _ids(self.backend.encode(text, add_special_tokens=True).ids)
        parts, todo = self.plan(text, scope)
        encoded = self.encode_segments(todo) if todo else []
        return self.finish(parts, todo, encoded, add_special_tokens, scope)

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
    """Runs tokenizations for the event loop without ever blocking it for long.

    Measured on a 2-core machine: encoding costs ~0.9–1.7 µs per token inline and the
    thread handoff ~0.2 ms. So text is split and looked up in the cache on the loop (a
    resent conversation is mostly hits, and stays off the pool), and only its uncached
    segments go to a thread from ~4k characters (`Tokenizer.thread_min_chars`); text
    over `inline_max_chars` (a flood of special tokens splits into that many segments)
    goes to the pool whole, chat rendering included. A tenant holds at most
    `per_tenant` of the pool's threads at a time: one tenant's huge prompts cannot
    starve the others.
    """

    def __init__(self, max_threads: int = 2, per_tenant: int | None = None, inline_max_chars: int = 65_536) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="tokenize")
        self.per_tenant = per_tenant or max(1, max_threads - 1)
        self.inline_max_chars = inline_max_chars
        self._slots: dict[str, asyncio.Semaphore] = {}
        self.threaded = 0

    async def encode_text(self, tok: Tokenizer, text: str, add_special_tokens: bool, scope: str = "") -> array[int]:
        if len(text) > self.inline_max_chars:
            ids: array[int] = await self._threaded(scope, tok.encode_text, text, add_special_tokens, scope)
            return ids
        if add_special_tokens and not tok.exact_specials:
            if len(text) < tok.thread_min_chars:
                return tok.encode_text(text, True, scope)
            ids = await self._threaded(scope, tok.encode_text, text, True, scope)
            return ids
        parts, todo = tok.plan(text, scope)
        if not todo:
            encoded: list[array[int]] = []
        elif tok.needs_thread(todo):
            encoded = await self._threaded(scope, tok.encode_segments, todo)
        else:
            encoded = tok.encode_segments(todo)
        return tok.finish(parts, todo, encoded, add_special_tokens, scope)

    async def encode_chat(self, tok: Tokenizer, messages: list[dict[str, Any]], extra: dict[str, Any],
                          scope: str = "") -> array[int]:
        """Render with the chat template and encode; rendering too goes off the loop for
        messages over `inline_max_chars`."""
        chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        if chars > self.inline_max_chars:
            ids: array[int] = await self._threaded(
                scope, lambda: tok.encode_text(tok.render_chat(messages, **extra), False, scope))
            return ids
        return await self.encode_text(tok, tok.render_chat(messages, **extra), False, scope)

    async def _threaded(self, scope: str, fn: Any, *args: Any) -> Any:
        sem = self._slots.get(scope)
        if sem is None:
            sem = self._slots[scope] = asyncio.Semaphore(self.per_tenant)
        async with sem:  # one per tenant scope: configured tenants, a bounded set
            self.threaded += 1
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
