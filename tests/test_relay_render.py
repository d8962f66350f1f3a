"""The per-request chunk renderer writes exactly what chat_chunk / comp_chunk write."""
from __future__ import annotations

import random

from router.responses import chat_chunk, chunk_renderer, comp_chunk

PIECES = ["The", " ", "", "\n", '"', "\\", "ünï", "\u2028", "</s>", "{}", "\t", "\x01", "😀"]


def test_chunk_renderer_matches_the_structs() -> None:
    rng = random.Random(3)
    for chat, ref in ((True, chat_chunk), (False, comp_chunk)):
        for model in ("meta-llama/Llama-3.1-8B-Instruct", 'odd "name"\\'):
            r = chunk_renderer(chat, "chatcmpl-abc", 1796123444, model)
            for _ in range(300):
                text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(4)))
                finish = rng.choice([None, None, "stop", "length"])
                assert r(text, finish) == ref("chatcmpl-abc", 1796123444, model, text, finish)
