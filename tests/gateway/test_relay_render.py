"""The per-request chunk renderer writes exactly what chat_chunk / comp_chunk write, and the
token translator what the renderer would write for our worker's token events."""
from __future__ import annotations

import random

from router.api.responses import chat_chunk, chunk_renderer, comp_chunk, token_translator

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


def _worker_token_event(model: str, text: str) -> bytes:
    """A token event exactly as our worker writes it (workers/web/stream.py's templates)."""
    from workers.web.common import ENCODER
    from workers.web.stream import GenResponse

    resp = GenResponse.__new__(GenResponse)  # only the templates are used: no generation behind it
    resp.chat, resp.model = False, model
    _, tok_pre, tok_post = resp._templates("cmpl-7f3a", 1796123000)
    return tok_pre + ENCODER.encode(text) + tok_post


def test_token_translator_copies_the_workers_text_as_the_renderer_would() -> None:
    rng = random.Random(5)
    quoted = 0
    for chat in (True, False):
        for model in ("meta-llama/Llama-3.1-8B-Instruct", 'odd "name",\\'):
            render = chunk_renderer(chat, "chatcmpl-abc", 1796123444, model)
            translate = token_translator(chat, "chatcmpl-abc", 1796123444, model)
            for _ in range(300):
                text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(4)))
                got = translate(_worker_token_event(model, text))
                if '"' in text:  # an escaped quote: left to the decoding path
                    assert got is None
                    quoted += 1
                elif text == "":
                    assert got == b""
                else:
                    assert got == render(text, None)
    assert quoted > 50


def test_token_translator_leaves_every_other_event_to_the_decoder() -> None:
    translate = token_translator(True, "chatcmpl-abc", 1796123444, "m")
    pre = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m"'
    others = [
        pre + b',"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}\n\n',
        pre + b',"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n',
        b'data: {"error":{"message":"x","type":"internal_error","param":null,"code":null}}\n\n',
        b"data: [DONE]\n\n",
        # two choices: the span between the markers is not one string
        pre + b',"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null},'
              b'{"index":1,"text":"b","logprobs":null,"finish_reason":null}]}\n\n',
        pre + b',"choices":[{"index":0,"text":7,"logprobs":null,"finish_reason":null}]}\n\n',
        pre + b',"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n',
    ]
    for ev in others:
        assert translate(ev) is None, ev
