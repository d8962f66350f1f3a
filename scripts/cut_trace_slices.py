"""Cut the small trace slices the tests ship (tests/data/traces/) from the full public traces.

Each slice is a byte-exact prefix of its source file (line endings kept: the Azure CSV
uses CRLF), so `head -c` of the full file reproduces it. The sources are the files named
in loadtest/tracefiles.py, read from the folder in $LOADTEST_TRACES or `--from DIR`:

- Mooncake: every request with `timestamp` < 120,000 ms (the first two minutes: 40
  bursts, 339 requests), enough for the 30 s window at 60 s that the tests take;
- Azure: the header and the first 200 requests.

    .venv/bin/python scripts/cut_trace_slices.py [--from DIR] [--out tests/data/traces]

Prints each slice's line count and SHA-256 (tests/data/README.md lists them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.trace import TraceError  # noqa: E402
from loadtest.tracefiles import AZURE, AZURE_SLICE, MOONCAKE, MOONCAKE_SLICE, require_trace  # noqa: E402

MOONCAKE_END_MS = 120_000
AZURE_ROWS = 200


def cut_mooncake(src: Path) -> bytes:
    out = []
    with src.open("rb") as f:
        for line in f:
            if json.loads(line)["timestamp"] >= MOONCAKE_END_MS:
                break
            out.append(line)
    return b"".join(out)


def cut_azure(src: Path) -> bytes:
    out = []
    with src.open("rb") as f:
        for line in f:
            out.append(line)
            if len(out) > AZURE_ROWS:  # the header + AZURE_ROWS requests
                break
    return b"".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", type=Path, default=None, help="folder holding the full traces")
    ap.add_argument("--out", type=Path, default=MOONCAKE_SLICE.parent)
    a = ap.parse_args(argv)
    try:
        if a.src is not None:
            mooncake, azure = a.src / MOONCAKE, a.src / AZURE
            for p in (mooncake, azure):
                if not p.is_file():
                    raise TraceError(f"{p} is not a file")
        else:
            mooncake, azure = require_trace(MOONCAKE, hint="or pass --from DIR"), require_trace(AZURE, hint="")
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    for data, name in ((cut_mooncake(mooncake), MOONCAKE_SLICE.name), (cut_azure(azure), AZURE_SLICE.name)):
        (a.out / name).write_bytes(data)
        lines = data.count(b"\n")
        print(f"{name}: {lines} lines, {len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
