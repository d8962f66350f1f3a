"""The gateway's direct chat-template call renders exactly what apply_chat_template renders."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from router.intake.tokenize import Tokenizer

ASSETS = Path(__file__).resolve().parents[2] / "configs/assets"
PIECES = ["hello", " ", "\n", "{{ x }}", "{% if %}", "<|im_start|>", "<|eot_id|>", "ünï", "'q'", '"d"', "\t", "  a  "]


@pytest.mark.parametrize("folder", ["tiny-tokenizer", "tiny-llama"])
def test_plain_render_equals_apply_chat_template(folder: str) -> None:
    tok = Tokenizer(ASSETS / folder)
    assert tok._render_plain is not None  # the bundled templates take the direct path
    rng = random.Random(5)
    for _ in range(300):
        msgs = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": "".join(rng.choice(PIECES) for _ in range(rng.randrange(6)))})
        for i in range(rng.randrange(1, 6)):
            role = "user" if i % 2 == 0 else "assistant"
            msgs.append({"role": role, "content": "".join(rng.choice(PIECES) for _ in range(rng.randrange(8)))})
        agp = rng.random() < 0.8
        assert tok.render_chat(msgs, add_generation_prompt=agp) == tok.hf.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=agp)


def test_messages_with_more_than_role_and_content_take_the_full_path() -> None:
    tok = Tokenizer(ASSETS / "tiny-tokenizer")
    msgs = [{"role": "user", "content": "hi", "name": "bob"}]
    assert tok.render_chat(msgs) == tok.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
