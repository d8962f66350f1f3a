"""The engine's block stores below host memory (workers/engine/store, docs/engine-store.md):
DiskStore over real segment files in tmp_path, RedisStore against a real redis-server this
file starts itself (installing Debian's package if it can; the Redis tests skip LOUDLY
otherwise). Every damaged, vanished or unreachable block must be a counted miss whose key
is dropped and reported, never an exception or a wrong answer."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hangs import HANG_S

from workers.engine.store.base import Record
from workers.engine.store.disk import DiskConfig, DiskStore
from workers.engine.store.record import HEADER_SIZE

META_LEN = 9  # b"meta-0000"
BODY = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(b"key %d" % i).digest()


def meta(i: int) -> bytes:
    return b"meta-%04d" % i


def payload(i: int, n: int = BODY) -> bytes:
    seed = hashlib.sha256(b"payload %d" % i).digest()
    return (seed * (n // 32 + 1))[:n]


REC = HEADER_SIZE + META_LEN + BODY  # one record of put_n's blocks


class Drops:
    """An on_drop callback that remembers its calls."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []

    def __call__(self, keys: list[bytes]) -> None:
        self.calls.append(list(keys))

    @property
    def keys(self) -> list[bytes]:
        return [k for call in self.calls for k in call]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def open_disk(path: Path, drops: Drops | None = None, clock: FakeClock | None = None, **kw: Any) -> DiskStore:
    cfg: dict[str, Any] = dict(path=path, capacity_bytes=64 << 20, segment_bytes=1 << 20, admit_after=1)
    cfg.update(kw)
    return DiskStore(DiskConfig(**cfg), on_drop=drops, clock=clock or time.monotonic)


def put_n(store: DiskStore, ids: range | list[int]) -> None:
    for i in ids:
        assert store.put(key(i), meta(i), payload(i))


def assert_hit(store: Any, i: int, n: int = BODY) -> None:
    assert store.get(key(i)) == Record(key(i), meta(i), payload(i, n))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def only_segment(store: DiskStore) -> Path:
    (path,) = store.segment_paths()
    return path


# --- DISK ---------------------------------------------------------------------------


def test_disk_round_trip(tmp_path: Path) -> None:
    store = open_disk(tmp_path)
    put_n(store, range(3))
    for i in range(3):
        assert_hit(store, i)
    assert store.contains([key(0), key(2), key(9)]) == [True, True, False]
    assert dict(store.scan()) == {key(i): meta(i) for i in range(3)}
    assert store.put(key(1), meta(1), payload(1))  # held already: no second write
    assert store.stats.puts == 3 and store.bytes_used == 3 * REC
    assert store.discard([key(0), key(9)]) == 1
    assert store.get(key(0)) is None and store.contains([key(0)]) == [False]
    s = store.stats
    assert (s.gets, s.hits, s.misses, s.get_bytes) == (4, 3, 1, 3 * BODY)
    assert s.checksum_errors == s.truncated == s.io_errors == s.dropped == 0
    with pytest.raises(ValueError):
        store.put(b"short", b"", b"")
    store.close()


def test_disk_restart_serves_what_its_scan_finds(tmp_path: Path) -> None:
    store = open_disk(tmp_path, segment_bytes=3 * REC, capacity_bytes=100 * REC)
    put_n(store, range(7))
    store.discard([key(1), key(3)])
    assert store.put(key(3), b"meta-new!", payload(3))  # rewritten after a discard: last one wins
    with pytest.raises(RuntimeError, match="in use"):
        open_disk(tmp_path)  # one store per directory
    store.close()

    again = open_disk(tmp_path, segment_bytes=3 * REC, capacity_bytes=100 * REC)
    held = [0, 2, 3, 4, 5, 6]
    assert again.contains([key(i) for i in range(7)]) == [i in held for i in range(7)]
    for i in (0, 2, 4, 5, 6):
        assert_hit(again, i)
    assert again.get(key(3)) == Record(key(3), b"meta-new!", payload(3))
    assert dict(again.scan()) == {**{key(i): meta(i) for i in held}, key(3): b"meta-new!"}
    assert again.get(key(1)) is None  # the tombstone survived the restart
    old_segments = again.segment_paths()
    put_n(again, [7])
    assert len(again.segment_paths()) == len(old_segments) + 1  # old segments are never appended to
    assert_hit(again, 7)
    assert again.stats.checksum_errors == again.stats.truncated == again.stats.io_errors == 0
    again.close()


