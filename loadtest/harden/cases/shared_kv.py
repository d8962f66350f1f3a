"""Forged shared KV: someone who can write to the group's Redis, and an endpoint named as a
peer, each hand a real engine worker well-formed wrong KV. It must be a miss, counted,
and the answer must be a full recompute's.

Three real engine workers (`workers.cli engine`, the bundled tiny model) with one fleet
secret, and a redis-server; A and B share a REMOTE group, C has its own. A computes
prompts P and Q (misses: the reference answers), then other prompts push them out of its
small pool, so their blocks are written to REMOTE. Every REMOTE value of the group is
then rewritten the way a writer without the fleet secret can: a valid record (docs/wire.md
§ /kv/blocks: layout, key, meta, both crc32s) of random KV, followed by a MAC it had to
guess. B, fresh, answers P. C, fresh, is told to prefetch Q from a forging peer (served
here) that lists every block and streams such records, then answers Q.
"""
from __future__ import annotations

import asyncio
import base64
import random
import secrets
import shutil
import struct
import time
import zlib
from array import array
from typing import Any

from aiohttp import web

from kvindex.keys import BlockHasher, Namespace

from ...ports import free_port
from ..outcome import COMPLETION, JSON, Spec
from ..procs import Proc, StartError
from ..runner import Ctx, Skip, case

_PRE = struct.Struct("<4s32sIII")  # magic, key, flags, meta_len, payload_len (docs/wire.md)
_MAGIC = b"KVB\x01"
_MAC_SIZE = 32
RECORDS = "application/x-kvroute-kv-records"
PROMPT_TOKENS = 512  # 32 blocks of 16


def _forged_record(key: bytes, meta: bytes, payload_len: int, rng: random.Random) -> bytes:
    """A well-formed record of wrong KV (finite float32 values) and a guessed MAC."""
    payload = array("f", (rng.gauss(0.0, 1.0) for _ in range(payload_len // 4))).tobytes()
    pre = _PRE.pack(_MAGIC, key, 0, len(meta), len(payload))
    crc = zlib.crc32(payload, zlib.crc32(meta, zlib.crc32(pre)))
    head_crc = zlib.crc32(meta, zlib.crc32(pre + crc.to_bytes(4, "little")))
    return pre + struct.pack("<II", crc, head_crc) + meta + payload + rng.randbytes(_MAC_SIZE)


def _split(value: bytes) -> tuple[bytes, bytes, int]:
    """(key, meta, payload length) of a REMOTE value (a record and its MAC)."""
    _, key, _, meta_len, payload_len = _PRE.unpack_from(value)
    head = _PRE.size + 8
    return key, value[head : head + meta_len], payload_len


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8000) for _ in range(PROMPT_TOKENS)]


async def _engine(ctx: Ctx, name: str, redis_port: int, group: str, secret: str) -> tuple[Proc, str]:
    """One real engine worker on a free port; its URL once it says `ready`."""
    port = free_port()
    argv = [ctx.st.python, "-m", "workers.cli", "engine",
            "--model", "default", "--port", str(port), "--host", "127.0.0.1", "--worker-id", ctx.worker_id(name),
            "--num-blocks", "80", "--cpu-bytes", str(64 * 65536), "--threads", "1", "--no-calibrate",
            "--remote-url", f"redis://127.0.0.1:{redis_port}/0", "--remote-group", group, "--peer-token", secret]
    proc = ctx.procs.spawn(name, argv, watch_stdout=True)
    await asyncio.to_thread(ctx.procs.wait_line, proc, "ready", 180.0)
    return proc, f"http://127.0.0.1:{port}"


async def _redis(ctx: Ctx) -> tuple[Any, int]:
    """A throwaway redis-server and a client of it (Skip without either)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise Skip("no redis-server on PATH (Debian: apt-get install redis-server): the REMOTE forgery was NOT tried")
    try:
        import redis
    except ImportError:
        raise Skip("redis-py is not installed (extra `worker`)") from None
    port = free_port()
    ctx.procs.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    client = redis.Redis(port=port, socket_timeout=2.0)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return client, port
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise StartError("redis-server did not answer PING within 20 s") from None
            await asyncio.sleep(0.1)


async def _complete(ctx: Ctx, url: str, ids: list[int], label: str) -> tuple[str, dict[str, Any]]:
    """A greedy completion of token ids straight to a worker: (text, usage)."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    o = await ctx.call(url, "POST", "/v1/completions", body, spec=Spec(expect=COMPLETION, tenant_facing=False),
                       timeout=120.0, label=label)
    data = o.data if isinstance(o.data, dict) else {}
    return o.text, dict(data.get("usage") or {})


async def _counter(ctx: Ctx, url: str, name: str, tier: str) -> float:
    rep = await ctx.raw(url, "GET", "/metrics")
    want = f'kvroute_worker_{name}_total{{tier="{tier}"}}'
    for line in rep.body.decode(errors="replace").splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return 0.0


