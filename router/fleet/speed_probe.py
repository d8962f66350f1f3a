"""Measuring a worker when it joins: a few uncached prompts, timed (DESIGN 5.1).

A worker whose speeds nobody stated (a vLLM server registered with no `cost:`) would be
priced with the router's defaults, which can be 20x off. So once it is healthy the
gateway sends it a handful of prompts of random token ids (uncached by construction,
and under a fresh `cache_salt` where the worker takes one) with `max_tokens: 1`, and
feeds each one's time to its answer into the worker's SpeedFit, as if it were a clean
request. The first prompt is a warm-up and not counted. A probe that overlaps real
traffic on the worker is not a clean sample and is dropped; a failing probe ends the
probing, and a worker that could not be measured is priced with the default speeds until
requests measure it (router/fleet/pool.py). The probes run beside the worker's monitor, so a
hanging one holds up neither its health checks nor its load polls.
"""
from __future__ import annotations

import logging
import random
import secrets
import time
from typing import Any

import aiohttp
import msgspec

from ..planner.speedfit import Sample
from .worker import Worker

log = logging.getLogger("kvroute.speed_probe")

# Prompt lengths in tokens: a warm-up, then four spread over the range prompts usually take.
PROBE_TOKENS = (16, 64, 512, 256, 128)
_FIRST_ID = 16  # clear of the usual special tokens
# Marks a probe to the worker (its logs, a test's fake): not a client's request.
PROBE_HEADERS = {"content-type": "application/json", "x-kvroute-probe": "speed"}
PROBE_TIMEOUT_S = 30.0  # one prompt of up to 512 tokens on a busy, slow engine


def probe_lengths(max_context: int) -> list[int]:
    """The probe's prompt lengths for a model of `max_context` tokens (room for the answer)."""
    cap = max(2, max_context // 2)
    return [min(n, cap) for n in PROBE_TOKENS]


def probe_body(model: str, ids: list[int], kind: str) -> bytes:
    body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "stream": False}
    if kind == "vllm":
        body["cache_salt"] = secrets.token_hex(8)
    return msgspec.json.encode(body)


async def probe_speeds(session: aiohttp.ClientSession, w: Worker, vocab_size: int,
                       rng: random.Random | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> int:
    """Probe `w`; returns the samples it gave its SpeedFit."""
    rng = rng or random.Random()
    hi = max(_FIRST_ID + 1, vocab_size)
    model = w.served_model or w.model.id
    given = 0
    for i, n in enumerate(probe_lengths(w.model.max_context)):
        ids = [rng.randrange(_FIRST_ID, hi) for _ in range(n)]
        busy = len(w.fleet.ledger.live)
        t0 = time.monotonic()
        try:
            usage = await _post(session, w.url + "/v1/completions", probe_body(model, ids, w.kind), timeout_s,
                                w.headers(PROBE_HEADERS) or PROBE_HEADERS)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            log.info("worker %s: speed probe stopped (%s: %s)", w.id, type(e).__name__, e)
            return given
        took = time.monotonic() - t0
        if i == 0 or busy or len(w.fleet.ledger.live):
            continue  # the warm-up, or real traffic shared the worker: not a clean sample
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        new = (prompt if isinstance(prompt, int) and prompt > 0 else n) - (cached if isinstance(cached, int) else 0)
        w.fleet.speed_sample(Sample(max(1, new), cached if isinstance(cached, int) else 0, 0, took))
        given += 1
    sp = w.fleet.speed
    if sp is not None:
        log.info("worker %s: speeds measured at join: %s", w.id, sp.summary())
    return given


async def _post(session: aiohttp.ClientSession, url: str, body: bytes, timeout_s: float,
                headers: dict[str, str]) -> dict[str, Any]:
    """POST and return the answer's `usage` ({} when it has none); ValueError on a non-200."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(url, data=body, headers=headers, timeout=timeout) as r:
        data = await r.read()
        if r.status != 200:
            raise ValueError(f"HTTP {r.status}")
    try:
        usage = msgspec.json.decode(data).get("usage")
    except (msgspec.DecodeError, AttributeError):
        raise ValueError("the answer is not JSON") from None
    return usage if isinstance(usage, dict) else {}
