"""One real-engine worker process: model, engine thread, KV-event publisher, HTTP app.

`python -m workers.cli engine ...` (and `kvroute worker ...`) runs `serve(args)`; tests
use `EngineWorker` in-process. The worker is served by the same app as the simulated
ones (workers/app.py), so the gateway meets one surface, and prints the same ready line
as sim-cluster: `worker ID url=... events=... replay=...`, then `ready`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from kvwire import EventsInfo
from workers.app import build_app
from workers.cluster import _bind, _Server, _url
from workers.publisher import KVEventPublisher

from .engine import TorchEngine

if TYPE_CHECKING:
    from .tiers import TierConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    events_port: int | None = None  # PUB port; replay on +1. None: any free ports
    peer_token: str | None = None
    topic: str = "kv"
    replay_buffer: int = 10000


class EngineWorker:
    """A `TorchEngine` behind the worker HTTP app and a KV-event publisher."""

    def __init__(self, engine: TorchEngine, opts: ServeOptions) -> None:
        self.engine = engine
        self.opts = opts
        self.url = ""
        self.port = 0
        self.publisher: KVEventPublisher | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def worker_id(self) -> str:
        return self.engine.worker_id

    async def start(self) -> None:
        o = self.opts
        if o.events_port is None:
            ev, rp = f"tcp://{o.host}:*", f"tcp://{o.host}:*"
        else:
            ev, rp = f"tcp://{o.host}:{o.events_port}", f"tcp://{o.host}:{o.events_port + 1}"
        pub = KVEventPublisher(ev, rp, topic=o.topic, buffer=o.replay_buffer)
        pub.start()
        self.publisher = pub
        self.engine.on_events = pub.publish
        self.engine.publisher_stats = pub
        try:
            await self.engine.start()
            sock = _bind(o.host, o.port)
            self.port = sock.getsockname()[1]
            self.url = _url(o.host, self.port)
            self.engine.advertised_url = self.url
            app = build_app(
                self.engine,
                url=self.url,
                events=EventsInfo(pub.endpoint, pub.replay_endpoint, o.topic),
                peer_token=o.peer_token,
            )
            cfg = uvicorn.Config(app, http="httptools", lifespan="off", access_log=False, log_level="warning",
                                 timeout_graceful_shutdown=2, timeout_keep_alive=120)
            self._server = _Server(cfg)
            self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                    raise RuntimeError(f"worker {self.worker_id} failed to start")
                await asyncio.sleep(0.01)
        except BaseException:
            await self.stop()
            raise

    def ready_line(self) -> str:
        pub = self.publisher
        events = pub.endpoint if pub is not None else "-"
        replay = pub.replay_endpoint if pub is not None and pub.replay_endpoint else "-"
        tiers = self.engine.core.tiers
        group = tiers.remote_group if tiers is not None and tiers.remote_group else "-"
        return f"worker {self.worker_id} url={self.url} events={events} replay={replay} remote_group={group}"

    async def stop(self) -> None:
        """Requests in flight end with an error event, then the server and the publisher stop."""
        await self.engine.close()
        await asyncio.sleep(0)  # let the failed streams write their error events
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            try:
                await self._task
            except (Exception, asyncio.CancelledError):  # shutting down, whatever happened
                log.debug("worker %s: server ended with an error", self.worker_id, exc_info=True)
            self._task = None
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None


# ---------------------------------------------------------------------- command line


def build_engine(a: argparse.Namespace) -> TorchEngine:
    """Load the model and build the engine the flags describe (imports torch)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # stderr is a log, not a terminal

    from .args import parse_lora_flag
    from .core import EngineCore
    from .engineconfig import EngineConfig
    from .model import ModelSpec, load_model

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    spec = ModelSpec(
        model=a.model,
        model_id=a.model_id,
        revision=a.revision,
        served_names=tuple(a.served_names or ()),
        device=a.device,
        dtype=a.dtype,
        cache_dir=Path(a.cache_dir).expanduser() if a.cache_dir else None,
        loras=tuple(parse_lora_flag(v) for v in getattr(a, "loras", None) or ()),
    )
    cfg = EngineConfig(
        worker_id=a.worker_id,
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        kv_bytes=int(a.kv_bytes) if a.kv_bytes is not None else None,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_waiting=a.max_waiting,
        tiers=tier_config(a),
        role=a.role,
        pd_pin_s=a.pd_pin_s,
    )
    return TorchEngine(EngineCore(load_model(spec), cfg), calibrate=not a.no_calibrate)


