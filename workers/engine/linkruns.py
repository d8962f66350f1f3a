"""What each link thread does with a transfer: read blocks from its tier into the pool.

One run per source tier (CPU slots, DISK and REMOTE records, a peer's `/kv/blocks`
stream), outside the engine lock. Every block read from bytes is checked before it lands
(`_land_bytes`): a record whose payload or metadata is not what this engine stores cuts
the transfer there, and is dropped from the store it came from (failure is a miss). Each
run times its blocks for the link's meter, which /load reports.
"""
from __future__ import annotations

import base64
import http.client
import json
import logging
import time
import urllib.parse
from collections.abc import Callable

from kvindex.tiers import Tier
from workers.fleetkeys import peer_bearer

from .blockio import RECORDS_MEDIA_TYPE, BadMeta, decode_meta, read_records
from .copier import Copier
from .hostpool import Slot
from .links import Transfer
from .store.mac import ForgedBlock
from .store.record import RecordError
from .tierstate import TierState

log = logging.getLogger(__name__)


class LinkRuns:
    """The per-tier transfer functions the links run (see the module doc)."""

    def __init__(self, st: TierState) -> None:
        self.st = st
        self._copiers: dict[Tier, Copier] = {}

    def runs(self) -> dict[Tier, Callable[[Transfer], None]]:
        """The run of every tier this worker has."""
        st = self.st
        out: dict[Tier, Callable[[Transfer], None]] = {}
        if st.host is not None:
            out[Tier.CPU] = self._run_cpu
        if st.disk is not None:
            out[Tier.DISK] = self._run_disk
        if st.remote is not None:
            out[Tier.REMOTE] = self._run_remote
        if st.cfg.peer_token is not None:
            out[Tier.PEER] = self._run_peer
        return out

    def _copier(self, tier: Tier, t: Transfer) -> Copier:
        c = self._copiers.get(tier)
        if c is None:
            c = self._copiers[tier] = Copier(self.st.pool)
        c.begin(t.after)
        return c

    @staticmethod
    def _stop_early(t: Transfer) -> bool:
        return t.cancelled or (not t.demand and time.monotonic() > t.deadline)

    def _run_cpu(self, t: Transfer) -> None:
        host = self.st.host
        assert host is not None
        c = self._copier(Tier.CPU, t)
        marks = [time.perf_counter()]
        slots: list[Slot] = t.source
        for j, s in enumerate(slots):
            if self._stop_early(t):
                break
            if s.ready is not None:
                s.ready.synchronize()
            c.from_host(t.dst[j], host.block(s))
            if not t.demand:
                t.metas[j] = (s.meta, s.salt)
            t.ok[j] = True
            marks.append(time.perf_counter())
        c.finish()
        self._measure(Tier.CPU, marks)

    def _run_disk(self, t: Transfer) -> None:
        disk = self.st.disk
        assert disk is not None
        c = self._copier(Tier.DISK, t)
        marks = [time.perf_counter()]
        for j, key in enumerate(t.keys):
            if self._stop_early(t):
                break
            rec = disk.get(key)
            if rec is None:
                if not disk.contains([key])[0]:  # gone without a word (a purge's discard raced a rewrite)
                    self.st.store_dropped(Tier.DISK, [key])
                break
            if not self._land_bytes(t, j, c, Tier.DISK, key, rec.meta, rec.payload):
                break
            marks.append(time.perf_counter())
        c.finish()
        self._measure(Tier.DISK, marks)

    def _run_remote(self, t: Transfer) -> None:
        remote = self.st.remote
        c = self._copier(Tier.REMOTE, t)
        marks = [time.perf_counter()]
        stats = remote.stats
        failures = stats.io_errors + stats.breaker_skips
        present = remote.contains(t.keys)
        if stats.io_errors + stats.breaker_skips == failures:  # the server answered: what it lacks is gone
            self.st.store_dropped(Tier.REMOTE, [k for k, f in zip(t.keys, present, strict=True) if not f])
        n = 0
        while n < len(present) and present[n]:
            n += 1
        t.absent_from = n
        for j in range(n):
            if self._stop_early(t):
                break
            rec = remote.get(t.keys[j])
            if rec is None or not self._land_bytes(t, j, c, Tier.REMOTE, t.keys[j], rec.meta, rec.payload):
                break
            marks.append(time.perf_counter())
        c.finish()
        self._measure(Tier.REMOTE, marks)

    def _run_peer(self, t: Transfer) -> None:
        st = self.st
        assert st.mac is not None  # a PEER link exists only with the fleet secret
        c = self._copier(Tier.PEER, t)
        marks = [time.perf_counter()]
        try:
            with PeerStream(t.source, peer_bearer(st.cfg.peer_token or "-"), t.keys, st.cfg.peer_timeout_s) as stream:
                for j, (key, meta, payload) in enumerate(read_records(stream.read, t.keys, st.mac, st.peer_scope)):
                    if self._stop_early(t):
                        break
                    if not self._land_bytes(t, j, c, Tier.PEER, key, meta, payload):
                        break
                    marks.append(time.perf_counter())
        except (OSError, http.client.HTTPException, RecordError, ValueError) as e:
            with st.lock:
                st.stats.peer_errors += 1
                st.stats.peer_mac_failures += isinstance(e, ForgedBlock)
            log.warning("peer pull from %s failed: %s", t.source, e)
        c.finish()
        self._measure(Tier.PEER, marks)

    def _land_bytes(self, t: Transfer, j: int, c: Copier, tier: Tier, key: bytes, meta: bytes,
                    payload: bytes) -> bool:
        """One block's verified record into its pool block; False (and the block dropped
        where it came from) when its payload or meta is not what this engine stores. A
        demand load does not decode the meta (the request has its own; the key, checked
        with the record's crc, says which block it is); a prefetch needs it to publish."""
        st = self.st
        try:
            m = decode_meta(meta, st.bs) if not t.demand else None
            if len(payload) != st.block_bytes:
                raise BadMeta(f"payload of {len(payload)} bytes, blocks are {st.block_bytes}")
        except BadMeta as e:
            log.warning("%s block %s rejected: %s", tier.name, key.hex()[:16], e)
            with st.lock:
                st.stats.bad_meta += 1
            if tier in (Tier.DISK, Tier.REMOTE):
                store = st.store(tier)
                if store is not None:
                    store.discard([key])
                st.store_dropped(tier, [key])
            return False
        c.from_bytes(t.dst[j], payload)
        t.metas[j] = m
        t.ok[j] = True
        return True

    def _measure(self, tier: Tier, marks: list[float]) -> None:
        if len(marks) < 2:
            return
        st = self.st
        meter = st.links[tier].meter
        n = len(marks) - 1
        with st.lock:
            meter.add(marks[1] - marks[0], st.block_bytes, marks[-1] - marks[1], (n - 1) * st.block_bytes)


class PeerStream:
    """A blocking `POST <peer>/kv/blocks` asking for records (the PEER link's thread)."""

    def __init__(self, url: str, token: str, keys: list[bytes], timeout: float) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"bad peer URL {url!r}")
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self._conn = cls(u.hostname, u.port, timeout=timeout)
        body = json.dumps({"keys_b64": base64.b64encode(b"".join(keys)).decode()})
        self._conn.request("POST", u.path.rstrip("/") + "/kv/blocks", body=body, headers={
            "Authorization": f"Bearer {token}", "Accept": RECORDS_MEDIA_TYPE, "Content-Type": "application/json"})
        self._resp = self._conn.getresponse()
        ctype = self._resp.getheader("Content-Type", "")
        if self._resp.status != 200 or not ctype.startswith(RECORDS_MEDIA_TYPE):
            raise OSError(f"peer {url} answered {self._resp.status} ({ctype})")

    def read(self, n: int) -> bytes:
        return self._resp.read(n)

    def __enter__(self) -> PeerStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()
