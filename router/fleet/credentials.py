"""A worker's credentials: an API key or header set the gateway sends on every call to it.

A vLLM server started with `--api-key` answers 401 to anything without
`Authorization: Bearer <key>`. The config names where each secret lives (an environment
variable or a file), never the secret itself, so a config file, `/admin/workers` and the
explain output can be shown as they are; the values are read when the worker is built and
live only in its request headers. Every path that talks to a worker (requests, probes,
`/metrics`, `/load`, prefetch, purge) sends them.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an HTTP token
_RESERVED = frozenset({"host", "content-length", "content-type", "transfer-encoding", "connection"})


class CredentialError(ValueError):
    """A secret the config points at is missing or unusable (the message names where it
    was looked for, never a value)."""


class AuthConfig(BaseModel):
    """`workers[].auth`: at most one of `api_key_env` / `api_key_file` (sent as
    `Authorization: Bearer <key>`), and `headers_env`: more headers, each value read from
    the environment variable named."""

    model_config = ConfigDict(extra="forbid")

    api_key_env: str | None = Field(default=None, min_length=1)
    api_key_file: str | None = Field(default=None, min_length=1)
    headers_env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> AuthConfig:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give api_key_env or api_key_file, not both")
        for name in self.headers_env:
            if not _HEADER_NAME.match(name) or name.lower() in _RESERVED:
                raise ValueError(f"headers_env: {name!r} is not a header the gateway may set")
            if name.lower() == "authorization" and (self.api_key_env or self.api_key_file):
                raise ValueError("headers_env sets Authorization, and so does the API key")
        resolve(self)  # a missing secret fails when the config is read, not at the first request
        return self

    def described(self) -> dict[str, Any]:
        """Where each secret comes from, for `/admin/workers` (no value)."""
        out: dict[str, Any] = {}
        if self.api_key_env is not None:
            out["api_key"] = f"env:{self.api_key_env}"
        elif self.api_key_file is not None:
            out["api_key"] = f"file:{self.api_key_file}"
        if self.headers_env:
            out["headers"] = {h: f"env:{v}" for h, v in sorted(self.headers_env.items())}
        return out


def resolve(auth: AuthConfig | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers `auth` asks for, read now; CredentialError naming what is missing."""
    if auth is None:
        return {}
    env = os.environ if env is None else env
    headers: dict[str, str] = {}
    if auth.api_key_env is not None:
        key = _value(env.get(auth.api_key_env), f"environment variable {auth.api_key_env}")
        headers["Authorization"] = "Bearer " + key
    elif auth.api_key_file is not None:
        headers["Authorization"] = "Bearer " + _value(_read(auth.api_key_file), f"file {auth.api_key_file}")
    for name, var in auth.headers_env.items():
        headers[name] = _value(env.get(var), f"environment variable {var}")
    return headers


def head_lines(headers: Mapping[str, str]) -> bytes:
    """The headers as HTTP/1.1 request lines, for the lean client's hand-built heads."""
    return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _value(v: str | None, where: str) -> str:
    if not v:
        raise CredentialError(f"{where} is missing or empty")
    if any(c in v for c in "\r\n\0"):
        raise CredentialError(f"{where} holds a line break or NUL")
    try:
        v.encode("latin-1")
    except UnicodeEncodeError:
        raise CredentialError(f"{where} holds characters an HTTP header cannot carry") from None
    return v
