"""Per-request results as JSONL, shared by the HTTP replay and the offline simulator.

A results file holds one or more runs; each run is a `meta` line followed by its
`req` lines, so `loadtest.cli report` can re-render any mix of replays and
simulations. Times are seconds relative to the run's start; a request's latencies
are measured from when it was sent (`start_s`), and the wait before sending
(client-side queueing when the concurrency bound was reached) is `client_queue_s`.
"""
from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from .trace import TraceError


class RunMeta(msgspec.Struct, tag="meta", omit_defaults=True):
    run: str  # a label unique within a file: e.g. "kv_cost", "round_robin@tiers=gpu"
    mode: str  # "sim" | "replay"
    policy: str | None = None
    trace: str = ""
    speed: float = 1.0
    workers: int | None = None
    profile: str | None = None
    tiers: str = "all"
    url: str | None = None
    duration_s: float = 0.0  # makespan: first arrival to last completion (virtual or real)
    wall_s: float = 0.0  # wall-clock time the run took
    params: dict[str, Any] = {}
    stats: dict[str, Any] = {}  # run-level counters (events, prefetches, disk bytes written, ...)


class RequestResult(msgspec.Struct, tag="req", omit_defaults=True):
    run: str
    index: int
    arrival_s: float  # scheduled (trace time / speed)
    start_s: float | None = None  # sent
    client_queue_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    loaded_tokens: dict[str, int] = {}
    recomputed_tokens: int | None = None
    prefetched_tokens: int = 0
    queue_ms: float | None = None
    load_ms: float | None = None
    prefill_ms: float | None = None
    worker: str | None = None
    predicted_ttft_s: float | None = None
    prefetch_blocks: int = 0  # blocks the router asked the worker to raise
    prefetch_hidden_s: float | None = None  # load time taken off the critical path by prefetch
    status: int = 200
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None


Line = RunMeta | RequestResult
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Line)


class ResultsWriter:
    """Appends runs to a JSONL file (or any binary stream), flushing per run."""

    def __init__(self, target: str | Path | io.BufferedIOBase) -> None:
        if isinstance(target, (str, Path)):
            p = Path(target)
            p.parent.mkdir(parents=True, exist_ok=True)
            self._f: Any = p.open("ab")
            self._own = True
        else:
            self._f = target
            self._own = False
        self._buf = bytearray()

    def write(self, line: Line) -> None:
        self._buf += _enc.encode(line)
        self._buf += b"\n"
        if len(self._buf) > 1 << 20:
            self.flush()

    def write_run(self, meta: RunMeta, results: Iterable[RequestResult]) -> None:
        self.write(meta)
        for r in results:
            self.write(r)
        self.flush()

    def flush(self) -> None:
        if self._buf:
            self._f.write(bytes(self._buf))
            self._buf.clear()
        self._f.flush()

    def close(self) -> None:
        self.flush()
        if self._own:
            self._f.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Run(msgspec.Struct):
    meta: RunMeta
    results: list[RequestResult]


def iter_lines(path: str | Path) -> Iterator[Line]:
    p = Path(path)
    try:
        f = p.open("rb")
    except OSError as e:
        raise TraceError(f"cannot read results {p}: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield _dec.decode(raw)
            except msgspec.DecodeError as e:
                raise TraceError(f"{p}:{lineno}: not a results line ({e})") from None


def read_runs(*paths: str | Path) -> list[Run]:
    """Every run in the files, in order; request lines are attached to their meta by `run`.

    Labels identify runs: a second meta line with a known label replaces that run's
    meta (the replay writes one at the start and a final one with its duration)."""
    runs: list[Run] = []
    by_name: dict[str, Run] = {}
    for path in paths:
        for line in iter_lines(path):
            if isinstance(line, RunMeta):
                known = by_name.get(line.run)
                if known is not None:  # a later meta line of the same run updates it (final duration)
                    known.meta = line
                    continue
                run = Run(line, [])
                runs.append(run)
                by_name[line.run] = run
            else:
                owner = by_name.get(line.run)
                if owner is None:
                    raise TraceError(f"{path}: request line of run {line.run!r} before its meta line")
                owner.results.append(line)
    return runs