def test_disk_truncated_tail_is_cut_at_restart(tmp_path: Path) -> None:
    store = open_disk(tmp_path)
    put_n(store, range(3))
    seg = only_segment(store)
    store.close()
    os.truncate(seg, 3 * REC - 10)  # crash in the middle of the third write

    again = open_disk(tmp_path)
    assert again.stats.truncated == 1 and again.stats.checksum_errors == 0
    assert again.get(key(2)) is None
    assert_hit(again, 0)
    assert_hit(again, 1)
    assert seg.stat().st_size == 2 * REC  # the torn tail was cut off
    again.close()


def test_disk_index_surviving_its_data_is_a_miss(tmp_path: Path) -> None:
    drops = Drops()
    store = open_disk(tmp_path, drops)
    put_n(store, range(2))
    os.truncate(only_segment(store), 0)  # the data vanished, the in-memory index did not
    assert store.get(key(0)) is None
    assert store.stats.truncated == 1 and store.stats.dropped == 1
    assert drops.calls == [[key(0)]]
    assert store.contains([key(0), key(1)]) == [False, True]
    assert store.get(key(1)) is None and drops.keys == [key(0), key(1)]
    assert store.stats.misses == 2 and store.stats.hits == 0
    store.close()


def test_disk_flipped_payload_byte(tmp_path: Path) -> None:
    drops = Drops()
    store = open_disk(tmp_path, drops)
    put_n(store, range(3))
    seg = only_segment(store)
    flip(seg, REC + HEADER_SIZE + META_LEN + 100)  # inside block 1's payload
    assert store.get(key(1)) is None
    assert (store.stats.checksum_errors, store.stats.dropped) == (1, 1)
    assert drops.calls == [[key(1)]] and store.contains([key(1)]) == [False]
    assert_hit(store, 0)
    assert_hit(store, 2)
    store.close()

    # A header-only scan indexes it again and `get` catches it again...
    again = open_disk(tmp_path, drops)
    assert again.contains([key(1)]) == [True]
    assert again.get(key(1)) is None and again.stats.checksum_errors == 1
    again.close()
    # ...while verify_on_open catches it at start and keeps the records after it.
    verified = open_disk(tmp_path, verify_on_open=True)
    assert verified.stats.checksum_errors == 1 and verified.contains([key(1)]) == [False]
    assert_hit(verified, 0)
    assert_hit(verified, 2)
    verified.close()


@pytest.mark.parametrize("where", [0, 10, 40, 44, 48, 52], ids=["magic", "key", "meta_len", "payload_len",
                                                                  "crc", "head_crc"])
def test_disk_flipped_header_byte(tmp_path: Path, where: int) -> None:
    drops = Drops()
    store = open_disk(tmp_path, drops)
    put_n(store, range(3))
    seg = only_segment(store)
    flip(seg, REC + where)  # block 1's header
    assert store.get(key(1)) is None
    assert store.stats.checksum_errors == 1 and drops.calls == [[key(1)]]
    assert_hit(store, 2)
    store.close()

    again = open_disk(tmp_path)  # the scan skips the bad record and finds the next one
    assert again.stats.checksum_errors == 1 and again.stats.truncated == 0
    assert again.contains([key(0), key(1), key(2)]) == [True, False, True]
    assert_hit(again, 2)
    again.close()


def test_disk_deleted_segment_file(tmp_path: Path) -> None:
    drops = Drops()
    store = open_disk(tmp_path, drops, segment_bytes=2 * REC, capacity_bytes=10 * REC)
    put_n(store, range(5))  # segments: [0 1] [2 3] [4]
    first = store.segment_paths()[0]
    first.unlink()
    assert store.get(key(0)) is None
    assert store.stats.io_errors == 1 and store.stats.dropped == 2
    assert drops.calls == [[key(0), key(1)]]  # the whole segment is reported at once
    assert store.contains([key(i) for i in range(5)]) == [False, False, True, True, True]
    assert store.bytes_used == 3 * REC
    assert_hit(store, 2)
    store.close()

    (tmp_path / "seg-0000000000000002.kv").unlink()  # and one more vanishes while it is down
    again = open_disk(tmp_path, segment_bytes=2 * REC, capacity_bytes=10 * REC)
    assert again.contains([key(i) for i in range(5)]) == [False, False, False, False, True]
    assert_hit(again, 4)
    again.close()


