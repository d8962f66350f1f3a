"""What of a worker's own error text may reach a client.

A worker that fails with a 5xx usually says why ("engine crashed", "KV cache is full"),
and the client is better served by that than by a generic text. But its message may
also carry what only the operator should see: a traceback, file paths, internal hosts
and ports, URLs, the worker's id, Python's exception class names. `worker_message`
keeps the first line of the explanation with all of that removed, or gives None when
nothing useful is left.
"""
from __future__ import annotations

import re

MAX_CHARS = 200
# Everything from a traceback on is the operator's.
_CUT = re.compile(r"Traceback \(most recent call last\)|\bFile \"|\n")
_ADDRESS = re.compile(
    r"\b[a-z][a-z0-9+.-]*://\S*"  # URLs and ZMQ endpoints
    r"|\[[0-9A-Fa-f:.]+\](?::\d+)?"  # [IPv6]:port
    r"|\b(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}\b"  # bare IPv6
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"  # IPv4[:port]
    r"|\b[\w-]+(?:\.[\w-]+)*:\d{2,5}\b"  # host:port
    r"|\b[\w-]+(?:\.[\w-]+){2,}\b"  # dotted host names (and module paths)
    r"|\blocalhost\b"
    r"|(?<![\w])(?:/[\w.@~+-]+){2,}/?",  # file paths
    re.I)
_PYTHON = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:Error|Exception)\b:?|\[Errno -?\d+\]|<[\w.]+ object at 0x[0-9a-f]+>")
_SPACES = re.compile(r"\s+")
_EMPTY_BRACKETS = re.compile(r"\(\s*\)|\[\s*\]|'\s*'|\"\s*\"")
_BEFORE_PUNCT = re.compile(r"\s+(?=[,.;:!?])|(?<=[,;:])\s*[,;:]+")


def worker_message(message: str, secrets: tuple[str, ...] = ()) -> str | None:
    """The worker's message with tracebacks, addresses, paths, exception names and
    `secrets` (its id, its host) removed; None when no words are left."""
    text = _CUT.split(message, maxsplit=1)[0]
    for s in secrets:
        if s:
            text = text.replace(s, " ")
    text = _ADDRESS.sub(" ", text)
    text = _PYTHON.sub(" ", text)
    text = _EMPTY_BRACKETS.sub(" ", text)
    text = _BEFORE_PUNCT.sub("", _SPACES.sub(" ", text)).strip(" \t:;,-.")
    if sum(c.isalpha() for c in text) < 3:
        return None
    return text[:MAX_CHARS].rstrip()
