"""Where the public traces are: a folder named by $LOADTEST_TRACES, never a fixed machine path.

The full files (README.md, "Replaying traces and load tests", says which) are too large to
ship; the tests carry small slices of them in tests/data/traces/ (a source checkout only).
Whatever needs a full trace asks `require_trace(name)`, which fails with one line naming
the variable.

Why not a `KVROUTE_` name: that prefix is the gateway's config override
(router/config.py, `KVROUTE_A__B=...`), and the gateways `loadtest compare` starts
inherit the environment (one that names no config section is only warned about).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .trace import TraceError

ENV = "LOADTEST_TRACES"
MOONCAKE = "mooncake_conversation_first_half.jsonl"
AZURE = "AzureLLMInferenceTrace_conv.csv"

SLICES = Path(__file__).resolve().parent.parent / "tests" / "data" / "traces"
MOONCAKE_SLICE = SLICES / "mooncake_conversation_first_120s.jsonl"  # first 339 requests of MOONCAKE
AZURE_SLICE = SLICES / "AzureLLMInferenceTrace_conv_first_200.csv"  # header + first 200 requests of AZURE


def find_trace(name: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """$LOADTEST_TRACES/name if that file exists, else None."""
    folder = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not folder:
        return None
    p = Path(folder).expanduser() / name
    return p if p.is_file() else None


def require_trace(name: str, environ: Mapping[str, str] | None = None, *, hint: str = "or pass --trace FILE") -> Path:
    """$LOADTEST_TRACES/name, or a one-line TraceError saying what to set (`hint`: the other way)."""
    p = find_trace(name, environ)
    if p is not None:
        return p
    folder = (os.environ if environ is None else environ).get(ENV, "").strip()
    where = f"${ENV} ({folder}) has no {name}" if folder else f"${ENV} is not set"
    raise TraceError(f"{where}: set {ENV} to the folder holding the public traces (see README.md, Replaying "
                     "traces)" + (f" {hint}" if hint else ""))


def resolve_trace(path: str | Path | None, name: str = MOONCAKE, environ: Mapping[str, str] | None = None) -> Path:
    """A `--trace` value if given (it must be a file), else $LOADTEST_TRACES/name; TraceError otherwise."""
    if path is None or str(path) == "":
        return require_trace(name, environ)
    p = Path(path).expanduser()
    if not p.is_file():
        raise TraceError(f"--trace {p}: no such file")
    return p
