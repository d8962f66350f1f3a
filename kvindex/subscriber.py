"""One worker's KV-event stream followed into a `PrefixIndex` (the ingest side of a worker).

`WorkerSubscriber` receives the worker's vLLM-style batches, applies them in sequence
order, replays a gap from the worker's replay socket, and when the replay cannot cover it
drops the worker's entries and rebuilds them from what follows, so the index may miss
blocks but never invents them. A lost *last* frame shows no gap (nothing follows it), so
an idle stream, or one the owner suspects, asks the replay socket for anything after the
last applied sequence. `WorkerHealth` is what it counts. Sequence rules and health
fields: docs/ingest.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from .errors import UnknownWorker
from .events import END_SEQ, EventDecodeError, EventDecoder, seq_from_bytes, seq_to_bytes
from .index import PrefixIndex
from .stats import ApplyStats

log = logging.getLogger("kvindex.ingest")  # one logger for the whole ingest path

Buffer = bytes | memoryview


# Index counters exported under another name than `ApplyStats`'s (the rest keep theirs).
_EXPORTED_AS = {"stored": "blocks_stored", "removed": "blocks_removed"}


# How often an idle subscriber wakes to see whether a tail probe is due: each wakeup is a
# pyzmq poll (futures, a poller), a gateway's main idle cost with a few workers.
IDLE_POLL_MS = 1000
# Messages taken per wakeup without waiting: an engine publishes a message per step, and
# one awaited receive each costs more than applying it; bounded so a flood cannot
# starve the event loop.
DRAIN_MAX = 64
IDLE_PROBE_MAX_S = 60.0  # the longest wait between tail probes of an idle stream


@dataclass(slots=True)
class WorkerHealth:
    """Counters of one subscriber (docs/ingest.md describes each exported field)."""

    worker_id: str
    endpoint: str
    replay_endpoint: str | None
    bind: bool
    topic: str
    state: str = "waiting"
    last_seq: int | None = None
    last_event_age_s: float | None = None
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    resyncs: int = 0
    last_resync_reason: str | None = None
    restarts: int = 0
    duplicates: int = 0
    decode_errors: int = 0
    bad_frames: int = 0
    foreign_topic: int = 0
    trusted_digests: bool = False
    unregistered: int = 0
    internal_errors: int = 0
    tail_probes: int = 0  # replays asked for after the last applied sequence (idle or suspected)
    tail_recovered: int = 0  # batches those probes found that the live stream had lost
    applied: ApplyStats = field(default_factory=ApplyStats)  # what the index did with the batches

    def export(self) -> dict[str, Any]:
        """Plain values by name, the index's counters among the subscriber's own."""
        out = asdict(self)
        applied = out.pop("applied")
        out.update({_EXPORTED_AS.get(name, name): v for name, v in applied.items()})
        return out


@dataclass(slots=True)
class _Replay:
    """Outcome of one replay request."""

    batches: list[tuple[int, Buffer]] = field(default_factory=list)
    ok: bool = True  # False: timeout, garbage or too many batches


class WorkerSubscriber:
    """Follows one worker's KV-event stream into the index (sequence rules: docs/ingest.md).

    The socket is created (bound or connected) in the constructor, so a bad
    endpoint fails at once; `start()` then runs the receive loop as a task on the
    running loop. The index must already know `worker_id`; whether its digests are
    trusted (and so decoded lazily) is the index's registration, not an option here.
    """

    def __init__(
        self,
        worker_id: str,
        index: PrefixIndex,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "kv",
        bind: bool = False,
        replay_timeout_s: float = 1.0,
        max_replay_batches: int = 100_000,
        rcv_hwm: int = 100_000,
        max_message_bytes: int = 64 << 20,
        tail_probe_s: float | None = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be positive")
        if tail_probe_s is not None and tail_probe_s <= 0:
            raise ValueError("tail_probe_s must be positive (or None: never probe)")
        self.worker_id = worker_id
        self.index = index
        self._ctx = ctx
        self._topic = topic.encode()
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_s = replay_timeout_s
        self._max_replay = max_replay_batches
        self._clock = clock
        self._decoder = EventDecoder()
        self._lazy_decoder = EventDecoder(lazy=True)
        self._expected: int | None = None  # next sequence to apply; None: no baseline
        self._dup_floor: int | None = None  # live sequences >= this may repeat replayed ones
        self._last_applied_at: float | None = None
        self._catching_up = False
        self._resync_requested = False
        self._tail_probe_s = tail_probe_s
        self._probe_requested = False
        self._last_frame_at = clock()
        # Idle seconds (since the last frame) before the next tail probe, and the current gap.
        self._next_idle_probe_s = self._idle_probe_every_s = tail_probe_s or 0.0
        self.joined = True  # False until the join replay of `start(join=True)` is done
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, rcv_hwm)
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            if bind:
                sock.bind(endpoint)
                endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sock.connect(endpoint)
        except Exception:
            sock.close(linger=0)
            raise
        self._sub = sock
        self._now: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # the same socket, read without futures
        self.endpoint = endpoint  # the bound address in bind mode (resolves `:*` / port 0)
        self.health = WorkerHealth(worker_id, endpoint, replay_endpoint, bind, topic)

    # ------------------------------------------------------------------ lifecycle

    def start(self, *, clear: bool = True, join: bool = False) -> None:
        """Run the receive loop on the running event loop.

        With `clear`, first drops whatever the index holds for this worker: entries
        that no subscriber can vouch for (e.g. left by an earlier subscription). With
        `join`, first asks the replay socket for everything it still holds, so a worker
        that stays quiet is known at once (a gateway restarted next to a warm vLLM).
        """
        if self._task is not None:
            return
        if clear and self.index.has_worker(self.worker_id):
            self.index.clear_worker(self.worker_id)
        self.joined = not (join and self._replay_endpoint is not None)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-ingest:{self.worker_id}")

    async def close(self) -> None:
        """Stop the loop and close the socket."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._sub.close(linger=0)
        self.health.state = "stopped"

    def request_resync(self) -> None:
        """Drop this worker's entries and rebuild them from the publisher's replay buffer."""
        if self._catching_up:
            self._resync_requested = True
        else:
            self._drop("requested")

    def request_probe(self) -> None:
        """Ask the replay socket soon for anything after the last applied sequence (the
        owner suspects a lost frame, e.g. the worker's reported cache disagrees)."""
        self._probe_requested = True

    def snapshot(self) -> dict[str, Any]:
        h = self.health
        h.trusted_digests = self.index.trusts_digests(self.worker_id)
        h.last_event_age_s = None if self._last_applied_at is None else self._clock() - self._last_applied_at
        return h.export()

    # ------------------------------------------------------------------ receive loop

    async def _run(self) -> None:
        sub = self._sub
        if not self.joined:
            try:
                await self._catch_up(0, 0)
            finally:
                self.joined = True
        while not self._closed:
            try:
                if not await sub.poll(IDLE_POLL_MS):  # idle: maybe probe the tail, then wait again
                    await self._maybe_probe()
                    continue
                await self._drain()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if self._closed or e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                self.health.internal_errors += 1
                log.warning("kv-ingest %s: receive failed: %s", self.worker_id, e)
                await asyncio.sleep(0.1)
                continue
            await asyncio.sleep(0)  # a flood of ready messages must not starve the loop

    async def _drain(self) -> None:
        """Apply the messages that are ready (DRAIN_MAX at most), none awaited."""
        for _ in range(DRAIN_MAX):
            try:
                frames = self._now.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                await self.on_frames([f.buffer for f in frames])
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one message stop ingestion
                self.health.internal_errors += 1
                log.exception("kv-ingest %s: unexpected error on a message", self.worker_id)

    async def on_frames(self, frames: Sequence[Buffer]) -> None:
        """Handle one live message (exposed for tests: frames as received)."""
        h = self.health
        self._last_frame_at = self._clock()
        self._next_idle_probe_s = self._idle_probe_every_s = self._tail_probe_s or 0.0
        if len(frames) != 3:
            h.bad_frames += 1
            return
        topic, seq_frame, payload = frames
        if self._topic and bytes(topic) != self._topic:
            h.foreign_topic += 1
            return
        try:
            seq = seq_from_bytes(seq_frame)
        except ValueError:
            h.bad_frames += 1
            return
        if seq < 0:
            h.bad_frames += 1
            return
        if self._expected is not None and seq < self._expected:
            if self._dup_floor is not None and seq >= self._dup_floor:
                h.duplicates += 1
                return
            h.restarts += 1
            self._drop("publisher restarted")
        if self._expected is None:
            if seq > 0 and self._replay_endpoint is not None:
                await self._catch_up(0, seq)
        elif seq > self._expected:
            h.gaps += 1
            await self._catch_up(self._expected, seq)
        if self._expected is not None:
            if seq < self._expected:
                h.duplicates += 1  # the replay already applied it
                return
            if seq > self._expected:  # a replay that did not reach this far
                self._drop("gap not covered by the replay")
        self._apply(seq, payload)
        self._dup_floor = None  # live has passed everything a replay returned
        h.state = "live"

    async def _maybe_probe(self) -> None:
        """An idle stream is probed `tail_probe_s` after its last frame, then at doubling
        intervals while the probes find nothing (up to IDLE_PROBE_MAX_S): a lost last frame
        is found within seconds, and an idle fleet is not asked every few seconds forever."""
        base = self._tail_probe_s
        idle = self._clock() - self._last_frame_at
        due = base is not None and idle >= self._next_idle_probe_s
        if self._probe_requested or due:
            self._probe_requested = False
            found = await self.probe_tail()
            if due and base is not None:
                every = base if found else min(max(base, IDLE_PROBE_MAX_S), 2.0 * self._idle_probe_every_s)
                self._idle_probe_every_s = every
                self._next_idle_probe_s = idle + every

    async def probe_tail(self) -> int:
        """Replay from the next expected sequence: batches there are ones the live stream
        lost after its last frame (no later frame revealed the gap). Applies them and
        returns how many; 0 when nothing was missing, or no replay is possible."""
        start = self._expected
        if self._replay_endpoint is None or self._catching_up:
            return 0
        h = self.health
        h.tail_probes += 1
        if start is None:  # nothing arrived live yet (frames sent before the subscription took)
            before = h.batches
            await self._catch_up(0, 0)
            h.tail_recovered += h.batches - before
            return h.batches - before
        self._catching_up = True
        try:
            replay = await self._fetch_replay(start)
            if not replay.ok:
                h.replay_failures += 1
                return 0
            batches = sorted((b for b in replay.batches if b[0] >= start), key=lambda b: b[0])
            for seq, payload in batches:
                if self._expected is not None and seq > self._expected:
                    self._drop("hole in the replay")
                self._apply(seq, payload)
            if batches:
                h.tail_recovered += len(batches)
                self._dup_floor = start  # the lost frames, should they arrive late, are duplicates
                log.info("kv-ingest %s: %d batch(es) after seq %d were lost live, recovered by replay",
                         self.worker_id, len(batches), start - 1)
            return len(batches)
        finally:
            self._catching_up = False
            if self._resync_requested:
                self._resync_requested = False
                self._drop("requested")

    # ------------------------------------------------------------------ internals

    def _apply(self, seq: int, payload: Buffer) -> None:
        h = self.health
        self._expected = seq + 1
        h.last_seq = seq
        h.batches += 1
        dec = self._lazy_decoder if self.index.trusts_digests(self.worker_id) else self._decoder
        try:
            batch = dec.decode(payload)
        except EventDecodeError:
            h.decode_errors += 1
            return
        try:
            st = self.index.apply(self.worker_id, batch)
        except UnknownWorker:  # the owner removed the worker from the index before stopping us
            h.unregistered += 1
            return
        h.events += len(batch.events)
        h.applied.add(st)
        if st.digest_mismatches:
            log.warning(
                "kv-ingest %s: published block hashes differ from the keys recomputed from their tokens "
                "(namespace drift: model revision, dtype, block size?); entries dropped, keys recomputed "
                "from now on",
                self.worker_id,
            )
        self._last_applied_at = self._clock()

    def _drop(self, reason: str) -> None:
        """Forget everything known about this worker; the stream rebuilds it."""
        if self.index.has_worker(self.worker_id):
            self.index.clear_worker(self.worker_id)
        self._expected = None
        self._dup_floor = None
        self.health.resyncs += 1
        self.health.last_resync_reason = reason
        log.info("kv-ingest %s: entries dropped (%s)", self.worker_id, reason)

    async def _catch_up(self, start: int, trigger_seq: int) -> None:
        """Replay from `start` and apply what comes back; drop state it cannot cover."""
        joining = self._expected is None
        h = self.health
        if self._replay_endpoint is None:
            if not joining:
                self._drop("gap and no replay endpoint")
            return
        self._catching_up = True
        h.state = "replaying"
        h.replays += 1
        try:
            replay = await self._fetch_replay(start)
            if not replay.ok:
                h.replay_failures += 1
            batches = sorted(replay.batches, key=lambda b: b[0]) if replay.ok else []
            if not joining and (not batches or batches[0][0] != start):
                self._drop("replay cannot cover the gap" if replay.ok else "replay failed")
            t0 = time.monotonic()
            for seq, payload in batches:
                if self._expected is not None:
                    if seq < self._expected:
                        continue
                    if seq > self._expected:
                        self._drop("hole in the replay")
                self._apply(seq, payload)
                if time.monotonic() - t0 > 0.02:  # long replays share the loop
                    await asyncio.sleep(0)
                    t0 = time.monotonic()
            self._dup_floor = trigger_seq
        finally:
            self._catching_up = False
            h.state = "live"
            if self._resync_requested:
                self._resync_requested = False
                self._drop("requested")

    async def _fetch_replay(self, start: int) -> _Replay:
        """Ask the publisher's ROUTER for every buffered batch from `start` on.

        Accepts vLLM's replies `[b"", seq, payload]`, the same without the empty
        delimiter, and TensorRT-LLM's `[b"", topic, seq, payload]`.
        """
        assert self._replay_endpoint is not None
        out = _Replay()
        sock = self._ctx.socket(zmq.DEALER)  # a fresh socket: no late reply to an old request
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._replay_endpoint)
            await sock.send_multipart([b"", seq_to_bytes(start)])
            timeout_ms = int(self._replay_timeout_s * 1000)
            while True:
                if not await sock.poll(timeout_ms):  # readable (POLLIN, the default flags)
                    out.ok = False  # timed out: nothing, or no end marker
                    return out
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:
                    frames = frames[1:]
                if len(frames) != 2:
                    self.health.bad_frames += 1
                    continue
                try:
                    seq = seq_from_bytes(frames[0])
                except ValueError:
                    self.health.bad_frames += 1
                    continue
                if seq == END_SEQ:
                    return out
                if seq < 0:
                    self.health.bad_frames += 1
                    continue
                if len(out.batches) >= self._max_replay:
                    out.ok = False
                    out.batches = []
                    return out
                out.batches.append((seq, frames[1]))
        except zmq.ZMQError as e:
            log.warning("kv-ingest %s: replay from %s failed: %s", self.worker_id, self._replay_endpoint, e)
            out.ok = False
            return out
        finally:
            sock.close(linger=0)
