"""What the prefix index refuses, one type per reason, each carrying its fields.

Every one is an `IndexError_` (a ValueError), so `except IndexError_` still catches
them all; a caller that cares why matches the subclass and reads its attributes
instead of the message. The messages say what to change.
"""
from __future__ import annotations

__all__ = [
    "BadBlockSize",
    "BadNamespace",
    "BadVerifyEvery",
    "IndexError_",
    "IndexFull",
    "UnknownWorker",
    "WorkerAlreadyRegistered",
]


class IndexError_(ValueError):
    """A lifecycle call that cannot be honoured (the subclasses below say which)."""


class WorkerAlreadyRegistered(IndexError_):
    """`add_worker` for an id the index already holds (remove it first)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id!r} is already registered")


class UnknownWorker(IndexError_):
    """A call naming a worker the index does not hold (never added, or removed)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        super().__init__(f"unknown worker {worker_id!r}")


class BadNamespace(IndexError_):
    """A namespace digest that is not `expected_bytes` long (`kvindex.keys.KEY_BYTES`)."""

    def __init__(self, worker_id: str, digest_bytes: int, expected_bytes: int) -> None:
        self.worker_id = worker_id
        self.digest_bytes = digest_bytes
        self.expected_bytes = expected_bytes
        super().__init__(f"worker {worker_id!r}: the namespace digest must be {expected_bytes} bytes")


class BadBlockSize(IndexError_):
    """A worker's engine block size that is neither a multiple of the index's own nor a
    page size dividing it."""

    def __init__(self, worker_id: str, block_size: int, index_block_size: int) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.index_block_size = index_block_size
        super().__init__(
            f"worker {worker_id!r} has block size {block_size}, which is not a multiple of the "
            f"index block size {index_block_size}; configure the worker's engine with a "
            f"multiple of {index_block_size} (or a page size dividing it)"
        )


class BadVerifyEvery(IndexError_):
    """A `verify_every` that is not a positive int (1 in that many chain roots is verified)."""

    def __init__(self, worker_id: str, verify_every: object) -> None:
        self.worker_id = worker_id
        self.verify_every = verify_every
        super().__init__(f"worker {worker_id!r}: verify_every must be a positive int, got {verify_every!r}")


class IndexFull(IndexError_):
    """No slot left for worker `worker_id`, or (`groups`) for its remote group:
    `max_workers` of each, and a remote group keeps its slot while it holds REMOTE
    entries even once its members are gone."""

    def __init__(self, worker_id: str, max_workers: int, groups: bool = False) -> None:
        self.worker_id = worker_id
        self.max_workers = max_workers
        self.groups = groups
        if groups:
            msg = f"no free remote-group slots ({max_workers}); raise max_workers"
        else:
            msg = f"index is full: {max_workers} workers (raise max_workers)"
        super().__init__(msg)
