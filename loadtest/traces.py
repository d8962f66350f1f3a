"""One entry point for every trace format: `load_trace(path, fmt="auto")`.

Formats: `mooncake` (JSONL, also our gateway's recordings), `azure` (CSV),
`burstgpt` (CSV). `auto` looks at the file: JSON lines → mooncake; a CSV header
with `TIMESTAMP,ContextTokens` → azure; with `Timestamp,...,Request tokens` → burstgpt.
"""
from __future__ import annotations

from pathlib import Path

from .azure import load_azure
from .burstgpt import load_burstgpt
from .mooncake import MOONCAKE_BLOCK_TOKENS, load_mooncake
from .sharing import DEFAULT_SHARING, SharingModel
from .trace import Trace, TraceError

FORMATS = ("auto", "mooncake", "azure", "burstgpt")


def detect_format(path: str | Path) -> str:
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror or e}") from None
    first = head.lstrip().split(b"\n", 1)[0].strip()
    if first.startswith(b"{"):
        return "mooncake"
    cols = [c.strip() for c in first.decode("utf-8", "replace").split(",")]
    if "TIMESTAMP" in cols and "ContextTokens" in cols:
        return "azure"
    if "Timestamp" in cols and "Request tokens" in cols:
        return "burstgpt"
    raise TraceError(
        f"{p}: unknown trace format (first line {first[:80]!r}); pass --format mooncake|azure|burstgpt"
    )


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    sharing: SharingModel | None = DEFAULT_SHARING,
    model: str | None = None,
    log_type: str | None = None,
) -> Trace:
    """Load any supported trace. `block_tokens` is the Mooncake file's block size;
    `sharing` applies to formats without prefix information."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "mooncake":
        trace = load_mooncake(path, block_tokens=block_tokens)
    elif fmt == "azure":
        trace = load_azure(path, sharing=sharing)
    else:
        trace = load_burstgpt(path, sharing=sharing, model=model, log_type=log_type)
    if not trace.requests:
        raise TraceError(f"{path}: the trace has no requests")
    return trace
