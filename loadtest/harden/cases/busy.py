"""The suite on a busy machine: two CPU-heavy jobs beside it.

On a machine with a load of ~9 the default test run failed `gateway_restart` ("ready
within 5 s") and `publisher_restart` ran past its budget: a wall-clock bound that an idle
machine keeps is no property of the gateway. This case runs those two cases' bodies
while two processes spin on a core each (bounded in time, stopped with the case), with
the case's load factor raised by those two (the 1-minute load average has not seen them
yet): every functional check must hold, and the timing checks are judged against the
stretched bounds.
"""
from __future__ import annotations

import os

from ..runner import Ctx, case
from .events import gateway_restart, publisher_restart

HOGS = 2
HOG_S = 600  # each spins at most this long; the case stops them when it ends


def _start_hogs(ctx: Ctx) -> None:
    spin = f"import time\nend = time.monotonic() + {HOG_S}\nwhile time.monotonic() < end:\n    pass\n"
    for i in range(HOGS):
        ctx.procs.spawn(f"cpu-hog-{i}", [ctx.st.python, "-c", spin])
    load = os.getloadavg()[0] + HOGS
    ctx.stretch = max(ctx.stretch, load / (os.cpu_count() or 1))
    ctx.note(f"{HOGS} CPU-bound processes beside the case; load factor taken as {ctx.stretch:.2f}")


@case("busy_machine", "gateway_restart and publisher_restart with two CPU-heavy jobs running beside them",
      small_s=420, full_s=900)
async def busy_machine(ctx: Ctx) -> None:
    _start_hogs(ctx)
    await publisher_restart(ctx)
    await gateway_restart(ctx)
