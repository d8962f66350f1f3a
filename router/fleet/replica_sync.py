"""Admin changes reach every process of `kvroute serve --processes N`.

The kernel hands each connection to one process (SO_REUSEPORT), so an admin call
changes one replica: a drained worker stayed routable in the others. Each process
therefore listens on a Unix socket in a folder only its user can enter (made by the
supervisor, router/processes.py); the process that took the admin call applies it,
appends it to a journal in that folder, sends it to every other process and answers
once each has applied it (or could not be reached within `ACK_TIMEOUT_S`). A process
that starts later (the supervisor restarts one that died) replays the journal before
it serves, so it holds the same worker changes as the others.

One change is one JSON line, `{"op": ..., "arg": ...}`; the peer answers a line
`{"ok": true}` or `{"ok": false, "error": ...}`. Applying is idempotent where the
journal and a live message can meet (adding a worker that exists, removing one that
does not).
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

import msgspec

log = logging.getLogger("kvroute.replicas")

ACK_TIMEOUT_S = 10.0
MAX_LINE = 1 << 20
JOURNAL = "admin-journal.jsonl"
# A purge is sent to the live processes only: replayed later it would drop what the
# tenant cached since.
JOURNALED = frozenset({"add", "remove", "drain", "undrain"})


class AdminChange(msgspec.Struct, frozen=True):
    op: Literal["add", "remove", "drain", "undrain", "purge"]
    arg: str  # a worker id, a tenant id, or (add) the worker's config as JSON


Apply = Callable[[AdminChange], Awaitable[None]]
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(AdminChange)


class ReplicaSync:
    """This process's end: its socket, the journal, the fan-out (module doc)."""

    def __init__(self, folder: Path, index: int, n: int, apply: Apply) -> None:
        self.folder = folder
        self.index = index
        self.n = n
        self.apply = apply
        self._server: asyncio.AbstractServer | None = None
        self._lock = asyncio.Lock()  # one change at a time leaves this process, in journal order

    def _socket(self, i: int) -> Path:
        return self.folder / f"{i}.sock"

    async def start(self) -> None:
        """Listen first, then replay: a change is then either in the journal read or sent here."""
        path = self._socket(self.index)
        path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=MAX_LINE)
        for change in self._journal():
            try:
                await self.apply(change)
            except Exception as e:  # one that no longer applies (its worker was removed since)
                log.info("admin journal: %s %s not replayed: %s", change.op, change.arg[:80], e)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._socket(self.index).unlink(missing_ok=True)

    def _journal(self) -> list[AdminChange]:
        try:
            with (self.folder / JOURNAL).open("rb") as f:
                fcntl.flock(f, fcntl.LOCK_SH)
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        return [_dec.decode(ln) for ln in lines if ln.strip()]

    async def publish(self, change: AdminChange) -> tuple[int, int]:
        """Record `change` (applied here already) and apply it in every other process.
        Returns (processes that have it, processes)."""
        line = _enc.encode(change) + b"\n"
        async with self._lock:
            if change.op in JOURNALED:
                await asyncio.to_thread(self._append, line)
            others = [i for i in range(self.n) if i != self.index]
            acks = await asyncio.gather(*(self._send(i, line) for i in others))
        failed = [i for i, ok in zip(others, acks, strict=True) if not ok]
        if failed:
            log.warning("admin change %s %s not confirmed by process(es) %s: they apply it from the journal "
                        "when they start", change.op, change.arg[:80], failed)
        return self.n - len(failed), self.n

    def _append(self, line: bytes) -> None:
        with (self.folder / JOURNAL).open("ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line)
            f.flush()

    async def _send(self, i: int, line: bytes) -> bool:
        try:
            async with asyncio.timeout(ACK_TIMEOUT_S):
                r, w = await asyncio.open_unix_connection(str(self._socket(i)), limit=MAX_LINE)
                try:
                    w.write(line)
                    await w.drain()
                    answer = msgspec.json.decode(await r.readline())
                finally:
                    w.close()
        except (OSError, TimeoutError, msgspec.DecodeError):
            return False
        if not answer.get("ok"):
            log.warning("process %d could not apply an admin change: %s", i, answer.get("error"))
        return bool(answer.get("ok"))

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            line = await r.readline()
            try:
                await self.apply(_dec.decode(line))
                answer: dict[str, object] = {"ok": True}
            except Exception as e:
                answer = {"ok": False, "error": str(e)[:500]}
            w.write(_enc.encode(answer) + b"\n")
            await w.drain()
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                w.close()
