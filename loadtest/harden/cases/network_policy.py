"""One network policy for every address the gateway connects to: KV-event and replay
endpoints as well as worker URLs, whether admin-added, configured or advertised in a
worker's `/info` (a cloud's metadata service must never be one of them)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import yaml

from ..config import kvroute_worker
from ..outcome import Spec
from ..runner import Ctx, case
from .common import wait_until

METADATA = "169.254.169.254"
EVIL_EVENTS: tuple[dict[str, Any], ...] = (
    {"endpoint": f"tcp://{METADATA}:5557"},
    {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://8.8.8.8:5558"},
    {"endpoint": f"tcp://[::ffff:{METADATA}]:5557"},
    {"endpoint": f"tcp://127.0.0.1;{METADATA}:5557"},
    {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "ipc:///tmp/kvroute-harden-replay"},
)
ADVERTISED = (("an ipc:// path", ["--events", "ipc:///tmp/kvroute-harden-advertised"]),
              ("a replay endpoint off the networks", ["--events", "tcp://127.0.0.1:5999",
                                                      "--replay", f"tcp://{METADATA}:5558"]))


@case("network_policy", "event endpoints off the allowed networks: refused when added, configured or advertised",
      small_s=90, full_s=120)
async def network_policy(ctx: Ctx) -> None:
    target = await ctx.faulty("ok", kind="vllm")
    advertisers = [await ctx.faulty("ok", extra=extra) for _, extra in ADVERTISED]
    workers = [kvroute_worker(fp.worker_id, fp.url) for fp in advertisers]
    gw = await ctx.gateway(ctx.config(workers), wait_ready=False)
    # the admin API (open to this host without a token): every such endpoint refused
    for i, ev in enumerate(EVIL_EVENTS):
        body = {"id": f"evil-{ctx.tag}-{i}", "url": target.url, "kind": "vllm", "events": ev}
        await ctx.call(gw, "POST", "/admin/workers", body, spec=Spec(must_refuse=True, tenant_facing=False),
                       label="admin add", timeout=10.0)
    ids = {w.get("id") for w in await ctx.workers_state(gw)}
    ctx.check("no refused worker is in the pool", not any(str(i).startswith("evil-") for i in ids), str(ids))
    # a worker's /info advertising them: the worker is refused, naming why

    async def refused() -> bool:
        ws = {w.get("id"): w for w in await ctx.workers_state(gw)}
        return all(ws.get(fp.worker_id, {}).get("state") == "refused" for fp in advertisers)

    await wait_until(refused, 15.0, 0.25)
    ws = {w.get("id"): w for w in await ctx.workers_state(gw)}
    for (what, _), fp in zip(ADVERTISED, advertisers, strict=True):
        w = ws.get(fp.worker_id, {})
        ctx.check(f"a worker advertising {what} is refused, the reason naming the policy",
                  w.get("state") == "refused" and ("must be tcp://" in str(w.get("reason"))
                                                   or "outside the networks" in str(w.get("reason"))),
                  f"state {w.get('state')}, reason {w.get('reason')!r}")
    # the config file naming one: a config error at start, naming the field
    await _config_refused(ctx, target.url)


async def _config_refused(ctx: Ctx, url: str) -> None:
    cfg = ctx.config([{"id": f"cfg-{ctx.tag}", "url": url, "kind": "vllm",
                       "events": {"endpoint": f"tcp://{METADATA}:5557"}}])
    path = ctx.folder / "gateway-metadata-events.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = ctx.procs.spawn("gateway-bad-config", [ctx.st.python, "-m", "kvroute.cli", "serve", "--config", str(path)])
    t0 = time.monotonic()
    while proc.alive and time.monotonic() - t0 < 20.0:  # a config error ends it in a second or two
        await asyncio.sleep(0.1)
    code = proc.popen.poll()
    if code is None:
        ctx.procs.kill(proc)
    text = proc.log.read_text(errors="replace")
    ctx.check("a config naming the metadata address fails at start, naming the field",
              code not in (None, 0) and "workers[0].events.endpoint" in text and "worker_networks" in text,
              f"exit code {code}: {text[-300:]!r}")
