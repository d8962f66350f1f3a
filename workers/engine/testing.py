"""Helpers for the engine's tier tests and benchmarks: a throwaway redis-server.

Not imported by the engine itself. `RedisServer` runs `redis-server` on a free loopback
port without persistence; `pause`/`resume` (SIGSTOP/SIGCONT) make it a server that
accepts connections and never answers (a slow Redis), `stop` a dead one.
"""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def redis_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        found = binary or redis_binary()
        if found is None:
            raise FileNotFoundError("redis-server is not on PATH")
        self.binary = found
        self.workdir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=2)

    def keys(self, prefix: str) -> set[bytes]:
        """Block keys (32 bytes) stored under a `RedisStore` prefix `<namespace>:<group>:`."""
        out = set()
        for name in self.client().scan_iter(match=prefix + "*", count=1000):
            tail = name[len(prefix):]
            out.add(bytes.fromhex(tail.decode()))
        return out
