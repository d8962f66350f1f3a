"""Build the test tokenizers: tests/data/tokenizers/{llama3-style,qwen2.5-style}/.

tests/gateway/test_tokenize.py proves cached == uncached tokenization on tokenizers built the
way real model tokenizers are, without shipping (or downloading) a model's files. So
this script trains two small byte-level BPE tokenizers with `tokenizers` whose every
structural part copies a real one; only the vocabulary (4,096 ids) is small:

llama3-style (as Meta Llama 3.1's tokenizer.json):
  pre-tokenizer  Split on Llama 3's regex (digits in runs of 1-3), then ByteLevel
                 without its own regex;
  post-processor ByteLevel + TemplateProcessing: `<|begin_of_text|>` before the text,
                 which is what `add_special_tokens=True` adds;
  added tokens   Llama 3.1's 256 special tokens (`<|begin_of_text|>`, `<|eot_id|>`,
                 `<|start_header_id|>`, `<|python_tag|>`, `<|reserved_special_token_N|>`,
                 ...), in its order, after the BPE vocabulary;
  chat template  Llama 3.1's layout: BOS, a system header that always carries the
                 knowledge/today dates, `<|start_header_id|>role<|end_header_id|>\\n\\n`
                 + trimmed content + `<|eot_id|>` per message.
qwen2.5-style (as Qwen2.5's tokenizer.json):
  normalizer     NFC;
  pre-tokenizer  Split on Qwen2's regex (single digits), then ByteLevel without regex;
  post-processor ByteLevel only (no BOS);
  added tokens   Qwen2.5's 22, in its order: 14 special (`<|endoftext|>`, `<|im_start|>`,
                 `<|im_end|>`, vision/box/quad markers) and 8 non-special ones
                 (`<tool_call>`, `</tool_call>`, fill-in-the-middle and repo markers);
  chat template  ChatML with a default system message when the first is not one, and
                 tool results folded into a user turn, as Qwen2.5's (without its tools
                 preamble).

Corpus: this interpreter's standard library, `*.py` at its top level and its `*.txt`
files (tests excluded), sorted and capped: text that ships with every Python, so the
build needs nothing from outside. Training is deterministic for a given interpreter;
another Python version has other stdlib text and gives another (equally valid) vocab.
Both folders are committed; rerun only to change the recipe:

    .venv/bin/python scripts/build_test_tokenizers.py [--out tests/data/tokenizers]

Each folder is what `PreTrainedTokenizerFast.save_pretrained` writes, made portable:
tokenizer.json + tokenizer_config.json with the chat template embedded (the separate
chat_template.jinja that transformers 5 writes is removed, and the class is named
PreTrainedTokenizerFast, so transformers 4.x loads the folder unchanged).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 4096  # ids in all, added tokens included

# Llama 3's pre-tokenizer split (tokenizer.json of Meta-Llama-3/3.1).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen2 / Qwen2.5's: the same but one digit per piece.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _llama31_specials() -> list[str]:
    """Llama 3.1's 256 special tokens, ids 128000.. in order."""
    named = {
        0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>",
    }
    out, reserved = [], 0
    for i in range(256):
        if i in named:
            out.append(named[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


QWEN25_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
]
QWEN25_PLAIN = [  # added tokens that are not "special" (decode keeps them), as in Qwen2.5
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- set date_string = '26 Jul 2024' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


@dataclass
class Recipe:
    name: str
    pattern: str
    special: list[str]
    plain: list[str]
    template: str
    nfc: bool
    bos: str | None  # prepended by the post-processor (add_special_tokens=True)
    config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json fields


RECIPES = [
    Recipe("llama3-style", LLAMA3_PATTERN, _llama31_specials(), [], LLAMA3_TEMPLATE, nfc=False,
           bos="<|begin_of_text|>",
           # Meta's file says clean_up_tokenization_spaces: true, which transformers 5 ignores for BPE
           # (with a warning); false is what every release then does.
           config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "model_max_length": 131072,
                   "clean_up_tokenization_spaces": False}),
    Recipe("qwen2.5-style", QWEN2_PATTERN, QWEN25_SPECIAL, QWEN25_PLAIN, QWEN25_TEMPLATE, nfc=True, bos=None,
           config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "additional_special_tokens": QWEN25_SPECIAL[1:], "errors": "replace",
                   "split_special_tokens": False, "model_max_length": 131072,
                   "clean_up_tokenization_spaces": False}),
]


def corpus_files(max_files: int) -> list[Path]:
    """The stdlib's top-level modules, then its .txt files outside tests; sorted, capped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    files += sorted(p for p in stdlib.glob("**/*.txt")
                    if p.is_file() and not {"test", "tests", "site-packages"} & set(p.relative_to(stdlib).parts))
    return files[:max_files]


def read_texts(files: list[Path]) -> Iterator[str]:
    for p in files:
        try:
            yield p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def build_one(r: Recipe, out: Path, files: list[Path]) -> Path:
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=r.name.startswith("llama")))  # Llama 3 sets ignore_merges
    if r.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=not r.nfc, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(r.special) - len(r.plain),
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_texts(files), trainer=trainer)
    # After the BPE vocabulary, as in the real files (ids 128000.. / 151643..).
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in r.special])
    if r.plain:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in r.plain])
    if r.bos is not None:
        bos_id = tok.token_to_id(r.bos)
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(single=f"{r.bos} $A", pair=f"{r.bos} $A {r.bos} $B:1",
                                          special_tokens=[(r.bos, bos_id)]),
        ])
        byte_level = {"add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    else:
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    # decoders.ByteLevel() takes no options; the real files still spell them out (no effect on decoding).
    spec = json.loads(tok.to_str())
    spec["decoder"] = {"type": "ByteLevel", **byte_level}
    tok = Tokenizer.from_str(json.dumps(spec))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"{r.name}: vocab {tok.get_vocab_size()}, expected {VOCAB_SIZE} (corpus too small?)")

    kw = {k: v for k, v in r.config.items() if k in ("bos_token", "eos_token", "pad_token", "model_max_length",
                                                      "clean_up_tokenization_spaces")}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=None, **kw)
    fast.chat_template = r.template
    dst = out / r.name
    dst.mkdir(parents=True, exist_ok=True)
    for old in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (dst / old).unlink(missing_ok=True)
    fast.save_pretrained(str(dst))
    _portable_config(dst, r)
    return dst


def _portable_config(dst: Path, r: Recipe) -> None:
    """One tokenizer_config.json that every transformers release reads the same way."""
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("backend", "added_tokens_decoder", "extra_special_tokens"):
        cfg.pop(k, None)  # transformers 5's own keys; the added tokens are in tokenizer.json
    cfg.update(r.config)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = r.template
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    (dst / "special_tokens_map.json").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/tokenizers")
    ap.add_argument("--max-files", type=int, default=300)
    a = ap.parse_args(argv)
    files = corpus_files(a.max_files)
    if not files:
        raise SystemExit("no corpus files found in the standard library")
    print(f"corpus: {len(files)} stdlib files, {sum(p.stat().st_size for p in files):,} bytes "
          f"(Python {sys.version.split()[0]})", file=sys.stderr)
    for r in RECIPES:
        dst = build_one(r, a.out, files)
        for p in sorted(dst.iterdir()):
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            print(f"{dst.name}/{p.name}: {p.stat().st_size:,} bytes, sha256 {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
