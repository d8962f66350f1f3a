"""How the gateway is deployed: the environment Kubernetes gives a pod, and
`kvroute serve --processes N`.

`k8s_service_links`: every pod gets service-link variables for the Services of its
namespace (`KVROUTE_GATEWAY_PORT=tcp://...` for `kvroute-gateway`); the gateway must
start and serve with them. `processes_admin`: under `--processes 2` an admin change
must reach both processes before it is answered, and a process restarted later must
hold it too; which process answers is the kernel's choice per connection, so every
look is many fresh connections.
"""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import yaml

from ...ports import free_port
from ..config import kvroute_worker
from ..outcome import COMPLETION, Spec
from ..procs import GatewayProc
from ..runner import Ctx, case
from .common import COMP_PATH, comp_body, fleet, wait_until

SERVICE_LINKS = {
    "KVROUTE_GATEWAY_SERVICE_HOST": "10.0.0.1", "KVROUTE_GATEWAY_SERVICE_PORT": "8000",
    "KVROUTE_GATEWAY_PORT": "tcp://10.0.0.1:8000", "KVROUTE_GATEWAY_PORT_8000_TCP": "tcp://10.0.0.1:8000",
    "KVROUTE_GATEWAY_PORT_8000_TCP_PROTO": "tcp", "KVROUTE_GATEWAY_PORT_8000_TCP_PORT": "8000",
    "KVROUTE_GATEWAY_PORT_8000_TCP_ADDR": "10.0.0.1", "KVROUTE_VALKEY_SERVICE_HOST": "10.0.0.2",
    "KVROUTE_VALKEY_SERVICE_PORT": "6379", "KVROUTE_VALKEY_PORT": "tcp://10.0.0.2:6379",
}
LOOKS = 24  # fresh connections per look: all on one of 2 processes has a chance of 2^-23


@case("k8s_service_links", "the gateway started with Kubernetes service-link variables in its environment",
      small_s=90, full_s=120)
async def k8s_service_links(ctx: Ctx) -> None:
    ctx.procs.env.update(SERVICE_LINKS)
    gw, _, _ = await fleet(ctx, 1, ready=True)
    for i in range(4):
        await ctx.call(gw, "POST", COMP_PATH, comp_body(f"service links {i}", max_tokens=4),
                       spec=Spec(expect=COMPLETION), label="completion")
    log = gw.proc.log.read_text(errors="replace")
    ctx.check("the service links are named in a warning, not fatal", "KVROUTE_GATEWAY_PORT" in log,
              f"gateway log {gw.proc.log}")


async def _processes_gateway(ctx: Ctx, workers: list[dict[str, object]]) -> GatewayProc:
    """`kvroute serve --processes 2` on a free port, once /ready answers on it."""
    port = free_port()
    cfg = ctx.config(workers)
    cfg["listen"] = {"host": "127.0.0.1", "port": port}
    path = ctx.folder / f"gateway-processes-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = ctx.procs.spawn("gateway-processes", [ctx.st.python, "-m", "kvroute.cli", "serve", "--config",
                                                 str(path), "--processes", "2"])
    gw = GatewayProc(proc, port, path, cfg)
    await asyncio.to_thread(ctx.procs.wait_http, proc, gw.url + "/ready", 90.0 * ctx.stretch)
    ctx.gateways.append(gw)
    return gw


async def _looks(ctx: Ctx, gw: GatewayProc) -> list[dict[str, str]]:
    """/admin/workers (id -> state) as LOOKS fresh connections see it."""
    views = await asyncio.gather(*(ctx.workers_state(gw) for _ in range(LOOKS)))
    return [{str(w.get("id")): str(w.get("state")) for w in v} for v in views]


async def _same_everywhere(ctx: Ctx, gw: GatewayProc, want: dict[str, str]) -> bool:
    return all(v == want for v in await _looks(ctx, gw))


def children(pid: int) -> list[int]:
    """The processes `pid` started (Linux)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def listening(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port` (Linux): until it does,
    the kernel gives it no connection, and a look through the port cannot see it."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def all_listening(pid: int, port: int, n: int) -> bool:
    kids = children(pid)
    return len(kids) == n and all(listening(k, port) for k in kids)


async def _served_by(ctx: Ctx, gw: GatewayProc, n: int, label: str) -> list[str]:
    got = []
    for i in range(n):
        o = await ctx.call(gw, "POST", COMP_PATH, comp_body(f"{label} {i}", max_tokens=2),
                           spec=Spec(expect=COMPLETION), label=label)
        got.append(o.headers.get("x-kvroute-worker", "?"))
    return got


@case("processes_admin", "kvroute serve --processes 2: drain, add and remove reach every process; a restarted "
      "one holds them", small_s=150, full_s=240)
async def processes_admin(ctx: Ctx) -> None:
    sc = await ctx.sim(3)
    a, b, c = sc.workers
    ids = [ctx.worker_id("hw") for _ in range(3)]
    gw = await _processes_gateway(ctx, [kvroute_worker(ids[0], a.url), kvroute_worker(ids[1], b.url)])
    both = {ids[0]: "healthy", ids[1]: "healthy"}

    async def up() -> bool:
        return all_listening(gw.pid, gw.port, 2) and await _same_everywhere(ctx, gw, both)

    ok = await wait_until(up, 60.0)
    if not ctx.check("both processes see both workers healthy", ok, str(await _looks(ctx, gw))):
        return

    rep = await ctx.raw(gw, "POST", f"/admin/workers/{ids[0]}/drain", {})
    ctx.note(f"drain answered {rep.status}, {rep.headers.get('x-kvroute-processes-applied', 'no')} processes")
    views = await _looks(ctx, gw)
    ctx.check("right after the drain returned, every process has it",
              all(v.get(ids[0]) == "draining" for v in views), str(views))
    served = await _served_by(ctx, gw, 12, "after-drain")
    ctx.check("no completion goes to the drained worker", ids[0] not in served, str(served))

    await ctx.raw(gw, "POST", "/admin/workers", {"id": ids[2], "url": c.url, "kind": "kvroute"})
    await ctx.raw(gw, "DELETE", f"/admin/workers/{ids[1]}")
    want = {ids[0]: "draining", ids[2]: "healthy"}
    views = await _looks(ctx, gw)
    ctx.check("right after add and remove returned, every process lists the same workers",
              all(set(v) == set(want) for v in views), str(views))
    ok = await wait_until(lambda: _same_everywhere(ctx, gw, want), 30.0)
    ctx.check("every process routes to the added worker", ok, str(await _looks(ctx, gw)))

    old = children(gw.pid)
    if not ctx.check("the supervisor runs 2 processes", len(old) == 2, str(old)):
        return
    os.kill(old[0], signal.SIGKILL)

    async def restarted() -> bool:
        now = children(gw.pid)
        return set(now) != set(old) and all_listening(gw.pid, gw.port, 2) and await _same_everywhere(ctx, gw, want)

    ok = await wait_until(restarted, 60.0, 0.5)
    ctx.check("a process restarted after the changes holds them", ok, str(await _looks(ctx, gw)))
    served = await _served_by(ctx, gw, 12, "after-restart")
    ctx.check("after the restart, completions go to the added worker only", set(served) == {ids[2]}, str(served))
