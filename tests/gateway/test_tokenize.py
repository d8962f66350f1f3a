"""Prefix-tokenization cache: cached == uncached, on the bundled tokenizer and on tokenizers
built like real ones (tests/data/tokenizers/: Llama-3-style and Qwen2.5-style, made by
scripts/build_test_tokenizers.py)."""
from __future__ import annotations

import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from router.intake.tokenize import SegmentCache, Tokenizer, TokenizerError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/assets/tiny-tokenizer"
REAL_LIKE = Path(__file__).resolve().parents[1] / "data" / "tokenizers"

_WORDS = (
    "the quick brown fox jumps over lazy dogs def class return import yield async await "
    "naïve café 東京 данные 🙂 \t tabs  double  spaces\n\nnewlines x=1+2 <tag> </tag> {json: [1, 2]} "
    "ünïcödé 12345 3.14159 'quotes' \"dq\" ```code``` -- __init__ self.value  \r\n"
).split(" ")


def _text(rng: random.Random, n: int, specials: list[str]) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.03 and specials:
            out.append(rng.choice(specials))  # a user typing a special token's text
        elif r < 0.1:
            out.append(rng.choice([" ", "\n", "  ", "\n\n", "\t", ""]))
        else:
            out.append(rng.choice(_WORDS))
    sep = rng.choice([" ", "", "\n"])
    return sep.join(out) + rng.choice(["", " ", "\n", "  "])


def _conversations(rng: random.Random, count: int, specials: list[str]) -> list[list[dict[str, str]]]:
    convs = []
    for _ in range(count):
        msgs = []
        if rng.random() < 0.7:
            msgs.append({"role": "system", "content": _text(rng, rng.randint(0, 60), specials)})
        for turn in range(rng.randint(1, 6)):
            msgs.append({"role": "user", "content": _text(rng, rng.randint(0, 80), specials)})
            if turn < 5 and rng.random() < 0.8:
                msgs.append({"role": "assistant", "content": _text(rng, rng.randint(1, 80), specials)})
        if msgs[-1]["role"] != "user":
            msgs.append({"role": "user", "content": _text(rng, 5, specials)})
        convs.append(msgs)
    return convs


def _check_tokenizer(tok: Tokenizer, n_convs: int, seed: int) -> None:
    rng = random.Random(seed)
    specials = list(tok._split_ids)[:8]
    for msgs in _conversations(rng, n_convs, specials):
        # Each conversation grows turn by turn, as a client resends it: later turns hit the cache.
        for end in range(1, len(msgs) + 1):
            part = msgs[:end]
            if part[-1]["role"] != "user":
                continue
            text = tok.render_chat(part)
            ref = tok.encode_uncached(text, add_special_tokens=False)
            assert list(tok.encode_text(text, add_special_tokens=False)) == ref
            assert list(tok.encode_text(text, add_special_tokens=False)) == ref  # now fully cached
            hf = tok.hf.apply_chat_template(part, tokenize=True, add_generation_prompt=True, return_dict=False)
            assert list(hf) == ref
        prompt = _text(rng, rng.randint(0, 120), specials)
        ref = tok.encode_uncached(prompt, add_special_tokens=True)
        assert list(tok.encode_text(prompt, add_special_tokens=True)) == ref
        assert list(tok.encode_text(prompt, add_special_tokens=True)) == ref


def test_tiny_tokenizer_loads_and_has_chatml() -> None:
    tok = Tokenizer(TINY)
    assert tok.vocab_size == 8192
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert set(tok._split_ids) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    size = sum(p.stat().st_size for p in TINY.iterdir())
    assert 200_000 < size < 1_000_000


def test_cached_equals_uncached_tiny() -> None:
    _check_tokenizer(Tokenizer(TINY), 40, seed=1)