def tier_config(a: argparse.Namespace) -> TierConfig | None:
    """The tiers the flags ask for (None: GPU only, no peer token)."""
    from .store.disk import DiskConfig
    from .tiers import TierConfig

    token = peer_token_of(a)
    cpu = a.cpu_bytes
    if cpu is None:
        cpu = float(1 << 30) if (a.disk_dir or a.remote_url) else 0.0
    disk = None
    if a.disk_dir:
        disk = DiskConfig(Path(a.disk_dir).expanduser(), int(a.disk_bytes), segment_bytes=int(a.disk_segment_bytes),
                          admit_after=a.disk_admit_after, max_write_bytes_per_s=a.disk_write_bytes_per_s,
                          fsync=a.disk_fsync)
    remote = None
    if a.remote_url and token is None:
        # Unauthenticated shared KV could be planted by anyone who can write to the server: the
        # worker serves without REMOTE rather than refuse to start (docs/engine.md § Tiers).
        log.warning("REMOTE tier OFF: --remote-url is set but no fleet secret (--peer-token or "
                    "$KVROUTE_PEER_TOKEN) keys the MAC its blocks need; this worker neither reads nor writes it")
    elif a.remote_url:
        from .store.remote import RedisConfig

        u = urllib.parse.urlsplit(a.remote_url)
        db = int(u.path.strip("/") or 0)
        remote = RedisConfig(host=u.hostname or "127.0.0.1", port=u.port or 6379, db=db, username=u.username or None,
                             password=u.password, ssl=u.scheme == "rediss", group=a.remote_group,
                             ttl_s=a.remote_ttl if a.remote_ttl > 0 else None)
    if not cpu and token is None:
        return None
    return TierConfig(cpu_bytes=int(cpu), disk=disk, remote=remote, remote_write=a.remote_write,
                      prefetch_queue=a.prefetch_queue, peer_token=token)


def peer_token_of(a: argparse.Namespace) -> str | None:
    return a.peer_token or os.environ.get("KVROUTE_PEER_TOKEN") or None


async def serve(a: argparse.Namespace) -> int:
    """Run one worker until SIGINT/SIGTERM (the `engine` subcommand)."""
    from .tiny import ModelError

    try:
        engine = await asyncio.to_thread(build_engine, a)
    except (ModelError, ValueError, RuntimeError, OSError) as e:  # RuntimeError: a DISK directory in use
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"engine: {describe(engine)}", file=sys.stderr, flush=True)
    opts = ServeOptions(host=a.host, port=a.port, events_port=a.events_port, peer_token=peer_token_of(a))
    worker = EngineWorker(engine, opts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.start()
    except OSError as e:
        print(f"error: cannot start the worker: {e}", file=sys.stderr)
        return 1
    print(worker.ready_line(), flush=True)
    print("ready", flush=True)
    await stop.wait()
    await worker.stop()
    return 0


def describe(engine: TorchEngine) -> str:
    """One line about what is being served (device, dtype, pool)."""
    core = engine.core
    lm = core.lm
    tiers = core.tiers
    below = ""
    if tiers is not None:
        parts = []
        if tiers.host is not None:
            parts.append(f"CPU {tiers.host.capacity} blocks")
        if tiers.disk is not None and tiers.cfg.disk is not None:
            parts.append(f"DISK {tiers.cfg.disk.path} ({len(tiers.disk_keys)} blocks found)")
        if tiers.remote is not None:
            parts.append(f"REMOTE group {tiers.remote_group}")
        if tiers.cfg.peer_token is not None:
            parts.append("peer pull")
        below = "; tiers: " + ", ".join(parts)
    adapters = f"; LoRA adapters {', '.join(lm.lora.names)}" if lm.lora is not None else ""
    return (f"model {lm.model_id} from {lm.folder} on {lm.device} ({lm.dtype_name}){adapters}; "
            f"KV pool {core.blocks.num_blocks} blocks x {core.bs} tokens ({core.pool.block_bytes} B/block)" + below)