def test_disk_admission_filter(tmp_path: Path) -> None:
    clock = FakeClock()
    store = open_disk(tmp_path, clock=clock, admit_after=2, admit_window_s=10.0, admit_width=1024)
    assert not store.put(key(0), meta(0), payload(0))  # first sighting: not written
    assert store.stats.refused == 1 and store.contains([key(0)]) == [False] and store.bytes_used == 0
    clock.t += 5.0
    assert store.put(key(0), meta(0), payload(0))  # second, within the window
    assert_hit(store, 0)

    assert not store.put(key(1), meta(1), payload(1))
    clock.t += 25.0  # two windows later the first sighting is forgotten
    assert not store.put(key(1), meta(1), payload(1))
    assert store.put(key(1), meta(1), payload(1))

    # Bounded whatever the clock: a generation also turns every width/4 sightings.
    assert not store.put(key(2), meta(2), payload(2))
    for i in range(1000, 1600):
        store.put(key(i), b"", b"")
    assert not store.put(key(2), meta(2), payload(2))
    assert 2 <= store.stats.puts <= 2 + 12  # a sketch collision may admit a block early (< 2%)
    store.close()


def test_disk_write_budget(tmp_path: Path) -> None:
    clock = FakeClock()
    store = open_disk(tmp_path, clock=clock, max_write_bytes_per_s=10 * REC, write_burst_bytes=3 * REC)
    put_n(store, range(3))  # the burst
    assert not store.put(key(3), meta(3), payload(3))
    assert store.stats.refused == 1
    clock.t += 0.1  # one record's worth of budget
    assert store.put(key(3), meta(3), payload(3))
    assert not store.put(key(4), meta(4), payload(4))
    assert store.stats.refused == 2 and store.stats.puts == 4

    small = open_disk(tmp_path / "small", segment_bytes=2 * REC, capacity_bytes=4 * REC)
    assert not small.put(key(0), meta(0), payload(0, 2 * REC))  # bigger than a segment
    assert small.stats.refused == 1
    small.close()
    store.close()


def test_disk_capacity_evicts_oldest_segment_first(tmp_path: Path) -> None:
    drops = Drops()
    store = open_disk(tmp_path, drops, segment_bytes=4 * REC, capacity_bytes=12 * REC)
    put_n(store, range(16))  # segments [0-3] [4-7] [8-11] full; the 13th record evicts [0-3]
    assert drops.calls == [[key(i) for i in range(4)]]
    put_n(store, range(16, 20))
    assert drops.calls == [[key(i) for i in range(4)], [key(i) for i in range(4, 8)]]
    assert store.stats.evicted == 8
    assert store.stats.dropped == 0  # evictions are not failures
    files = sorted(tmp_path.glob("seg-*.kv"))
    assert [p.name for p in files] == [p.name for p in store.segment_paths()] and len(files) == 3
    assert sum(p.stat().st_size for p in files) == store.bytes_used <= 12 * REC
    assert all(store.get(key(i)) is None for i in range(8))
    for i in range(8, 20):
        assert_hit(store, i)
    assert store.stats.checksum_errors == store.stats.io_errors == 0
    store.close()


