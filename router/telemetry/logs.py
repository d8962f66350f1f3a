"""The gateway's logs: JSON lines (one object per record) or plain text.

A log shipper reads JSON lines without a parsing rule per message, and a request's
lines are found by its request id. Fields given to a record with `extra={"kv": {...}}`
become top-level keys of its JSON object (appended as `key=value` in text). The
request id comes from the client's `X-Request-Id` when it sends a usable one.
"""
from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

import msgspec

_enc = msgspec.json.Encoder()
# Echoed into logs and to the worker: short, and nothing a log viewer or a header would mangle.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's `X-Request-Id`, when it is one we can pass on unchanged."""
    v = headers.get("x-request-id")
    return v if v is not None and _REQUEST_ID.fullmatch(v) else None


class JsonFormatter(logging.Formatter):
    """`{"ts": ..., "level": ..., "logger": ..., "msg": ..., <extra kv>}` per line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        kv = getattr(record, "kv", None)
        if isinstance(kv, dict):
            for k, v in kv.items():
                out.setdefault(k, v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _enc.encode(out).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        kv = getattr(record, "kv", None)
        if isinstance(kv, dict) and kv:
            line += " " + " ".join(f"{k}={v}" for k, v in kv.items())
        return line


def setup_logging(level: str, fmt: str = "json", access_log: bool = False) -> None:
    """Root logging to stderr in `fmt` ("json" or "text"); replaces earlier handlers.
    uvicorn's loggers go through the same handler; its access lines only when asked for."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level, logging.INFO))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # one format for every line
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = access_log or name != "uvicorn.access"
