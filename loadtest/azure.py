"""Azure LLM inference traces (2023/2024): `TIMESTAMP,ContextTokens,GeneratedTokens`.

The file gives arrival times and lengths only, so prefix structure comes from the
seeded `SharingModel` (loadtest/sharing.py, documented there); pass
`sharing=None` for all-unique prompts.
"""
from __future__ import annotations

import csv
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from .sharing import DEFAULT_SHARING, SharingModel, trace_from_lengths
from .trace import Trace, TraceError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _parse_ts(s: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, no zone; fromisoformat
    # (3.11+) takes any number of digits. Only differences are used, so naive is fine.
    return datetime.fromisoformat(s.strip()).timestamp()


def parse_azure(
    rows: Iterable[str], *, name: str = "azure", source: str = "", sharing: SharingModel | None = DEFAULT_SHARING
) -> Trace:
    reader = csv.reader(rows)
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(f"{source or name}: empty file") from None
    cols = [h.strip() for h in header]
    try:
        ix = [cols.index(c) for c in AZURE_COLUMNS]
    except ValueError:
        raise TraceError(f"{source or name}: header must name {', '.join(AZURE_COLUMNS)}; got {cols}") from None
    ts: list[float] = []
    ins: list[int] = []
    outs: list[int] = []
    for lineno, row in enumerate(reader, 2):
        if not row or not "".join(row).strip():
            continue
        try:
            t = _parse_ts(row[ix[0]])
            i = int(row[ix[1]])
            o = int(row[ix[2]])
        except (ValueError, IndexError) as e:
            raise TraceError(f"{source or name}:{lineno}: bad row {row!r} ({e})") from None
        if i <= 0 or o < 0:
            raise TraceError(f"{source or name}:{lineno}: ContextTokens must be > 0, GeneratedTokens >= 0")
        if ts and t < ts[-1]:
            raise TraceError(f"{source or name}:{lineno}: TIMESTAMP goes back in time")
        ts.append(t)
        ins.append(i)
        outs.append(o)
    return trace_from_lengths(name, source, ts, ins, outs, None, sharing)


def load_azure(path: str | Path, *, sharing: SharingModel | None = DEFAULT_SHARING) -> Trace:
    p = Path(path)
    try:
        with p.open(newline="") as f:
            return parse_azure(f, name=p.stem, source=str(p), sharing=sharing)
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror or e}") from None
