"""DISK tier: blocks appended to log-structured segment files, indexed in memory.

A directory holds `seg-<16-digit seq>.kv` files and a `LOCK` (flock: one store per
directory). Each block is one record (record.py) appended to the newest segment with a
single pwritev; at `segment_bytes` the segment is closed and the next one started. Old
segments are never written again; when the store is over `capacity_bytes`, whole segments
are evicted oldest first (FIFO by write time: blocks that matter keep being re-offloaded
from CPU and so re-written to a newer segment). `discard` is logical: the key leaves the
index and a tombstone is appended so a restart does not bring it back; the bytes go when
their segment is evicted (no compaction).

The index (key -> segment, offset, lengths) is rebuilt at start by reading every header
(and meta) through mmap; payloads are not read unless `verify_on_open`. A torn tail, a bad
magic, a header checksum mismatch or a segment file that vanished is skipped and counted:
after a bad header the scan re-synchronizes on the next magic whose header checksum holds,
and junk at a segment's end is truncated away. `get` re-verifies every record it serves.

Reads open the segment file per call (no shared descriptors: an evicted segment can never
have its fd number reused under a reader, and a file deleted behind our back is noticed).
Writes are serialized by `_wlock`; the index is guarded by `_lock` (taken after `_wlock`
when both are needed) and never held across disk I/O except unlink/open/ftruncate.
Index, segment lifecycle and start-up scan live in one module (~570 lines) because
each must hold the others' invariants under those two locks.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from workers.engine.store.admission import AdmissionFilter, Clock, TokenBucket
from workers.engine.store.base import Record, StoreStats
from workers.engine.store.record import (
    HEADER_SIZE,
    MAGIC,
    CorruptRecord,
    Header,
    RecordError,
    TruncatedRecord,
    check_key,
    encode_header,
    read_header,
    tombstone,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
FsyncPolicy = Literal["never", "close", "segment", "record"]
_SEGMENT_RE = re.compile(r"^seg-(\d{16})\.kv$")


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """DISK tier settings.

    fsync: "never"; "close" (default: the active segment is flushed when the store
    closes; a process crash loses nothing since the page cache survives it, a power loss
    loses the tail, which the scan then truncates); "segment" (also when a segment is
    closed); "record" (after every write: slow, rarely worth it for a cache).
    A record larger than `segment_bytes`, or than the write burst, is always refused.
    """

    path: Path
    capacity_bytes: int
    segment_bytes: int = 64 * MiB
    admit_after: int = 2
    admit_window_s: float = 600.0
    admit_width: int = 1 << 18  # 2 MiB of counters; generations turn every width/4 puts
    max_write_bytes_per_s: float | None = None  # SSD endurance; None: unlimited
    write_burst_bytes: int | None = None  # default: one second of max_write_bytes_per_s
    fsync: FsyncPolicy = "close"
    verify_on_open: bool = False  # also checksum every payload at start (reads everything)

    def __post_init__(self) -> None:
        if self.segment_bytes < HEADER_SIZE or self.capacity_bytes < 2 * self.segment_bytes:
            raise ValueError("need capacity_bytes >= 2 * segment_bytes > 0")
        if self.fsync not in ("never", "close", "segment", "record"):
            raise ValueError(f"unknown fsync policy {self.fsync!r}")


@dataclass(eq=False, slots=True)
class _Segment:
    seq: int
    path: Path
    size: int = 0  # bytes on disk we account for (capacity)
    keys: dict[bytes, None] = field(default_factory=dict)  # live keys, in write order
    fd: int = -1  # write descriptor, while this is the active segment


@dataclass(frozen=True, slots=True, eq=False)
class _Loc:
    seg: _Segment
    offset: int
    meta_len: int
    payload_len: int


class DiskStore:
    """BlockStore over segment files in one directory (see the module docstring)."""

    tier = "DISK"

    def __init__(self, config: DiskConfig, *, on_drop: Callable[[list[bytes]], None] | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.config = config
        self.stats = StoreStats()
        self.on_drop = on_drop
        self._lock = threading.Lock()
        self._wlock = threading.Lock()
        self._index: dict[bytes, _Loc] = {}
        self._segments: dict[int, _Segment] = {}  # seq order, oldest first
        self._active: _Segment | None = None
        self._next_seq = 1  # never reused within a run, so file order is write order
        self._bytes = 0
        self._closed = False
        self._admission = AdmissionFilter(config.admit_after, config.admit_window_s, config.admit_width, clock)
        rate = config.max_write_bytes_per_s
        self._bucket = None
        if rate is not None:
            self._bucket = TokenBucket(rate, config.write_burst_bytes or max(1, int(rate)), clock)
        self._dir = Path(config.path)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self._dir)
        try:
            self._load()
        except BaseException:
            os.close(self._lock_fd)
            raise

    # --- BlockStore -----------------------------------------------------------------

    def put(self, key: bytes, meta: bytes, payload: bytes) -> bool:
        """Append the block unless held already, not yet admitted, over budget or too big."""
        check_key(key)
        size = HEADER_SIZE + len(meta) + len(payload)
        evicted: list[bytes] = []
        try:
            with self._wlock:
                with self._lock:
                    if self._closed:
                        return False
                    if key in self._index:
                        return True
                    if not self._admission.admit(key) or not self._budget(size):
                        self.stats.refused += 1
                        return False
                placed = self._append([encode_header(key, meta, payload), meta, payload], size, evicted)
                if placed is None:
                    return False
                with self._lock:
                    self._index_record(key, _Loc(placed[0], placed[1], len(meta), len(payload)))
                    self.stats.puts += 1
                    self.stats.put_bytes += len(payload)
            return True
        finally:
            self._notify(evicted)  # outside the locks: the callback may call back into the store

    def get(self, key: bytes) -> Record | None:
        """Read and verify the record; any failure is a miss that drops the key."""
        with self._lock:
            self.stats.gets += 1
            loc = None if self._closed else self._index.get(key)
            if loc is None:
                self.stats.misses += 1
                return None
        try:
            record = _read_record(loc, key)
        except FileNotFoundError:
            self._lost_segment(loc.seg)
        except RecordError as err:
            self._drop_bad(key, loc, err.stat)
        except OSError as err:
            log.warning("DISK read of %s failed: %s", loc.seg.path, err)
            self._drop_bad(key, loc, "io_errors")
        else:
            with self._lock:
                self.stats.hits += 1
                self.stats.get_bytes += len(record.payload)
            return record
        with self._lock:
            self.stats.misses += 1
        return None

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def discard(self, keys: Iterable[bytes]) -> int:
        """Forget the keys now; tombstones make it stick across a restart."""
        evicted: list[bytes] = []
        with self._wlock:
            with self._lock:
                held = [k for k in dict.fromkeys(keys) if k in self._index]
                for k in held:
                    self._unindex(k)
                closed = self._closed
            per_batch = max(1, self.config.segment_bytes // HEADER_SIZE)
            for i in range(0, 0 if closed else len(held), per_batch):
                batch = held[i : i + per_batch]
                self._append([b"".join(tombstone(k) for k in batch)], HEADER_SIZE * len(batch), evicted)
        self._notify(evicted)
        return len(held)

    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        """(key, meta) of every block held, read from disk segment by segment."""
        with self._lock:
            items = sorted(self._index.items(), key=lambda kv: (kv[1].seg.seq, kv[1].offset))
        fd, fd_seg = -1, None
        try:
            for key, loc in items:
                if loc.seg is not fd_seg:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    fd_seg = loc.seg
                    try:
                        fd = os.open(loc.seg.path, os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        self._lost_segment(loc.seg)
                        continue
                if fd >= 0:
                    meta = self._scan_meta(fd, key, loc)
                    if meta is not None:
                        yield key, meta
        finally:
            if fd >= 0:
                os.close(fd)

    def close(self) -> None:
        """Flush the active segment (per the fsync policy) and release the directory."""
        with self._wlock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                active, self._active = self._active, None
            if active is not None:
                self._retire_writer(active, sync=self.config.fsync != "never")
            os.close(self._lock_fd)

    # --- introspection (tests, metrics) -----------------------------------------------

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def segment_paths(self) -> list[Path]:
        with self._lock:
            return [s.path for s in self._segments.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # --- writing ----------------------------------------------------------------------

    def _budget(self, size: int) -> bool:
        if size > self.config.segment_bytes:
            return False
        return self._bucket is None or self._bucket.take(size)

    def _append(self, bufs: list[bytes], size: int, evicted: list[bytes]) -> tuple[_Segment, int] | None:
        """Write bufs contiguously at the end of the active segment, after making room (keys
        evicted for it are added to `evicted`). (segment, offset), or None on an I/O error
        (counted). Caller holds _wlock."""
        self._make_room(size, evicted)
        try:
            seg = self._active or self._open_segment()
        except OSError as err:
            self._io_error("creating a segment", err)
            return None
        offset = seg.size
        try:
            _write_all(seg.fd, bufs, offset)
            if self.config.fsync == "record":
                os.fsync(seg.fd)
        except OSError as err:
            self._io_error(f"writing {seg.path}", err)
            self._undo_write(seg, offset, size)
            return None
        with self._lock:
            seg.size = offset + size
            self._bytes += size
        return seg, offset

    def _make_room(self, size: int, evicted: list[bytes]) -> None:
        """Close the active segment if `size` does not fit in it, then evict whole segments,
        oldest first, until `size` fits in capacity. Caller holds _wlock."""
        retired = None
        with self._lock:
            active = self._active
            if active is not None and active.size and active.size + size > self.config.segment_bytes:
                retired, self._active = active, None
            while self._bytes + size > self.config.capacity_bytes:
                oldest = next((s for s in self._segments.values() if s is not self._active), None)
                if oldest is None:
                    break
                evicted += self._evict(oldest)
        if retired is not None:
            self._retire_writer(retired, sync=self.config.fsync == "segment")

    def _evict(self, seg: _Segment) -> list[bytes]:
        """Forget a whole segment and unlink its file. Caller holds _lock."""
        keys = self._forget_segment(seg)
        self.stats.evicted += len(keys)
        try:
            seg.path.unlink(missing_ok=True)
        except OSError as err:
            self.stats.io_errors += 1
            log.warning("DISK could not unlink %s: %s", seg.path, err)
        return keys

    def _forget_segment(self, seg: _Segment) -> list[bytes]:
        keys = list(seg.keys)
        for k in keys:
            del self._index[k]
        seg.keys.clear()
        self._segments.pop(seg.seq, None)
        self._bytes -= seg.size
        return keys

    def _open_segment(self) -> _Segment:
        seq = self._next_seq
        path = self._dir / f"seg-{seq:016d}.kv"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._next_seq += 1
        seg = _Segment(seq, path, fd=fd)
        with self._lock:
            self._segments[seq] = seg
            self._active = seg
        return seg

    def _retire_writer(self, seg: _Segment, *, sync: bool) -> None:
        """Close a segment's write descriptor (fsync first if asked). Caller holds _wlock, not _lock."""
        if seg.fd < 0:
            return
        try:
            if sync:
                os.fsync(seg.fd)
        except OSError as err:
            self._io_error(f"fsync of {seg.path}", err)
        finally:
            os.close(seg.fd)
            seg.fd = -1

    def _undo_write(self, seg: _Segment, offset: int, size: int) -> None:
        """Cut a failed (maybe partial) write off the segment; if even that fails, stop
        writing to it and account for the worst case (the scan cleans it at restart)."""
        try:
            os.ftruncate(seg.fd, offset)
            return
        except OSError as err:
            self._io_error(f"truncating {seg.path}", err)
        with self._lock:
            seg.size = offset + size
            self._bytes += size
            if self._active is seg:
                self._active = None
        self._retire_writer(seg, sync=False)

    def _index_record(self, key: bytes, loc: _Loc) -> None:
        """Point key at loc (last one wins). Caller holds _lock."""
        self._unindex(key)
        self._index[key] = loc
        loc.seg.keys[key] = None

    def _unindex(self, key: bytes) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            old.seg.keys.pop(key, None)

    # --- failures ---------------------------------------------------------------------

    def _drop_bad(self, key: bytes, loc: _Loc, stat: str) -> None:
        """A record that failed to read: count it and drop the key, unless it changed
        meanwhile (evicted, discarded or rewritten: then it was a plain miss)."""
        with self._lock:
            if self._index.get(key) is not loc:
                return
            setattr(self.stats, stat, getattr(self.stats, stat) + 1)
            self.stats.dropped += 1
            self._unindex(key)
        log.warning("DISK dropped block %s: %s in %s", key.hex()[:16], stat, loc.seg.path.name)
        self._notify([key])

    def _lost_segment(self, seg: _Segment) -> None:
        """The segment's file is gone: every key in it is lost."""
        with self._wlock:
            with self._lock:
                if self._segments.get(seg.seq) is not seg:
                    return  # evicted meanwhile: nothing was lost behind our back
                self.stats.io_errors += 1
                keys = self._forget_segment(seg)
                self.stats.dropped += len(keys)
                if self._active is seg:
                    self._active = None
            self._retire_writer(seg, sync=False)
        log.warning("DISK segment %s vanished: %d blocks lost", seg.path.name, len(keys))
        self._notify(keys)

    def _io_error(self, what: str, err: OSError) -> None:
        with self._lock:
            self.stats.io_errors += 1
        level = logging.ERROR if err.errno == errno.ENOSPC else logging.WARNING
        log.log(level, "DISK %s failed: %s", what, err)

    def _notify(self, keys: list[bytes]) -> None:
        if keys and self.on_drop is not None:
            try:
                self.on_drop(keys)
            except Exception:
                log.exception("DISK on_drop callback failed")

    def _scan_meta(self, fd: int, key: bytes, loc: _Loc) -> bytes | None:
        try:
            _, meta = _check_head(_pread_exact(fd, HEADER_SIZE + loc.meta_len, loc.offset), key, loc)
        except RecordError as err:
            self._drop_bad(key, loc, err.stat)
            return None
        except OSError:
            self._drop_bad(key, loc, "io_errors")
            return None
        return meta

    # --- start-up scan ----------------------------------------------------------------

    def _load(self) -> None:
        found = sorted((int(m.group(1)), self._dir / m.group(0))
                       for m in map(_SEGMENT_RE.match, os.listdir(self._dir)) if m)
        for seq, path in found:
            self._next_seq = seq + 1
            seg = _Segment(seq, path)
            try:
                self._load_segment(seg)
            except OSError as err:
                self.stats.io_errors += 1
                log.warning("DISK skipped segment %s: %s", path.name, err)
                for k in list(seg.keys):
                    self._unindex(k)
                continue
            self._segments[seq] = seg
            self._bytes += seg.size
        if self._index:
            log.info("DISK %s: %d blocks in %d segments, %d bytes", self._dir, len(self._index),
                     len(self._segments), self._bytes)

    def _load_segment(self, seg: _Segment) -> None:
        """Index the valid records of one segment; cut junk off its end."""
        with open(seg.path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            end = 0
            if size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    if not self.config.verify_on_open:
                        mm.madvise(mmap.MADV_RANDOM)  # read the header pages, not the payloads around them
                    end = self._index_segment(seg, mm)
            if end < size:
                f.truncate(end)
            seg.size = end

    def _index_segment(self, seg: _Segment, mm: mmap.mmap) -> int:
        """Walk the records; the end of the last valid one."""
        offset, size = 0, len(mm)
        while offset < size:
            try:
                head = self._parse_at(mm, offset)
            except RecordError as err:
                resumed = self._resync(mm, offset + 1)
                if resumed is None:
                    setattr(self.stats, err.stat, getattr(self.stats, err.stat) + 1)
                    log.warning("DISK %s: %s at %d, %d bytes cut", seg.path.name, err.stat, offset, size - offset)
                    return offset
                self.stats.checksum_errors += 1
                log.warning("DISK %s: bad record at %d, skipped to %d", seg.path.name, offset, resumed)
                offset = resumed
                continue
            if head.tombstone:
                self._unindex(head.key)
            else:
                self._index_record(head.key, _Loc(seg, offset, head.meta_len, head.payload_len))
            offset += head.size
        return offset

    def _parse_at(self, mm: mmap.mmap, offset: int) -> Header:
        head = read_header(mm, offset)
        meta_end = offset + HEADER_SIZE + head.meta_len
        if meta_end > len(mm):
            raise TruncatedRecord("meta past the end")
        meta = mm[offset + HEADER_SIZE : meta_end]
        head.check_head(meta)
        if offset + head.size > len(mm):
            raise TruncatedRecord("payload past the end")
        if self.config.verify_on_open:
            head.check_body(meta, mm[meta_end : offset + head.size])
        return head

    def _resync(self, mm: mmap.mmap, start: int) -> int | None:
        """The offset of the next record whose header verifies, if any."""
        pos = mm.find(MAGIC, start)
        while pos >= 0:
            try:
                self._parse_at(mm, pos)
                return pos
            except RecordError:
                pos = mm.find(MAGIC, pos + 1)
        return None


def _lock_directory(path: Path) -> int:
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"{path} is in use by another DiskStore") from None
    return fd