def test_cache_serves_old_turns() -> None:
    tok = Tokenizer(TINY)
    history = [{"role": "system", "content": "You are terse. " * 200}]
    for i in range(5):
        history.append({"role": "user", "content": f"question {i} " * 50})
        tok.encode_text(tok.render_chat(history), False)
        history.append({"role": "assistant", "content": f"answer {i}"})
    st = tok.cache.stats
    assert st.hits > st.misses  # every turn after the first re-tokenizes only its new message
    assert st.hit_tokens > 5 * st.miss_tokens / 2


def test_segment_cache_bounds() -> None:
    from array import array

    c = SegmentCache(max_entries=3, max_tokens=100)
    for i in range(10):
        c.put(f"s{i}", array("I", [i] * 10))
    assert len(c) == 3 and c.tokens == 30 and c.stats.evictions == 7
    c.put("big", array("I", [1] * 90))  # larger than a quarter of the budget: never cached
    assert c.get("big") is None
    assert c.get("s9") is not None


def test_bad_template_input_is_a_tokenizer_error() -> None:
    tok = Tokenizer(TINY)
    with pytest.raises(TokenizerError):
        tok.render_chat([{"role": "user"}])  # no content: the template fails
    with pytest.raises(TokenizerError):
        Tokenizer(ROOT / "no-such-folder")


async def test_long_encode_runs_off_loop() -> None:
    from router.intake.tokenize import Tokenization

    tok = Tokenizer(TINY, thread_min_chars=1000)
    service = Tokenization(max_threads=1)
    try:
        text = "word " * 5000
        ids = await service.encode_text(tok, text, False)
        assert list(ids) == tok.encode_uncached(text, False)
        assert service.threaded == 1
        await service.encode_text(tok, text, False)  # cached now: no thread
        assert service.threaded == 1
    finally:
        service.close()


# name: (chat rendering of [system "Be terse.", user "Hi"], specials that must stay single ids,
#        what add_special_tokens=True puts before the text)
REAL_LIKE_CASES = {
    "llama3-style": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nBe terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>",
         "<|reserved_special_token_247|>"],
        ["<|begin_of_text|>"],
    ),
    "qwen2.5-style": (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|video_pad|>", "<tool_call>", "<|file_sep|>"],
        [],
    ),
}


@pytest.mark.parametrize("name", sorted(REAL_LIKE_CASES))
def test_real_like_tokenizers_have_the_real_structure(name: str) -> None:
    folder = REAL_LIKE / name
    tok = Tokenizer(folder)
    chat, specials, prefix = REAL_LIKE_CASES[name]
    assert tok.vocab_size == 4096
    assert tok.render_chat([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]) == chat
    base = tok.backend.get_vocab_size(with_added_tokens=False)
    for s in specials:  # one id each, after the BPE vocabulary, and a split point of the cache
        ids = tok.encode_uncached(s, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] >= base and s in tok._split_ids, s
    # add_special_tokens=True: Llama's BOS from the post-processor, nothing for Qwen; learned exactly
    assert tok.exact_specials and [tok.backend.id_to_token(i) for i in tok._pp_prefix] == prefix
    assert list(tok.encode_text("hello", True)) == tok.encode_uncached("hello", True)
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("12345")]
    assert pieces == (["123", "45"] if name.startswith("llama") else ["1", "2", "3", "4", "5"])  # the real regexes
    nfc = tok.encode_uncached("e\u0301", False) == tok.encode_uncached("\u00e9", False)
    assert nfc == name.startswith("qwen")  # Qwen normalizes to NFC, Llama 3 has no normalizer
    assert sum(p.stat().st_size for p in folder.iterdir()) < 1_000_000


@pytest.mark.parametrize("name", sorted(REAL_LIKE_CASES))
def test_cached_equals_uncached_real_like(name: str) -> None:
    _check_tokenizer(Tokenizer(REAL_LIKE / name), 12, seed=zlib.crc32(name.encode()) % 1000)


def test_loading_a_tokenizer_never_imports_torch() -> None:
    code = (
        "import sys; from router.intake.tokenize import Tokenizer; "
        f"t = Tokenizer({str(TINY)!r}); t.encode_text(t.render_chat([{{'role':'user','content':'x'}}]), False); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