def test_disk_full_disk_refuses_writes_and_keeps_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_disk(tmp_path)
    put_n(store, [0])
    real = os.pwritev

    def full(fd: int, bufs: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def half_then_full(fd: int, bufs: Any, offset: int) -> int:
        real(fd, [bytes(bufs[0])[:30]], offset)  # a torn header lands before the error
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    assert not store.put(key(1), meta(1), payload(1))
    monkeypatch.setattr(os, "pwritev", half_then_full)
    assert not store.put(key(2), meta(2), payload(2))
    assert store.stats.io_errors == 2 and store.contains([key(1), key(2)]) == [False, False]
    assert_hit(store, 0)
    monkeypatch.setattr(os, "pwritev", real)
    assert only_segment(store).stat().st_size == REC  # the torn bytes were cut back
    put_n(store, [3])
    store.close()

    again = open_disk(tmp_path)
    assert again.stats.truncated == again.stats.checksum_errors == 0
    assert again.contains([key(i) for i in range(4)]) == [True, False, False, True]
    assert_hit(again, 3)
    again.close()


def test_disk_fsync_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = open_disk(tmp_path / "a", fsync="record")
    put_n(store, range(3))
    assert len(synced) == 3
    store.close()
    synced.clear()
    store = open_disk(tmp_path / "b")  # default "close": nothing per record, once at close
    put_n(store, range(3))
    assert synced == []
    store.close()
    assert len(synced) == 1


def test_disk_threads_smoke(tmp_path: Path) -> None:
    drops = Drops()
    store = open_disk(tmp_path, drops, segment_bytes=64 << 10, capacity_bytes=256 << 10)
    sizes = {i: 1024 * (1 + i % 20) for i in range(48)}
    errors: list[BaseException] = []
    bad: list[int] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1500):
                i, op = rng.randrange(48), rng.random()
                if op < 0.45:
                    store.put(key(i), meta(i), payload(i, sizes[i]))
                elif op < 0.9:
                    got = store.get(key(i))
                    if got is not None and got != Record(key(i), meta(i), payload(i, sizes[i])):
                        bad.append(i)
                elif op < 0.95:
                    store.discard([key(i)])
                else:
                    store.contains([key(j) for j in range(48)])
        except BaseException as err:  # noqa: B036 - reported below, in the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per run
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and bad == []
    s = store.stats
    assert s.gets == s.hits + s.misses and s.hits > 0 and s.evicted > 0
    assert s.checksum_errors == s.truncated == s.io_errors == s.dropped == 0
    assert store.bytes_used <= 256 << 10
    store.close()

    again = open_disk(tmp_path, segment_bytes=64 << 10, capacity_bytes=256 << 10)
    found = dict(again.scan())
    assert found and all(again.get(k) is not None for k in found)
    assert again.stats.checksum_errors == again.stats.truncated == 0
    again.close()


# --- REMOTE -------------------------------------------------------------------------


def _redis_binary() -> str | None:
    """redis-server on PATH, or Debian's package installed now when we are allowed to."""
    found = shutil.which("redis-server")
    apt = shutil.which("apt-get")
    if found or apt is None:
        return found
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"] if shutil.which("sudo") else None
    if sudo is None:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for steps in ([["install", "-y", "redis-server"]], [["update"], ["install", "-y", "redis-server"]]):
        try:
            if all(subprocess.run([*sudo, apt, *step], env=env, capture_output=True, timeout=600).returncode == 0
                   for step in steps):
                return shutil.which("redis-server")
        except (OSError, subprocess.SubprocessError):
            return None
    return None


class RedisServer:
    """A throwaway redis-server on a free 127.0.0.1 port, no persistence."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary, self.workdir = binary, workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=2)


def _start_redis(tmp: Path) -> RedisServer:
    pytest.importorskip("redis")
    binary = _redis_binary()
    if binary is None:
        msg = ("!!! REDIS TESTS SKIPPED: no redis-server on PATH and `apt-get install -y redis-server` "
               "was impossible here; RedisStore was NOT tested !!!")
        warnings.warn(msg, stacklevel=1)
        pytest.skip(msg)
    server = RedisServer(binary, tmp)
    server.start()
    return server


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, to kill and pause."""
    server = _start_redis(tmp_path)
    yield server
    server.stop()


def open_remote(server: RedisServer, group: str, drops: Drops | None = None, **kw: Any) -> Any:
    from workers.engine.store.remote import RedisConfig, RedisStore

    return RedisStore(RedisConfig(port=server.port, group=group, **kw), on_drop=drops)


def test_redis_round_trip(redis_server: RedisServer) -> None:
    store = open_remote(redis_server, "round-trip", ttl_s=60)
    for i in range(3):
        assert store.put(key(i), meta(i), payload(i))
    for i in range(3):
        assert_hit(store, i)
    assert store.contains([key(0), key(2), key(9)]) == [True, True, False]
    assert dict(store.scan()) == {key(i): meta(i) for i in range(3)}
    name = b"kvroute:round-trip:" + key(0).hex().encode()
    assert 0 < redis_server.client().pttl(name) <= 60_000
    assert store.discard([key(0), key(9)]) == 1
    assert store.get(key(0)) is None and store.contains([key(0)]) == [False]
    s = store.stats
    assert (s.puts, s.gets, s.hits, s.misses, s.get_bytes) == (3, 4, 3, 1, 3 * BODY)
    assert s.io_errors == s.checksum_errors == 0
    store.close()


