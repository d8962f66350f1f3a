"""`kvroute serve --processes 2`: an admin change reaches every process before it is
answered (router/fleet/replica_sync.py), and a process restarted later has it too.

Which process answers is the kernel's choice per connection (SO_REUSEPORT); every
request here opens a fresh connection, so 24 of them reach both processes unless the
kernel sends all to one (a chance of 2^-23). Waits are bounds against a hang only."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL

from loadtest.harden.cases.deploy import all_listening, children
from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TRIES = 24
HANG_S = 180.0


@asynccontextmanager
async def two_processes(tmp: Path, workers: list[FakeWorker]) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    cfg = {"models": [{"id": MODEL, "tokenizer": str(ROOT / "configs/assets/tiny-tokenizer"),
                       "max_context_tokens": 512}],
           "workers": [{"id": w.worker_id, "url": w.url, "model": MODEL} for w in workers],
           "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.2},
           "listen": {"host": "127.0.0.1", "port": port},
           "shutdown": {"grace_s": 0, "drain_timeout_s": 2},
           "observability": {"log_level": "WARNING"}}
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONPATH"] = str(ROOT)
    log = (tmp / "gateway.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path), "--processes", "2"],
                            cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        await _until(lambda: _both_up(proc.pid, port, url), "both processes ready", proc, tmp)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


async def _until(pred: Any, what: str, proc: subprocess.Popen[bytes], tmp: Path) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S
    while not await pred():
        assert proc.poll() is None, f"the gateway exited: {(tmp / 'gateway.log').read_text()[-3000:]}"
        assert loop.time() < deadline, f"no {what} after {HANG_S:.0f} s: {(tmp / 'gateway.log').read_text()[-3000:]}"
        await asyncio.sleep(0.2)


async def _fresh(method: str, url: str, **kw: Any) -> tuple[int, Any]:
    """One request on a connection of its own (so the kernel picks a process for it)."""
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn) as s, s.request(method, url, **kw) as r:
        return r.status, await r.json(content_type=None)


async def _all_ready(url: str) -> bool:
    try:
        got = await asyncio.gather(*(_fresh("GET", url + "/ready") for _ in range(TRIES)))
    except aiohttp.ClientError:
        return False
    return all(status == 200 for status, _ in got)


async def _views(url: str) -> list[dict[str, str]]:
    """What each of TRIES fresh connections sees in /admin/workers: id -> state."""
    got = await asyncio.gather(*(_fresh("GET", url + "/admin/workers") for _ in range(TRIES)))
    return [{w["id"]: w["state"] for w in body["workers"]} for _, body in got]


async def _complete(url: str, n: int) -> None:
    for i in range(n):
        status, body = await _fresh("POST", url + "/v1/completions",
                                    json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 1})
        assert status == 200, body


async def _both_up(pid: int, port: int, url: str) -> bool:
    """Both processes listen (until one does, no connection can reach it) and are ready."""
    return all_listening(pid, port, 2) and await _all_ready(url)


async def test_admin_changes_reach_every_process(tmp_path: Path) -> None:
    a, b, c = FakeWorker("pa", DIGEST), FakeWorker("pb", DIGEST), FakeWorker("pc", DIGEST)
    async with AsyncExitStack() as st:
        for w in (a, b, c):
            await st.enter_async_context(serve_fake(w))
        url, proc = await st.enter_async_context(two_processes(tmp_path, [a, b]))

        status, body = await _fresh("POST", url + "/admin/workers/pa/drain")
        assert status == 200 and body["state"] == "draining", body
        views = await _views(url)
        assert all(v == {"pa": "draining", "pb": "healthy"} for v in views), views
        before = len(a.completions)
        await _complete(url, 12)
        assert len(a.completions) == before, "a completion went to the drained worker"
        assert len(b.completions) >= 12

        status, body = await _fresh("POST", url + "/admin/workers", json={"id": "pc", "url": c.url})
        assert status == 201, body
        status, body = await _fresh("DELETE", url + "/admin/workers/pb")
        assert status == 200, body
        await _until(lambda: _states_everywhere(url, {"pa": "draining", "pc": "healthy"}), "pc healthy everywhere",
                     proc, tmp_path)

        # a process that dies is restarted by the supervisor and replays the changes
        old = children(proc.pid)
        os.kill(old[0], signal.SIGKILL)
        await _until(lambda: _restarted(proc.pid, old, url), "a restarted process", proc, tmp_path)
        await _until(lambda: _states_everywhere(url, {"pa": "draining", "pc": "healthy"}),
                     "the changes in the restarted process", proc, tmp_path)
        before_a, before_c = len(a.completions), len(c.completions)
        await _complete(url, 12)
        assert len(a.completions) == before_a and len(c.completions) == before_c + 12


async def _states_everywhere(url: str, want: dict[str, str]) -> bool:
    return all(v == want for v in await _views(url))


async def _restarted(pid: int, old: list[int], url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    return set(children(pid)) != set(old) and await _both_up(pid, port, url)


async def test_a_worker_drained_before_it_registers_stays_drained() -> None:
    """A process applies a drain whatever the worker's state there (a replayed journal
    meets workers not registered yet): it registers as draining, never healthy."""
    from gateway_fleet import fleet, wait_until

    w = FakeWorker("early", DIGEST, health_status=500)
    async with fleet([w], ready=False) as (gw, _):
        assert gw.pool.workers["early"].state.value == "pending"
        gw.pool.drain("early", True)
        seen = set()

        def registered() -> bool:
            seen.add(gw.pool.workers["early"].state.value)
            return gw.pool.workers["early"].state.value != "pending"

        w.health_status = 200
        await wait_until(registered, 30.0, "the worker registered")
        assert gw.pool.workers["early"].state.value == "draining" and "healthy" not in seen
        assert gw.pool.routable(MODEL) == []
