"""Serving the gateway with uvicorn (uvloop + httptools, heads bounded by router/api/edge.py), in a process or
inside a test's loop."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
import uvloop

from .api.admin import apply_change
from .api.app import GatewayAPI
from .api.edge import HeadLimits, protocol_class
from .config import Config, ConfigError, load_config
from .fleet.replica_sync import ReplicaSync
from .gateway import Gateway
from .telemetry.logs import setup_logging

log = logging.getLogger("kvroute.server")


def uvicorn_config(app: GatewayAPI, cfg: Config, sock_port: int | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=cfg.listen.host,
        port=cfg.listen.port if sock_port is None else sock_port,
        loop="uvloop",
        http=protocol_class(head_limits(cfg)),
        lifespan="on",
        access_log=cfg.observability.access_log,
        log_level=cfg.observability.log_level.lower(),
        timeout_keep_alive=math.ceil(cfg.listen.idle_timeout_s),
        backlog=4096,
    )


def head_limits(cfg: Config) -> HeadLimits:
    """What a connection may send before it is a request (router/api/edge.py), from `listen`."""
    li = cfg.listen
    return HeadLimits(li.max_request_line_bytes, li.max_header_count, li.max_header_bytes, li.header_timeout_s,
                      li.idle_timeout_s)


def serve(cfg: Config, config_path: str | Path | None = None, reuse_port: bool = False,
          overrides: Callable[[Config], None] | None = None, sync: tuple[Path, int, int] | None = None) -> int:
    """Run the gateway until SIGINT/SIGTERM: SIGTERM stops gracefully (router/config.py
    ShutdownConfig), SIGHUP re-reads `config_path` (its worker list applies now).
    `reuse_port`: bind with SO_REUSEPORT, one of several processes on one port.
    `overrides`: the command line's changes to a config read from the file (`cfg` has them
    already), applied again to every re-read one.
    `sync`: (folder, this process's index, processes) under `--processes`: admin changes
    shared with the others (router/fleet/replica_sync.py)."""
    obs = cfg.observability
    setup_logging(obs.log_level, obs.log_format, obs.access_log)  # for the gateway's start
    hup: Any = None
    replicas = None if sync is None else \
        (lambda gw: ReplicaSync(sync[0], sync[1], sync[2], functools.partial(apply_change, gw)))

    async def run() -> bool:
        nonlocal hup
        try:
            gw = await Gateway.create(cfg, replicas)
        except Exception:
            log.exception("the gateway failed to start")
            return False
        ucfg = uvicorn_config(GatewayAPI(gw), cfg)
        setup_logging(obs.log_level, obs.log_format, obs.access_log)  # after uvicorn set up its own
        server = GatewayServer(ucfg, gw, cfg.shutdown.grace_s, Path(config_path) if config_path else None, overrides)
        sockets = [listen_socket(cfg.listen.host, cfg.listen.port, reuse_port)] if reuse_port else None
        hup = signal.signal(signal.SIGHUP, server.handle_hup) if config_path else None
        # What startup built (modules, tokenizers, the config, the pool) lives as long as
        # the process: kept out of the cycle collector's full passes, which would walk it
        # every time.
        gc.collect()
        gc.freeze()
        try:
            await server.serve(sockets=sockets)
        finally:
            await gw.close()  # done by the app's lifespan unless the server never started
        return server.started

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # uvicorn_config's loop
            started = runner.run(run())
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        started = True
    finally:
        if hup is not None:
            signal.signal(signal.SIGHUP, hup)
    return 0 if started else 1


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound TCP socket (uvicorn listens on it); with SO_REUSEPORT the kernel spreads
    connections over every process bound to the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class ReadBeforeClose(uvicorn.Server):
    """uvicorn's shutdown, with a pause between closing the listeners and shutting the
    connections down. uvicorn closes a connection with no request in progress at once; one
    accepted a moment before, whose request is already in its socket but not yet read, is
    then reset (the unread bytes make the close an RST) and the client loses a request the
    gateway never saw. After the pause its request is being handled, and the shutdown
    only stops its keep-alive."""

    READ_PAUSE_S = 0.05

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await asyncio.sleep(self.READ_PAUSE_S)
        await super().shutdown(sockets)


class DrainingServer(ReadBeforeClose):
    """A shutdown whose drain ends the gateway's way: when `drain_s` has passed, every
    request still in flight ends its own response (router/fleet/drain.py: an SSE error event
    and a terminated body, or a 503), and the server waits for them. uvicorn's own end
    of a drain — cancelling the handlers, which cuts their streams and logs a traceback
    each — is kept only as a backstop, `END_S` later."""

    END_S = 3.0

    def __init__(self, config: uvicorn.Config, gw: Gateway, drain_s: float) -> None:
        config.timeout_graceful_shutdown = int(math.ceil(drain_s + self.END_S))
        super().__init__(config)
        self.gw = gw
        self.drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        end = asyncio.get_running_loop().call_later(self.drain_s, self._end_drain)
        try:
            await super().shutdown(sockets)
        finally:
            end.cancel()

    def _end_drain(self) -> None:
        n = self.gw.inflight.end_all()
        if n:
            log.warning("drain timeout (%.1f s) ended: %d request(s) in flight end with an error", self.drain_s, n)


class GatewayServer(DrainingServer):
    """uvicorn with the gateway's signals. Handlers only set flags (they run between
    bytecodes of whatever was running); `on_tick`, every 0.1 s on the loop, acts on them."""

    def __init__(self, config: uvicorn.Config, gw: Gateway, grace_s: float, config_path: Path | None,
                 overrides: Callable[[Config], None] | None = None) -> None:
        super().__init__(config, gw, gw.cfg.shutdown.drain_timeout_s)
        self.grace_s = grace_s
        self.config_path = config_path
        self.overrides = overrides
        self._stop_at: float | None = None
        self._hup = False
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.gw.stopping = True
        if sig != signal.SIGTERM:  # Ctrl-C: uvicorn's way (a second one forces the exit)
            super().handle_exit(sig, frame)
        elif self._stop_at is None and not self.should_exit:
            self._stop_at = time.monotonic() + self.grace_s  # not ready now; stop taking requests later
        else:  # a second SIGTERM: stop taking requests now. Not recorded: the exit stays clean (code 0)
            self.should_exit = True

    def handle_hup(self, sig: int, frame: FrameType | None) -> None:
        self._hup = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers, without its re-raising of the signal once the graceful stop
        is done: raised inside the event loop, a Ctrl-C cancels what is still closing (the
        app's lifespan) and logs a traceback for a clean stop."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    async def on_tick(self, counter: int) -> bool:
        if self.gw.stopping and not self._announced:
            self._announced = True
            log.info("stopping: /ready answers 503; requests are taken for %.1f s more, then those in flight "
                     "get %.1f s to finish", self.grace_s if self._stop_at else 0.0, self.drain_s)
        if self._stop_at is not None and time.monotonic() >= self._stop_at:
            self.should_exit = True
        if self.should_exit:  # in flight from now on: what the gateway holds binds now
            self.gw.binder.close()
        if self._hup:
            self._hup = False
            self.gw.spawn(self._reload())
        return await super().on_tick(counter)

    async def _reload(self) -> None:
        assert self.config_path is not None
        try:
            new = await asyncio.to_thread(load_config, self.config_path)
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded, the running one stays: %s", e)
            return
        if self.overrides is not None:  # --host, --port, --replicas: the file does not know them
            self.overrides(new)
        diff = await self.gw.reload(new)
        log.info("SIGHUP: config reloaded from %s", self.config_path, extra={"kv": diff})


class EmbeddedServer(DrainingServer):
    """A uvicorn server inside someone else's loop: signals stay its owner's business."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@asynccontextmanager
async def running_gateway(cfg: Config, *, ready_timeout: float | None = None) -> AsyncIterator[tuple[Gateway, str]]:
    """Start a gateway on the current loop on a free 127.0.0.1 port; yields (gateway, base URL).

    Used by tests and benchmarks: the socket is bound here (port 0) so parallel tests never
    collide, and everything is shut down on exit.
    """
    gw = await Gateway.create(cfg)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it; without it the default asyncio loop stalls ~40 ms
    # per response here (Nagle against delayed ACKs), which uvloop's transports avoid.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    ucfg = uvicorn.Config(GatewayAPI(gw, manage_lifespan=False), loop="none", http=protocol_class(head_limits(cfg)),
                          lifespan="off", access_log=False, log_level="warning",
                          timeout_keep_alive=math.ceil(cfg.listen.idle_timeout_s))
    server = EmbeddedServer(ucfg, gw, cfg.shutdown.drain_timeout_s)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        if ready_timeout is not None:
            await gw.pool.wait_ready(ready_timeout)
        yield gw, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 10)
        except (TimeoutError, Exception):
            task.cancel()
        await gw.close()
        sock.close()