def test_redis_ttl_slides_on_hits_and_expires(redis_server: RedisServer) -> None:
    drops = Drops()
    store = open_remote(redis_server, "ttl", drops, ttl_s=1.0)
    name = b"kvroute:ttl:" + key(0).hex().encode()
    assert store.put(key(0), meta(0), payload(0))
    time.sleep(0.3)
    assert redis_server.client().pttl(name) < 800
    assert_hit(store, 0)
    assert redis_server.client().pttl(name) > 850  # the hit refreshed the TTL

    short = open_remote(redis_server, "ttl", drops, ttl_s=0.2)
    assert short.put(key(1), meta(1), payload(1))
    assert_hit(short, 1)
    time.sleep(0.4)
    assert short.contains([key(1)]) == [False]
    assert short.get(key(1)) is None and drops.calls == [[key(1)]]  # expiry noticed, reported
    store.close()
    short.close()


def test_redis_corrupt_values_are_detected(redis_server: RedisServer) -> None:
    drops = Drops()
    store = open_remote(redis_server, "corrupt", drops)
    raw = redis_server.client()
    names = [b"kvroute:corrupt:" + key(i).hex().encode() for i in range(4)]
    for i in range(4):
        assert store.put(key(i), meta(i), payload(i))
    value = raw.get(names[0])
    raw.setrange(names[0], HEADER_SIZE + META_LEN + 7, bytes([value[HEADER_SIZE + META_LEN + 7] ^ 1]))
    raw.set(names[1], raw.get(names[1])[:-5])  # truncated
    raw.set(names[2], value)  # block 0's record under block 2's name

    assert [store.get(key(i)) for i in range(3)] == [None, None, None]
    assert store.stats.checksum_errors == 2 and store.stats.truncated == 1 and store.stats.dropped == 3
    assert drops.calls == [[key(0)], [key(1)], [key(2)]]
    assert raw.exists(*names[:3]) == 0  # bad values are deleted for the whole group
    assert_hit(store, 3)
    store.close()


def test_redis_group_sharing_and_isolation(redis_server: RedisServer) -> None:
    a = open_remote(redis_server, "shared")
    b = open_remote(redis_server, "shared")
    other = open_remote(redis_server, "other")
    assert a.put(key(0), meta(0), payload(0))
    assert b.contains([key(0)]) == [True]
    assert_hit(b, 0)
    assert dict(b.scan()) == {key(0): meta(0)}
    assert other.get(key(0)) is None and list(other.scan()) == []
    assert other.put(key(1), meta(1), payload(1))
    assert a.contains([key(1)]) == [False]
    for s in (a, b, other):
        s.close()


def test_redis_dead_server_is_a_fast_miss_and_trips_the_breaker(own_redis: RedisServer) -> None:
    store = open_remote(own_redis, "dead", timeout_s=0.1, connect_timeout_s=0.1,
                        breaker_failures=3, breaker_backoff_s=0.3)
    assert store.put(key(0), meta(0), payload(0))
    own_redis.stop()
    for _ in range(6):
        t0 = time.monotonic()
        assert store.get(key(0)) is None
        assert time.monotonic() - t0 < HANG_S  # a miss, not a wait for the dead server
    s = store.stats
    assert s.io_errors == 3 and s.breaker_trips == 1 and s.breaker_skips == 3 and store.breaker.is_open
    assert not store.put(key(1), meta(1), payload(1))
    assert store.contains([key(0)]) == [False] and list(store.scan()) == []

    own_redis.start()  # same port, empty
    time.sleep(0.35)  # past the backoff: the next call is the trial
    assert store.put(key(1), meta(1), payload(1))
    assert not store.breaker.is_open
    assert_hit(store, 1)
    store.close()


def test_redis_hung_server_times_out(own_redis: RedisServer) -> None:
    store = open_remote(own_redis, "hung", timeout_s=0.1, breaker_failures=3)
    assert store.put(key(0), meta(0), payload(0))
    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        t0 = time.monotonic()
        assert store.get(key(0)) is None
        assert time.monotonic() - t0 < HANG_S  # the server never answers: only the timeout ends the call
        assert store.stats.io_errors == 1 and not store.breaker.is_open
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    assert_hit(store, 0)
    store.close()