def _write_all(fd: int, bufs: list[bytes], offset: int) -> None:
    """One pwritev; a short write (rare on regular files) resumes where it stopped."""
    total = sum(len(b) for b in bufs)
    done = os.pwritev(fd, bufs, offset)
    while done < total:
        rest: list[memoryview] = []
        skip = done
        for b in bufs:
            if skip >= len(b):
                skip -= len(b)
                continue
            rest.append(memoryview(b)[skip:])
            skip = 0
        n = os.pwritev(fd, rest, offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no progress writing")
        done += n


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    buf = os.pread(fd, n, offset)
    if len(buf) < n:
        raise TruncatedRecord(f"{len(buf)} of {n} bytes at {offset}")
    return buf


def _check_head(head: bytes, key: bytes, loc: _Loc) -> tuple[Header, bytes]:
    """Verify header + meta against what the index expects; the header and the meta."""
    h = read_header(head)
    meta = head[HEADER_SIZE:]
    h.check_head(meta)
    if h.tombstone or h.key != key or h.meta_len != loc.meta_len or h.payload_len != loc.payload_len:
        raise CorruptRecord("record does not match the index")
    return h, meta


def _read_record(loc: _Loc, key: bytes) -> Record:
    """Two preads (header+meta, then the payload straight into its own bytes: no copy)."""
    fd = os.open(loc.seg.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head_len = HEADER_SIZE + loc.meta_len
        header, meta = _check_head(_pread_exact(fd, head_len, loc.offset), key, loc)
        payload = _pread_exact(fd, loc.payload_len, loc.offset + head_len)
    finally:
        os.close(fd)
    header.check_body(meta, payload)
    return Record(key, meta, payload)