async def _forging_peer(records: dict[bytes, bytes], bearers: list[str]) -> tuple[web.AppRunner, str]:
    """An HTTP endpoint answering /kv/blocks for every key asked, with `records`."""

    async def blocks(request: web.Request) -> web.Response:
        bearers.append(request.headers.get("Authorization", ""))
        raw = base64.b64decode((await request.json())["keys_b64"])
        keys = [raw[i : i + 32] for i in range(0, len(raw), 32)]
        if request.headers.get("Accept", "").startswith(RECORDS):
            return web.Response(body=b"".join(records[k] for k in keys if k in records), content_type=RECORDS)
        return web.json_response({"blocks": [{"key": k.hex(), "tier": "GPU", "bytes": 65536} for k in keys],
                                  "missing": 0})

    app = web.Application()
    app.router.add_post("/kv/blocks", blocks)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _wait(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.2)
    return False


@case("shared_kv_forged", "forged REMOTE values and a forging peer: a miss, counted, the output a full recompute's",
      small_s=400, full_s=400)
async def shared_kv_forged(ctx: Ctx) -> None:
    client, rport = await _redis(ctx)
    secret, group, rng = secrets.token_urlsafe(24), f"hk-{ctx.tag}", random.Random(10)
    ctx.secrets.add(secret)
    # C in a group of its own: its only source for Q is the peer
    (_, a), (_, b), (_, c) = await asyncio.gather(*(_engine(ctx, n, rport, g, secret)
                                                    for n, g in (("ea", group), ("eb", group), ("ec", group + "-c"))))
    p, q = _prompt(1), _prompt(2)
    ref_p, _ = await _complete(ctx, a, p, "A: P (reference)")
    ref_q, _ = await _complete(ctx, a, q, "A: Q (reference)")
    for i in range(3):  # push P (and Q) out of A's 80-block pool: written to REMOTE as they leave it
        await _complete(ctx, a, _prompt(100 + i), "A: filler")
    pattern = f"*:{group}:*".encode()
    if not await _wait(lambda: asyncio.to_thread(lambda: len(list(client.scan_iter(pattern))) >= 32), 30.0):
        ctx.check("A wrote P's blocks to REMOTE", False, f"{len(list(client.scan_iter(pattern)))} values")
        return
    names = list(client.scan_iter(pattern))
    for n in names:
        key, meta, plen = _split(client.get(n))
        client.set(n, _forged_record(key, meta, plen, rng), keepttl=True)
    ctx.note(f"{len(names)} REMOTE values of group {group} rewritten: valid records of random KV, guessed MACs")
    got_p, usage_p = await _complete(ctx, b, p, "B: P over forged REMOTE")
    kv = usage_p.get("kv") or {}
    ctx.check("B's answer to P equals A's full recompute", got_p == ref_p, f"{got_p!r} vs {ref_p!r}")
    ctx.check("no forged REMOTE block served", (kv.get("loaded_tokens") or {}).get("REMOTE", 0) == 0,
              f"kv usage {kv}")
    mac_remote = await _counter(ctx, b, "block_mac_failures", "REMOTE")
    ctx.check("B counted the forged REMOTE block", mac_remote >= 1, f"block_mac_failures{{REMOTE}} = {mac_remote}")

    info = (await ctx.raw(c, "GET", "/info")).json()
    ns = Namespace(**info["namespace"])
    keys = BlockHasher.for_namespace(ns).keys_for(q, ns.scoped(cache_salt=""))
    meta = b"\x95\xc4\x00\x90\xc0\xc0\xc0"  # msgpack [b"", [], nil, nil, nil]: well-formed, and never decoded first
    records = {k: _forged_record(k, meta, int(info["block_bytes"]), rng) for k in keys}
    bearers: list[str] = []
    runner, peer = await _forging_peer(records, bearers)
    try:
        body = {"prefetch_id": f"forged-{ctx.tag}", "keys_b64": base64.b64encode(b"".join(keys)).decode(),
                "deadline_ms": 20000, "source_peer": {"url": peer}}
        await ctx.call(c, "POST", "/kv/prefetch", body, spec=Spec(expect=JSON, ok_statuses=(202,), tenant_facing=False),
                       label="C: prefetch Q from the forging peer")
        counted = await _wait(lambda: _peer_mac(ctx, c), 30.0)
        ctx.check("C counted the forged PEER block", counted, "block_mac_failures{PEER} stayed 0")
        got_q, usage_q = await _complete(ctx, c, q, "C: Q after the forged pull")
    finally:
        await runner.cleanup()
    kv = usage_q.get("kv") or {}
    ctx.check("C's answer to Q equals A's full recompute", got_q == ref_q, f"{got_q!r} vs {ref_q!r}")
    ctx.check("no forged PEER block served", (kv.get("loaded_tokens") or {}).get("PEER", 0) == 0, f"kv usage {kv}")
    ctx.check("the fleet secret never reached the peer", bool(bearers) and all(secret not in h for h in bearers),
              f"{len(bearers)} calls")
    ctx.note(f"B: {kv_line(usage_p)}; C: {kv_line(usage_q)}; A's text {ref_p!r}")


async def _peer_mac(ctx: Ctx, url: str) -> bool:
    return await _counter(ctx, url, "block_mac_failures", "PEER") >= 1


def kv_line(usage: dict[str, Any]) -> str:
    kv = usage.get("kv") or {}
    return f"loaded {kv.get('loaded_tokens')}, recomputed {kv.get('recomputed_tokens')}"
