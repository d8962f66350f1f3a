"""The gateway's resident memory over a mixed hostile run (10 s small, 60 s full): normal
traffic from one tenant while the other sends huge prompts, special-token floods,
fuzzed bodies, slow reads and abandoned requests. Reports RSS max and end.
"""
from __future__ import annotations

import asyncio
import random
import time

from ..outcome import CHAT, Spec
from ..runner import Ctx, case
from .common import CHAT_PATH, COMP_PATH, ask, big_text, chat_body, comp_body, words
from .fuzz import _bases, _spec_for, mutate
from .tenants import _tenant_fleet

PEAK_MIB = 512  # growth over the run's start
END_MIB = 256  # growth still held 3 s after the run


@case("memory_hostile", "gateway RSS over a mixed hostile run (10 s small, 60 s full): max and end",
      small_s=120, full_s=300)
async def memory_hostile(ctx: Ctx) -> None:
    gw, ha, hb, _ = await _tenant_fleet(ctx)
    duration = float(ctx.pick(10, 60))
    rng = random.Random(99)
    big = big_text(int(ctx.pick(3e6, 7.5e6)), rng)
    specials = "<|im_start|>x" * 550_000
    bases = _bases()
    ctx.sampler.reset(gw.pid)
    t_end = time.monotonic() + duration

    async def normal(k: int) -> None:
        i = 0
        while time.monotonic() < t_end:
            i += 1
            await ask(ctx, gw, words(60, rng, f"n{k} {i}"), stream=i % 2 == 0, max_tokens=16, timeout=10.0,
                      headers=hb, label="normal")

    async def huge() -> None:
        i = 0
        while time.monotonic() < t_end:
            i += 1
            body = chat_body(big, max_tokens=4) if i % 2 else comp_body(specials, max_tokens=4)
            await ctx.call(gw, "POST", CHAT_PATH if i % 2 else COMP_PATH, body, headers=ha, timeout=30.0,
                           spec=Spec(ok_statuses=(400, 413, 429)), label="huge" if i % 2 else "specials")

    async def fuzz() -> None:
        i = 0
        while time.monotonic() < t_end:
            chat, base = bases[i % len(bases)]
            i += 1
            what, body = mutate(rng, chat, base)
            await ctx.call(gw, "POST", CHAT_PATH if chat else COMP_PATH, body, headers=ha, timeout=20.0,
                           spec=_spec_for(body, chat), label=f"fuzz {what}")

    async def rude() -> None:
        i = 0
        while time.monotonic() < t_end:
            i += 1
            body = chat_body(words(40, rng, f"rude {i}"), max_tokens=300, stream=True)
            if i % 2:
                await ctx.call(gw, "POST", CHAT_PATH, body, headers=ha, timeout=60.0, label="slow-reader",
                               spec=Spec(expect=CHAT, stream=True), rcvbuf=4096, read_size=512, read_pause=0.02)
            else:
                await ctx.call(gw, "POST", CHAT_PATH, body, headers=ha, timeout=30.0, label="leaves",
                               spec=Spec(expect=CHAT, stream=True), abort="after_first_chunk")

    tasks = [normal(0), normal(1), huge(), huge(), fuzz(), rude()]
    await asyncio.gather(*tasks)
    await asyncio.sleep(3.0)
    ctx.sampler.sample_now(gw.pid)
    mib = ctx.sampler.mib(gw.pid)
    ctx.result.rss_mb = mib
    start, mx, end = mib.get("start", 0.0), mib.get("max", 0.0), mib.get("end", 0.0)
    ctx.note(f"gateway RSS over {duration:.0f} s: start {start:.0f} MiB, max {mx:.0f} MiB, end {end:.0f} MiB")
    ctx.check(f"RSS peak at most {PEAK_MIB} MiB over the start", mx - start <= PEAK_MIB, f"+{mx - start:.0f} MiB")
    ctx.check(f"RSS {END_MIB} MiB or less over the start, 3 s after", end - start <= END_MIB,
              f"+{end - start:.0f} MiB")
