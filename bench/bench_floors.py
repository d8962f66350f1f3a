"""CPU floors for the gateway's traffic: what a Python process spends when it does (almost) nothing.

The load is bench_router_cpu.py's short-stream load (streaming chat, 300 requests/s,
`max_tokens` 8), driven by its load generator, and CPU per request is measured the same
way (the process tree's utime + stime over the window, divided by the requests). Two
comparisons, each in interleaved rounds:

1. In front of the same simulated fleet (4 H200 workers): a byte splice (each client
   connection spliced to one worker connection, round robin; uvloop protocols, nothing
   parsed) against kvroute `kv_cost`. The splice is the I/O floor of any Python relay.
2. No workers: a trivial SSE server that answers every request with 10 events 5 ms apart,
   once as a raw asyncio protocol (httptools) and once as an ASGI app under uvicorn (its
   defaults here: uvloop, httptools). The difference is uvicorn's per-request cost.

Results and what they mean: bench/notes/performance.md ("Floors and alternatives").
Everything listens on 127.0.0.1 and is stopped at exit.

    .venv/bin/python bench/bench_floors.py [--rounds 3] [--seconds 12]
    .venv/bin/python bench/bench_floors.py --max-tokens 512 --rate 20 --seconds 10 --with-sglang --fleet-only
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import bench_router_cpu as rc  # noqa: E402

from loadtest.ports import free_port  # noqa: E402
from router.api.asgi import read_body  # noqa: E402

_CHUNK = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
          b'"delta":{"content":"tok "},"finish_reason":null}]}\n\n')
_DONE = b"data: [DONE]\n\n"
_EVENTS = 9
_GAP_S = 0.005


# ------------------------------------------------------------------------------ the servers


class _Up(asyncio.Protocol):
    """The worker side of one spliced connection."""

    def __init__(self, down: _Down) -> None:
        self.down = down
        self.t: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        if self.down.t is not None:
            self.down.t.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.down.t is not None:
            self.down.t.close()


class _Down(asyncio.Protocol):
    """The client side: bytes go to its worker connection as they come."""

    def __init__(self, targets: Any) -> None:
        self.targets = targets
        self.up: _Up | None = None
        self.early: list[bytes] = []
        self.t: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        host, port = next(self.targets)
        asyncio.get_running_loop().create_task(self._connect(host, port))

    async def _connect(self, host: str, port: int) -> None:
        _, up = await asyncio.get_running_loop().create_connection(lambda: _Up(self), host, port)
        self.up = up
        for d in self.early:
            assert up.t is not None
            up.t.write(d)
        self.early = []

    def data_received(self, data: bytes) -> None:
        if self.up is None or self.up.t is None:
            self.early.append(data)
        else:
            self.up.t.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.t is not None:
            self.up.t.close()


class _Trivial(asyncio.Protocol):
    """The trivial SSE answer as a raw protocol."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.t: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self._answer(body))

    async def _answer(self, body: bytes) -> None:
        json.loads(body)
        t = self.t
        assert t is not None
        t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(_EVENTS):
            await asyncio.sleep(_GAP_S)
            t.write(b"%x\r\n%s\r\n" % (len(_CHUNK), _CHUNK))
        t.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(_DONE), _DONE))


async def _trivial_asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The same answer as an ASGI app."""
    if scope["type"] != "http":
        return
    json.loads(await read_body(receive, 1 << 20, None))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(_EVENTS):
        await asyncio.sleep(_GAP_S)
        await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": _DONE, "more_body": False})


def _serve(mode: str, port: int, upstreams: list[str]) -> int:
    import uvloop

    if mode == "uvicorn":
        import uvicorn

        uvicorn.run(_trivial_asgi, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                    lifespan="off", log_level="warning", access_log=False)
        return 0
    targets = itertools.cycle([(u.split("//")[1].split(":")[0], int(u.rsplit(":", 1)[1])) for u in upstreams])
    factory = (lambda: _Down(targets)) if mode == "splice" else _Trivial

    async def main() -> None:
        srv = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", port, backlog=4096)
        await srv.serve_forever()

    uvloop.run(main())
    return 0


# ------------------------------------------------------------------------------ running


def _server(procs: rc.Procs, mode: str, upstreams: list[str]) -> rc.Target:
    port = free_port()
    p = procs.start([sys.executable, str(Path(__file__).resolve()), "--serve", mode, str(port), *upstreams], None)
    return rc.Target(mode, f"http://127.0.0.1:{port}", p)


def _rounds(targets: list[rc.Target], workers: list[str], rounds: int, seconds: float, rate: float = 300.0,
            max_tokens: int = 8) -> None:
    base = {"systems": 8, "system_words": 200, "user_words": 40, "request_timeout_s": 60.0, "max_tokens": max_tokens}
    for t in targets:
        rc._drive(t, workers, {**base, "seed": 999, "rate": min(rate, 50.0), "seconds": 2.0})
    for rnd in range(rounds):
        for t in targets if rnd % 2 == 0 else targets[::-1]:
            r = rc._drive(t, workers, {**base, "seed": rnd, "rate": rate, "seconds": seconds})
            print(f"  round {rnd + 1}: {t.name:18s} CPU {r['cpu_us']:7,.0f} µs/req  kernel {100 * r['sys_share']:3.0f}%"
                  f"  TTFT p50 {r['p50'] * 1000:6.1f} ms  errors {sum(r['errors'].values())}", flush=True)
            time.sleep(1.0)


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "--serve":
        return _serve(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--rate", type=float, default=300.0, help="requests/s in front of the fleet")
    ap.add_argument("--max-tokens", type=int, default=8, help="max_tokens in front of the fleet (512: long streams)")
    ap.add_argument("--with-sglang", action="store_true", help="add sglang-router cache_aware in front of the fleet")
    ap.add_argument("--fleet-only", action="store_true", help="skip the trivial SSE servers (comparison 2)")
    a = ap.parse_args()
    procs = rc.Procs()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-floors-") as td:
            workers = rc._start_fleet(procs, 4)
            fleet = [_server(procs, "splice", workers), rc._kvroute(procs, Path(td), "kv_cost", workers)]
            py = rc._peers_python() if a.with_sglang else None
            if py is not None:
                fleet.append(rc._peer(procs, Path(td), py, "sglang", "cache_aware", workers))
            trivial = [] if a.fleet_only else [_server(procs, "raw", []), _server(procs, "uvicorn", [])]
            for t in fleet + trivial:
                if not asyncio.run(rc._ready(t, 90.0)):
                    raise SystemExit(f"{t.name} did not start")
            print(f"1. in front of 4 simulated workers ({a.rate:g} req/s, max_tokens {a.max_tokens}): "
                  + ", ".join(t.name for t in fleet), flush=True)
            _rounds(fleet, workers, a.rounds, a.seconds, a.rate, a.max_tokens)
            if trivial:
                print("2. a trivial SSE server (10 events, 5 ms apart): raw protocol and uvicorn", flush=True)
                _rounds(trivial, [], a.rounds, a.seconds)
    finally:
        procs.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
