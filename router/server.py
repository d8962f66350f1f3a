"""Serving the gateway with uvicorn (uvloop + httptools), in a process or inside a test's loop."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import uvicorn

from .app import GatewayAPI
from .config import Config
from .gateway import Gateway


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def uvicorn_config(app: GatewayAPI, cfg: Config, sock_port: int | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=cfg.listen.host,
        port=cfg.listen.port if sock_port is None else sock_port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=cfg.observability.access_log,
        log_level=cfg.observability.log_level.lower(),
        timeout_keep_alive=30,
        backlog=4096,
    )


def serve(cfg: Config) -> int:
    """Run the gateway until SIGINT/SIGTERM (uvicorn handles the signals)."""
    setup_logging(cfg.observability.log_level)
    gw = Gateway(cfg)
    server = uvicorn.Server(uvicorn_config(GatewayAPI(gw), cfg))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 0 if server.started else 1


class _EmbeddedServer(uvicorn.Server):
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
    gw = Gateway(cfg)
    await gw.start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it; without it the default asyncio loop stalls ~40 ms
    # per response here (Nagle against delayed ACKs), which uvloop's transports avoid.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    ucfg = uvicorn.Config(GatewayAPI(gw, manage_lifespan=False), loop="none", http="httptools", lifespan="off",
                          access_log=False, log_level="warning", timeout_keep_alive=30)
    server = _EmbeddedServer(ucfg)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        if ready_timeout is not None:
            assert gw.pool is not None
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
