"""Mooncake JSONL traces (FAST'25 release) and our gateway's recordings.

One JSON object per line: `timestamp` (ms since the first request), `input_length`,
`output_length`, `hash_ids` (one id per 512-token block, the last block possibly
partial, equal ids = reusable KV). The gateway's recorder (router/telemetry/recorder.py)
writes the same shape with salted ids, so one reader serves both; unknown extra
fields (a recording may add some) are ignored. A recording is written in completion
order, so lines are sorted by `timestamp` (stably) and the trace's notes say so.
"""
from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import msgspec

from .trace import Trace, TraceError, TraceRequest

MOONCAKE_BLOCK_TOKENS = 512


class _Line(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


class _OutLine(msgspec.Struct):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def parse_mooncake(
    lines: Iterable[bytes | str],
    *,
    name: str = "mooncake",
    source: str = "",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    strict_lengths: bool = True,
) -> Trace:
    """Parse Mooncake lines (any order); a malformed line raises TraceError naming it.

    `strict_lengths` enforces `len(hash_ids) == ceil(input_length / block_tokens)`,
    which holds on every line of the public trace; a mismatch means the file was
    written with another block size.
    """
    dec = msgspec.json.Decoder(_Line)
    recs: list[_Line] = []
    unordered = 0
    for lineno, raw in enumerate(lines, 1):
        if isinstance(raw, str):
            raw = raw.encode()
        if not raw.strip():
            continue
        try:
            rec = dec.decode(raw)
        except msgspec.ValidationError as e:
            raise TraceError(f"{source or name}:{lineno}: {e}") from None
        except msgspec.DecodeError as e:
            raise TraceError(f"{source or name}:{lineno}: not JSON ({e})") from None
        if rec.input_length <= 0 or rec.output_length < 0:
            raise TraceError(f"{source or name}:{lineno}: input_length must be > 0 and output_length >= 0")
        if strict_lengths and len(rec.hash_ids) != -(-rec.input_length // block_tokens):
            raise TraceError(
                f"{source or name}:{lineno}: {len(rec.hash_ids)} hash_ids for input_length "
                f"{rec.input_length} at {block_tokens}-token blocks (expected "
                f"{-(-rec.input_length // block_tokens)}); pass the trace's block size"
            )
        if recs and rec.timestamp < recs[-1].timestamp:
            unordered += 1
        recs.append(rec)
    notes: list[str] = []
    if unordered:
        # A gateway recording is written in completion order: replay needs arrival order.
        recs.sort(key=lambda r: r.timestamp)
        notes.append(f"{unordered} lines were out of arrival order and were sorted by timestamp")
    t0 = recs[0].timestamp if recs else 0.0
    reqs = [
        TraceRequest(
            index=i,
            arrival_s=(rec.timestamp - t0) / 1000.0,
            input_length=rec.input_length,
            # Mooncake has a few 1-token outputs; 0 would mean "no request" to an engine.
            output_length=max(1, rec.output_length),
            hash_ids=tuple(rec.hash_ids),
        )
        for i, rec in enumerate(recs)
    ]
    return Trace(name, block_tokens, reqs, source=source, sharing="trace", notes=notes)


def load_mooncake(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS, strict_lengths: bool = True) -> Trace:
    p = Path(path)
    try:
        with p.open("rb") as f:
            return parse_mooncake(
                f, name=p.stem, source=str(p), block_tokens=block_tokens, strict_lengths=strict_lengths
            )
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror or e}") from None


def dump_mooncake(trace: Trace, out: io.BufferedIOBase | io.RawIOBase | Path | str) -> int:
    """Write a trace in Mooncake format (ms timestamps); returns lines written.

    Used to save synthesised traces (Azure/BurstGPT with their sharing model,
    scenario workloads) so an HTTP replay and a simulation read the same file.
    """
    enc = msgspec.json.Encoder()
    buf = bytearray()
    for r in trace.requests:
        enc.encode_into(
            _OutLine(round(r.arrival_s * 1000), r.input_length, r.output_length, list(r.hash_ids)), buf, len(buf)
        )
        buf += b"\n"
    if isinstance(out, (str, Path)):
        Path(out).write_bytes(bytes(buf))
    else:
        out.write(bytes(buf))
    return len(trace.requests)
