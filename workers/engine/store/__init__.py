"""Block stores below host memory: log-structured segment files (DISK) and Redis (REMOTE).

`disk` needs nothing beyond the standard library; `remote` needs redis-py (extra
`worker`), so it is not imported here.
"""
from __future__ import annotations

from workers.engine.store.base import BlockStore, Record, StoreStats
from workers.engine.store.disk import DiskConfig, DiskStore

__all__ = ["BlockStore", "DiskConfig", "DiskStore", "Record", "StoreStats"]
