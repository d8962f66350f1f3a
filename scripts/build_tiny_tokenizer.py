"""Build the bundled default tokenizer: configs/assets/tiny-tokenizer/.

Why the project makes its own: nothing can be downloaded from a model hub here, and
the gateway must load a tokenizer exactly the way it loads a user's real model folder
(`from_pretrained(folder)`). So this script trains a small byte-level BPE (vocab 8192)
with `tokenizers` on local text — the Python standard library's own .py/.txt files plus
this project's docs — wraps it in `PreTrainedTokenizerFast` with a ChatML chat template
and saves it as an ordinary Hugging Face tokenizer folder (~0.5 MiB).

The output is committed; rerun only to change the recipe:

    .venv/bin/python scripts/build_tiny_tokenizer.py [--out configs/assets/tiny-tokenizer]

The corpus is chosen deterministically (sorted paths, a fixed cap), but its content is
whatever this interpreter's stdlib holds, so a rerun on another Python may differ.
"""
from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus_files(max_files: int) -> list[Path]:
    """Stdlib top-level modules and text files, then the project's docs; sorted, capped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    files += sorted(p for p in stdlib.glob("**/*.txt") if p.is_file() and "test" not in p.parts)
    files = files[:max_files]
    for extra in ("README.md", "docs"):
        p = ROOT / extra
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(p.glob("**/*.md"))
    return files


def read_texts(files: list[Path]) -> Iterator[str]:
    for p in files:
        try:
            yield p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def _portable_config(out: Path) -> None:
    """Name the class every transformers release knows and embed the template.

    transformers 5 writes `TokenizersBackend` and a separate chat_template.jinja; 4.x
    releases read neither, so the folder would not load there unchanged.
    """
    import json

    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHATML
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build(out: Path, vocab_size: int, max_files: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    files = corpus_files(max_files)
    if not files:
        raise SystemExit("no corpus files found")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_texts(files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    _portable_config(out)
    print(f"trained on {len(files)} files; vocab {tok.get_vocab_size()}; saved to {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "configs/assets/tiny-tokenizer")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-files", type=int, default=400)
    a = ap.parse_args(argv)
    build(a.out, a.vocab_size, a.max_files)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
