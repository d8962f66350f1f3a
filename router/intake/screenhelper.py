"""The screen helper process: `python -m router.intake.screenhelper`, measuring bodies for the
gateway (screener.py) so that their parse does not hold the gateway's event loop.

Protocol on stdin/stdout, one body at a time: in, 1 byte (1: chat) + 8-byte little-endian
length + the body; out, 4-byte little-endian length + msgpack of `[model, chars, ids,
messages]` (screen.PromptSize) or nil. It ends at end of input.
"""
from __future__ import annotations

import sys
from typing import BinaryIO

import msgspec

from router.intake.screen import measure

_enc = msgspec.msgpack.Encoder()


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    while True:
        head = inp.read(9)
        if len(head) < 9:
            return
        n = int.from_bytes(head[1:], "little")
        body = inp.read(n)
        if len(body) < n:
            return
        size = measure(body, head[0] == 1)
        data = _enc.encode(None if size is None else [size.model, size.chars, size.ids, size.messages])
        out.write(len(data).to_bytes(4, "little") + data)
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
