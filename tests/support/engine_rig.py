"""The real engine driven directly in tests (tiny models, CPU): an EngineCore with tiers below the
pool (`make_core`), a redis-server for the REMOTE tier (`_redis`), seeded prompts, moving
everything to CPU or further down, and `run` (requests stepped together to the end)."""
from __future__ import annotations

import os
import random
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine.core import EngineCore
from workers.engine.engineconfig import EngineConfig
from workers.engine.model import LoadedModel
from workers.engine.sequence import SamplingParams, Sequence
from workers.engine.store.disk import DiskConfig
from workers.engine.testing import RedisServer, redis_binary
from workers.engine.tiers import TierConfig

BLOCK = 16
TOKEN = "peer-secret"  # the fleet secret REMOTE and PEER blocks are MAC-keyed with
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _redis(workdir: Path) -> Iterator[RedisServer]:
    pytest.importorskip("redis")
    if redis_binary() is None:
        msg = "!!! REMOTE TIER TESTS SKIPPED: no redis-server on PATH; the REMOTE tier was NOT tested !!!"
        warnings.warn(msg, stacklevel=1)
        pytest.skip(msg)
    server = RedisServer(workdir).start()
    try:
        yield server
    finally:
        server.stop()


_groups = iter(range(1_000_000))


def make_core(lm: LoadedModel, tmp: Path, *, redis: RedisServer | None = None, cpu_blocks: int = 128,
              disk: bool = False, disk_dir: Path | None = None, num_blocks: int = 96, admit_after: int = 1,
              disk_bytes: int = 16 << 20, group: str | None = None, **kw: Any) -> EngineCore:
    bb = lm.kv.token_bytes * BLOCK
    remote = None
    if redis is not None:
        from workers.engine.store.remote import RedisConfig

        remote = RedisConfig(port=redis.port, group=group or f"t{next(_groups)}-{os.getpid()}")
        kw.setdefault("peer_token", TOKEN)  # REMOTE blocks carry a MAC keyed with the fleet secret
    dcfg = None
    if disk:
        dcfg = DiskConfig(disk_dir or tmp / "disk", disk_bytes, segment_bytes=min(4 << 20, disk_bytes // 2),
                          admit_after=admit_after)
    tiers = TierConfig(cpu_bytes=cpu_blocks * bb, disk=dcfg, remote=remote, **kw)
    return EngineCore(lm, EngineConfig(num_blocks=num_blocks, max_num_batched_tokens=512, max_waiting=16,
                                       tiers=tiers))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def to_cpu(core: EngineCore) -> None:
    assert core.tiers is not None
    with core.lock:
        core.blocks.evict_cached()
    assert core.tiers.drain()


def below_cpu(core: EngineCore) -> None:
    """Everything on GPU down to CPU, then everything on CPU further down (DISK / REMOTE only)."""
    to_cpu(core)
    assert core.tiers is not None
    core.tiers.demote_all()


def run(core: EngineCore, reqs: list[tuple[str, list[int], str | None]],
        params: SamplingParams = GREEDY) -> dict[str, tuple[list[int], torch.Tensor, Sequence]]:
    """Run requests together to the end: per id its tokens, the logits of its first token, its sequence."""
    seqs = {rid: core.new_sequence(rid, ids, params, lora=lora) for rid, ids, lora in reqs}
    with core.lock:
        for s in seqs.values():
            core.add(s)
    toks: dict[str, list[int]] = {rid: [] for rid in seqs}
    first: dict[str, torch.Tensor] = {}
    deadline = time.monotonic() + 120
    while any(rid in core.seqs for rid in seqs):
        assert time.monotonic() < deadline, "requests did not finish"
        with core.wake:
            plan = core.schedule()
            while plan.empty and core.scheduler.loading:
                core.wake.wait(0.05)
                plan = core.schedule()
        if plan.empty:
            continue
        res = core.execute(plan)
        for rid, s in seqs.items():
            if rid not in first and s in res.logits:
                first[rid] = res.logits[s].float().cpu().clone()
        with core.lock:
            for u in core.commit(plan, res):
                toks[u.seq.request_id] += u.token_ids
    return {rid: (toks[rid], first[rid], s) for rid, s in seqs.items()}


def reference(model: Any, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the prompt's last logits from plain forwards with transformers' own
    cache (no reuse across requests): what the engine must equal."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        first = out.logits[0, -1].float().clone()
        toks: list[int] = []
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[toks[-1]]]), cache=out.cache, use_cache=True)
    return toks, first
