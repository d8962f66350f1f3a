"""N simulated workers in one process: one asyncio loop, one uvicorn server each.

Used by `python -m workers.cli sim-cluster` and by tests. Each worker gets its own
SimEngine, KV-event publisher (PUB + replay ROUTER on one shared ZMQ context) and HTTP
app (workers/app.py, the same app the real engine will use). Workers of a remote group
share one `RemoteStore` object, and all share one tokenizer (the profile's folder, or
the one given). Ports: HTTP `base_port + i` (0 = any free port), events
`events_base_port + 2i` and replay `+ 2i + 1` (None = any free port); the bound
addresses are in each `WorkerHandle` and in the worker's /info.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import uvicorn
import zmq.asyncio

from kvwire import EventsInfo
from workers.app import build_app
from workers.publisher import KVEventPublisher
from workers.sim.driver import SimDriver
from workers.sim.engine import SimEngine
from workers.sim.profile import SimProfile
from workers.sim.remote import RemoteStore
from workers.tokenizer import SimTokenizer

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner (many share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str
    url: str
    port: int
    events_endpoint: str
    replay_endpoint: str | None
    remote_group: str | None
    driver: SimDriver
    publisher: KVEventPublisher
    server: _Server
    task: asyncio.Task[None] | None = None

    @property
    def engine(self) -> SimEngine:
        return self.driver.engine

    def ready_line(self) -> str:
        return (
            f"worker {self.worker_id} url={self.url} events={self.events_endpoint} "
            f"replay={self.replay_endpoint or '-'} remote_group={self.remote_group or '-'}"
        )


def _bind(host: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio only sets TCP_NODELAY on connections when it does, and
    # without it every streamed token after the headers waits ~40 ms for a delayed ACK
    s = socket.socket(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    s.listen(2048)
    s.setblocking(False)
    return s


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class SimCluster:
    def __init__(
        self,
        workers: int,
        profile: SimProfile,
        *,
        host: str = "127.0.0.1",
        base_port: int = 0,
        events_base_port: int | None = None,
        remote_groups: int = 0,
        max_waiting: int | None = None,
        block_size: int | None = None,
        peer_token: str | None = None,
        id_prefix: str = "w",
        topic: str = "kv",
        arrival_log: str | None = None,
        tokenizer: str | Path | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("--workers must be at least 1")
        if remote_groups < 0 or remote_groups > workers:
            raise ValueError("--remote-groups must be between 0 and the number of workers")
        if remote_groups and profile.remote is None:
            raise ValueError(f"profile {profile.name!r} has no remote tier; use --remote-groups 0")
        self.n = workers
        self.profile = profile.with_block_size(block_size) if block_size else profile
        self.host = host
        self.base_port = base_port
        self.events_base_port = events_base_port
        self.remote_groups = remote_groups
        self.max_waiting = max_waiting
        self.peer_token = peer_token
        self.id_prefix = id_prefix
        self.topic = topic
        self.arrival_log = arrival_log
        self.tokenizer = SimTokenizer(tokenizer if tokenizer is not None else self.profile.tokenizer_dir())
        self._arrivals: TextIO | None = None
        self.workers: list[WorkerHandle] = []
        self.stores: list[RemoteStore] = []
        self._ctx: zmq.asyncio.Context | None = None

    async def start(self) -> list[WorkerHandle]:
        p = self.profile
        self._ctx = zmq.asyncio.Context()
        if self.remote_groups:
            cap = p.tier_blocks(p.remote)
            self.stores = [RemoteStore(f"rg{g}", cap, p.block_size) for g in range(self.remote_groups)]
        peers: dict[str, SimEngine] = {}
        if self.arrival_log:
            self._arrivals = open(self.arrival_log, "a", buffering=1)  # noqa: SIM115 (closed in stop)
        try:
            for i in range(self.n):
                wid = f"{self.id_prefix}{i}"
                if self.events_base_port is None:
                    ev = f"tcp://{self.host}:*"
                    rp = f"tcp://{self.host}:*"
                else:
                    ev = f"tcp://{self.host}:{self.events_base_port + 2 * i}"
                    rp = f"tcp://{self.host}:{self.events_base_port + 2 * i + 1}"
                pub = KVEventPublisher(ev, rp, topic=self.topic, buffer=p.event_replay_buffer, ctx=self._ctx)
                pub.start()
                store = self.stores[i * len(self.stores) // self.n] if self.stores else None
                engine = SimEngine(wid, p, remote=store, on_events=pub.publish, max_waiting=self.max_waiting)
                driver = SimDriver(engine, peers=peers, peer_token=self.peer_token, tokenizer=self.tokenizer)
                driver.publisher_stats = pub
                driver.on_arrival = self._log_arrival if self.arrival_log else None
                await driver.start()
                sock = _bind(self.host, self.base_port + i if self.base_port else 0)
                port = sock.getsockname()[1]
                url = _url(self.host, port)
                peers[wid] = engine
                peers[url] = engine
                app = build_app(
                    driver,
                    url=url,
                    events=EventsInfo(pub.endpoint, pub.replay_endpoint, self.topic),
                    peer_token=self.peer_token,
                )
                cfg = uvicorn.Config(
                    app,
                    http="httptools",
                    lifespan="off",
                    access_log=False,
                    log_level="warning",
                    timeout_graceful_shutdown=2,
                    # longer than any client pool's idle time, so a pooled connection is not
                    # closed under a request that is being sent on it
                    timeout_keep_alive=120,
                )
                server = _Server(cfg)
                h = WorkerHandle(wid, url, port, pub.endpoint, pub.replay_endpoint,
                                 store.name if store is not None else None, driver, pub, server)
                self.workers.append(h)
                h.task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
            for h in self.workers:
                while not h.server.started:
                    if h.task is not None and h.task.done():
                        h.task.result()
                        raise RuntimeError(f"worker {h.worker_id} failed to start")
                    await asyncio.sleep(0.01)
        except BaseException:
            await self.stop()
            raise
        return self.workers

    async def stop(self) -> None:
        """Drain: requests in flight end with an explicit error event, then the servers stop."""
        for h in self.workers:
            await h.driver.close()
        await asyncio.sleep(0)  # let the failed streams write their error events
        for h in self.workers:
            h.server.should_exit = True
        for h in self.workers:
            if h.task is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await h.task
        for h in self.workers:
            await h.publisher.close()
        self.workers = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._arrivals is not None:
            self._arrivals.close()
            self._arrivals = None

    def _log_arrival(self, worker_id: str, request_id: str, t: float, prompt_tokens: int) -> None:
        """One line per accepted request: `monotonic_s worker_id request_id prompt_tokens`."""
        if self._arrivals is not None:
            self._arrivals.write(f"{t:.6f} {worker_id} {request_id} {prompt_tokens}\n")
