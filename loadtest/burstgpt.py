"""BurstGPT traces (HPMLL/BurstGPT): `Timestamp,Model,Request tokens,Response tokens,
Total tokens,Log Type` and, from v3 on, `Session ID,Elapsed time`.

`Timestamp` is in seconds from the start of the collection. Rows with 0 request
tokens or 0 response tokens (BurstGPT's failed calls) are skipped and counted in
the trace's notes. When the file has `Session ID`, a request continues its
session's previous prompt (see loadtest/sharing.py, rule 1); other prefix structure
comes from the seeded sharing model.
"""
from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

from .sharing import DEFAULT_SHARING, SharingModel, trace_from_lengths
from .trace import Trace, TraceError

BURSTGPT_REQUIRED = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


def parse_burstgpt(
    rows: Iterable[str],
    *,
    name: str = "burstgpt",
    source: str = "",
    sharing: SharingModel | None = DEFAULT_SHARING,
    model: str | None = None,
    log_type: str | None = None,
) -> Trace:
    """Parse BurstGPT rows; `model` / `log_type` keep only matching rows (e.g. "ChatGPT",
    "Conversation log")."""
    reader = csv.reader(rows)
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise TraceError(f"{source or name}: empty file") from None
    missing = [c for c in BURSTGPT_REQUIRED if c not in header]
    if missing:
        raise TraceError(f"{source or name}: header lacks {missing}; got {header}")
    col = {c: header.index(c) for c in header}
    has_session = "Session ID" in col
    rows_out: list[tuple[float, int, int, str | None, str]] = []
    skipped_failed = skipped_filter = 0
    for lineno, row in enumerate(reader, 2):
        if not row or not "".join(row).strip():
            continue
        try:
            t = float(row[col["Timestamp"]])
            m = row[col["Model"]].strip()
            req = int(float(row[col["Request tokens"]]))
            resp = int(float(row[col["Response tokens"]]))
            lt = row[col["Log Type"]].strip()
            sess = row[col["Session ID"]].strip() if has_session else None
        except (ValueError, IndexError) as e:
            raise TraceError(f"{source or name}:{lineno}: bad row {row!r} ({e})") from None
        if req < 0 or resp < 0 or t < 0:
            raise TraceError(f"{source or name}:{lineno}: negative timestamp or token count")
        if (model is not None and m != model) or (log_type is not None and lt != log_type):
            skipped_filter += 1
            continue
        if req == 0 or resp == 0:
            skipped_failed += 1
            continue
        rows_out.append((t, req, resp, sess or None, m))
    # The published files are in time order; sort (stably) anyway so a merged file works.
    rows_out.sort(key=lambda r: r[0])
    trace = trace_from_lengths(
        name,
        source,
        [r[0] for r in rows_out],
        [r[1] for r in rows_out],
        [r[2] for r in rows_out],
        [r[3] for r in rows_out] if has_session else None,
        sharing,
        models=[r[4] for r in rows_out],
    )
    trace.notes.append(
        f"skipped {skipped_failed} failed rows (0 request or response tokens), {skipped_filter} filtered out"
    )
    return trace


def load_burstgpt(
    path: str | Path,
    *,
    sharing: SharingModel | None = DEFAULT_SHARING,
    model: str | None = None,
    log_type: str | None = None,
) -> Trace:
    p = Path(path)
    try:
        with p.open(newline="") as f:
            return parse_burstgpt(f, name=p.stem, source=str(p), sharing=sharing, model=model, log_type=log_type)
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror or e}") from None
