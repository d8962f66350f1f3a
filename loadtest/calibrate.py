"""`kvroute loadtest calibrate`: measure a real worker and write a simulator profile of it.

The gateway measures each worker as it joins (router/fleet/speed_probe.py) with the same fit
(router/planner/speedfit.py); this does it at leisure, more thoroughly, and writes the
result where the simulator reads it, so `loadtest simulate` can predict a fleet of that
engine. Measured over HTTP, as a client sees the worker:

- prefill: uncached prompts of random token ids (a fresh `cache_salt` each), `max_tokens: 1`,
  at several lengths, `--repeats` times each in round-robin order; time to the answer;
- decode: `b` concurrent streams of a short prompt for each batch size, the median time
  per output token after the first (ignoring EOS, so every stream is as long).

The prefill samples are fitted as the gateway fits them (overhead + scale x the base
profile's prefill shape); the decode step by least squares on the batch size. The
profile is the base profile (geometry, memory, tiers, scheduler: what HTTP cannot show)
with its `compute` section replaced and a note of what was measured.
"""
from __future__ import annotations

import asyncio
import random
import secrets
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from router.planner.speedfit import Sample, fit_samples
from router.planner.types import CostParams
from workers.sim.profile import PROFILES_DIR, load_profile

DEFAULT_LENGTHS = (32, 128, 256, 512, 1024)
DECODE_BATCHES = (1, 4, 8)
DECODE_TOKENS = 24


@dataclass(slots=True)
class Measured:
    overhead_s: float
    prefill_tokens_per_s: float
    prefill_attn_s_per_token2: float
    rel_spread: float
    decode_base_s: float
    decode_per_seq_s: float
    samples: int
    decode_steps: dict[int, float]


async def _prefill(s: aiohttp.ClientSession, url: str, model: str, n: int, rng: random.Random) -> float:
    ids = [rng.randrange(16, 8000) for _ in range(n)]
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "cache_salt": secrets.token_hex(8)}
    t0 = time.monotonic()
    async with s.post(url + "/v1/completions", data=msgspec.json.encode(body),
                      headers={"content-type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise ValueError(f"{url} answered a prefill probe with HTTP {r.status}")
    return time.monotonic() - t0


async def _stream_tpot(s: aiohttp.ClientSession, url: str, model: str, rng: random.Random) -> float | None:
    ids = [rng.randrange(16, 8000) for _ in range(16)]
    body = {"model": model, "prompt": ids, "max_tokens": DECODE_TOKENS, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "cache_salt": secrets.token_hex(8)}
    times: list[float] = []
    async with s.post(url + "/v1/completions", data=msgspec.json.encode(body),
                      headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            raise ValueError(f"{url} answered a decode probe with HTTP {r.status}")
        async for line in r.content:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                times.append(time.monotonic())
    # Time per output token after the first: a server may send several tokens in one event.
    return (times[-1] - times[0]) / (DECODE_TOKENS - 1) if len(times) >= 2 else None


async def measure(url: str, model: str, base: CostParams, lengths: tuple[int, ...] = DEFAULT_LENGTHS,
                  repeats: int = 3, seed: int = 0) -> Measured:
    """Time prefills and decode steps of the worker at `url` (module doc)."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await _prefill(s, url, model, 16, rng)  # warm-up
        samples = []
        for _ in range(repeats):
            for n in lengths:
                samples.append(Sample(n, 0, 0, await _prefill(s, url, model, n, rng)))
        steps: dict[int, float] = {}
        for b in DECODE_BATCHES:
            tpots = [t for t in await asyncio.gather(*(_stream_tpot(s, url, model, rng) for _ in range(b)))
                     if t is not None]
            if tpots:
                steps[b] = statistics.median(tpots)
    fit = fit_samples(base, samples)
    d_base, d_seq = _line(steps)
    return Measured(fit.overhead_s, base.prefill_tokens_per_s / fit.scale, base.prefill_attn_s_per_token2 * fit.scale,
                    fit.rel_spread, d_base, d_seq, len(samples), steps)


def _line(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (batch, step), both >= 0."""
    if not points:
        return 0.0, 0.0
    xs, ys = list(points), list(points.values())
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var) if var else 0.0
    return max(0.0, my - slope * mx), slope


def base_cost(profile_name: str) -> tuple[CostParams, dict[str, Any], Path]:
    """The base profile's prefill shape as CostParams, its YAML as a mapping, and its file."""
    prof = load_profile(profile_name)
    path = Path(profile_name) if Path(profile_name).is_file() else PROFILES_DIR / f"{profile_name}.yaml"
    c = prof.compute
    cost = CostParams(block_size=prof.block_size, block_bytes=1, prefill_tokens_per_s=c.prefill_tokens_per_s,
                      prefill_attn_s_per_token2=c.prefill_attn_s_per_token2, prefill_overhead_s=c.prefill_overhead_s)
    return cost, yaml.safe_load(path.read_text()), path


def profile_yaml(base: dict[str, Any], m: Measured, name: str, url: str) -> str:
    """The base profile with the measured compute section, headed by what was measured."""
    data = dict(base)
    data["name"] = name
    compute = dict(data.get("compute") or {})
    compute.update(prefill_tokens_per_s=round(m.prefill_tokens_per_s, 1),
                   prefill_attn_s_per_token2=float(f"{m.prefill_attn_s_per_token2:.4g}"),
                   prefill_overhead_s=round(m.overhead_s, 6),
                   decode_base_s=round(m.decode_base_s, 6), decode_per_seq_s=round(m.decode_per_seq_s, 7))
    data["compute"] = compute
    steps = ", ".join(f"batch {b}: {s * 1e3:.2f} ms" for b, s in sorted(m.decode_steps.items()))
    head = (f"# Measured by `kvroute loadtest calibrate` at {url} ({time.strftime('%Y-%m-%d')}): {m.samples} uncached\n"
            f"# prefills fitted as overhead {m.overhead_s * 1e3:.1f} ms + {m.prefill_tokens_per_s:.0f} tokens/s "
            f"(residual spread {m.rel_spread:.1%});\n# decode steps {steps}. Everything else is the base profile's.\n")
    return head + str(yaml.safe_dump(data, sort_keys=False))


async def _served_model(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, s.get(url + "/v1/models") as r:
        body: dict[str, Any] = await r.json(content_type=None)
    return str(body["data"][0]["id"])


def run_calibrate(url: str, out: Path, *, base_profile: str, name: str, model: str | None,
                  lengths: tuple[int, ...], repeats: int) -> Measured:
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    cost, base, _ = base_cost(base_profile)
    model = model or asyncio.run(_served_model(url))
    m = asyncio.run(measure(url, model, cost, lengths, repeats))
    out.write_text(profile_yaml(base, m, name, url))
    return m
