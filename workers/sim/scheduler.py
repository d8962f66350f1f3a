"""The simulated engine's scheduler: the queues and the GPU step loop (vLLM-like).

Each step has a token budget shared by the running decodes (one token each) and
prefill chunks (running prefills first, then newly admitted requests, first come first
served). A request is admitted only when the GPU pool can hold all its blocks, so
nothing is preempted later; one whose cached prefix sits below GPU waits for its loads
(the loader) before its first chunk, without holding up the others. The first token
comes at the end of the step that computes the last prompt token. Details:
docs/sim-engine.md § Scheduling.
"""
from __future__ import annotations

import math
from collections import deque

from .admission import AdmissionFilter
from .job import Job, Phase
from .kvcache import TieredKV
from .loader import Loader
from .profile import SimProfile
from .stats import EngineStats
from .step import Step


class Scheduler:
    """Requests from arrival to their last token; see the module doc."""

    def __init__(
        self,
        profile: SimProfile,
        kv: TieredKV,
        loader: Loader,
        stats: EngineStats,
        admission: AdmissionFilter | None,
    ) -> None:
        self.kv = kv
        self.loader = loader
        self.stats = stats
        self.admission = admission
        self.bs = profile.block_size
        self.compute = profile.compute
        self.max_batched = profile.scheduler.max_num_batched_tokens
        self.max_seqs = profile.scheduler.max_num_seqs
        self.step: Step | None = None
        self.jobs: dict[str, Job] = {}
        self.waiting: deque[Job] = deque()
        self.loading: dict[str, Job] = {}
        self.prefilling: dict[str, Job] = {}
        self.decoding: dict[str, Job] = {}
        self.streaming = 0  # decoding jobs with on_tokens
        self.waiting_tokens = 0  # prompt tokens of waiting jobs minus their cache hits (any tier) at arrival
        self.running_prefill = 0  # prompt tokens still to compute of scheduled jobs
        self.decode_ctx = 0  # context tokens of the decoding jobs

    def running(self) -> int:
        return len(self.loading) + len(self.prefilling) + len(self.decoding)

    def add(self, job: Job) -> None:
        """A new request joins the waiting queue."""
        self.jobs[job.rid] = job
        self.waiting.append(job)
        self.waiting_tokens += job.prompt - job.cached_hint * self.bs

    # ------------------------------------------------------------------ the step loop

    def schedule(self, t: float) -> None:
        """Start the next GPU step at `t`: the running decodes, the next chunks of running
        prefills, then requests admitted from the queue while budget and memory last."""
        decode = list(self.decoding.values())
        chunks, budget = self._prefill_chunks(self.max_batched - len(decode))
        blocked = self._admit_waiting(t, chunks, budget)
        if not chunks and not decode:
            self.step = None
            return
        self.step = self._make_step(t, chunks, decode, blocked)
        self.stats.steps += 1

    def _prefill_chunks(self, budget: int) -> tuple[list[tuple[Job, int]], int]:
        chunks: list[tuple[Job, int]] = []
        for job in self.prefilling.values():
            if budget <= 0:
                break
            n = min(job.prompt - job.computed, budget)
            chunks.append((job, n))
            budget -= n
        return chunks, budget

    def _admit_waiting(self, t: float, chunks: list[tuple[Job, int]], budget: int) -> bool:
        """Admit from the head of the queue, appending first chunks; True when the queue
        is blocked (by the sequence cap or the GPU pool) rather than empty or out of budget."""
        waiting = self.waiting
        while waiting and budget > 0:
            if self.running() >= self.max_seqs:
                return True
            job = waiting[0]
            if not self._admit(job, t):
                return True
            waiting.popleft()
            if job.phase is Phase.PREFILL:
                n = min(job.prompt - job.computed, budget)
                chunks.append((job, n))
                budget -= n
        return False

    def _make_step(self, t: float, chunks: list[tuple[Job, int]], decode: list[Job], blocked: bool) -> Step:
        """Price the step. A decode-only step that nothing can change before a request
        finishes (no prefill, no streaming reader, a queue that is empty or stuck) is a
        span up to the first finish."""
        c = self.compute
        prefill_s = 0.0
        for job, n in chunks:
            prefill_s += c.prefill_s(n, job.computed)
        if not decode:
            return Step(t, t + prefill_s, chunks, decode, 1, prefill_s, 0.0, 0.0)
        b = len(decode)
        k = 1
        if not chunks and not self.prefilling and not self.streaming and (blocked or not self.waiting):
            k = max(min(j.max_tokens - j.generated for j in decode), 1)
        a = c.decode_step_s(b, self.decode_ctx)
        step = Step(t, 0.0, chunks, decode, k, prefill_s, a, c.decode_per_ctx_token_s * b)
        step.end = step.end_after(k)
        return step

    def end_step(self, t: float) -> None:
        """The step in progress ends at `t`: its chunks are computed, its decodes produced."""
        step = self.step
        assert step is not None
        self.step = None
        for job, n in step.prefill:
            if job.phase is Phase.PREFILL:
                self._computed(job, n, t)
        self._decoded(step.decode, step.k, t)

    def _computed(self, job: Job, n: int, t: float) -> None:
        """A prefill chunk of `n` tokens is done: its full blocks become cached on GPU."""
        before = job.computed
        after = before + n
        job.computed = after
        self.running_prefill -= n
        self.stats.computed_tokens += n
        kv = self.kv
        bs = self.bs
        lo = before // bs
        hi = min(after // bs, len(job.keys))
        if hi > lo:
            if kv.events_on:
                kv.add_meta(job.keys, lo, hi, job.tokens, job.extra, job.req.lora)
            ks = job.keys[lo:hi]
            job.anon -= kv.land_pinned(ks, True)
            job.pinned.extend(ks)
        if after >= job.prompt:
            self._first_token(job, t)

    def _decoded(self, jobs: list[Job], k: int, t: float) -> None:
        """`k` decode steps are done for the batch: each job still decoding has `k` more
        tokens (one loop for the batch: this runs for every sequence of every step)."""
        stats = self.stats
        for job in jobs:
            if job.phase is not Phase.DECODE:  # finished or cancelled by an earlier callback
                continue
            job.generated += k
            self.decode_ctx += k
            stats.generated_tokens += k
            cb = job.req.on_tokens
            if cb is not None:
                cb(t, k)
            if job.generated >= job.max_tokens and job.phase is Phase.DECODE:
                self._finish(job, t)

    def _first_token(self, job: Job, t: float) -> None:
        del self.prefilling[job.rid]
        job.generated = 1
        job.first_at = t
        u = job.usage
        u.completion_tokens = 1
        u.prefill_ms = (t - job.loaded_at) * 1000.0
        u.ttft_ms = (t - job.arrival) * 1000.0
        self.stats.generated_tokens += 1
        cb = job.req.on_first_token
        if cb is not None:
            cb(t, u)
        if job.phase is Phase.DONE:  # cancelled from the callback
            return
        if job.max_tokens <= 1:
            self._finish(job, t)
            return
        job.phase = Phase.DECODE
        self.decoding[job.rid] = job
        self.decode_ctx += job.prompt + 1
        if job.streaming:
            self.streaming += 1

    def _finish(self, job: Job, t: float) -> None:
        if job.phase is Phase.DECODE:
            self._leave_decode(job)
        job.phase = Phase.DONE
        self.jobs.pop(job.rid, None)
        self._free(job)
        u = job.usage
        u.completion_tokens = job.generated
        u.decode_ms = (t - job.first_at) * 1000.0
        self.stats.finished += 1
        cb = job.req.on_finish
        if cb is not None:
            cb(t, u)

    def _leave_decode(self, job: Job) -> None:
        del self.decoding[job.rid]
        self.decode_ctx -= job.prompt + job.generated
        if job.streaming:
            self.streaming -= 1

    def _free(self, job: Job) -> None:
        self.kv.unpin(job.pinned)
        self.kv.release(job.anon)
        job.pinned = []
        job.anon = 0

    # ------------------------------------------------------------------ admission

    def _admit(self, job: Job, t: float) -> bool:
        """Schedule the head of the queue if the GPU pool can hold it; start its loads."""
        kv = self.kv
        keys = job.keys
        cap = job.cacheable
        g = kv.gpu_prefix(keys, cap) if cap else 0
        loader = self.loader
        plan, n_load = loader.plan(job, g, cap, t) if g < cap and loader.can_load() else ({}, 0)
        need = job.blocks_needed(self.bs) - g
        if kv.available() - (kv.evictable_among(keys[:g]) if g else 0) < need:
            return False
        self._note_use(job, t)
        loader.touch(plan)
        if g:
            hits = keys[:g]
            kv.pin(hits)
            job.pinned = hits
        kv.reserve(need)
        job.anon = need
        loader.count_gpu_hits(job, g)
        loader.start(job, plan, g, n_load, t)
        self._scheduled(job, (g + n_load) * self.bs, t)
        return True

    def _note_use(self, job: Job, t: float) -> None:
        """Record the use of the request's blocks: SSD admission counts, purge tags."""
        keys = job.keys
        adm = self.admission
        if adm is not None and adm.active and keys:
            adm.seen(keys, t)
        if job.salt and len(keys) > job.salt_from:
            self.kv.note_tag("salt", keys[job.salt_from :], job.salt)
        if job.req.lora and keys:
            self.kv.note_tag("lora", keys, job.req.lora)

    def _scheduled(self, job: Job, cached_tokens: int, t: float) -> None:
        job.computed = cached_tokens
        job.scheduled_at = t
        u = job.usage
        u.queue_ms = (t - job.arrival) * 1000.0
        u.recomputed_tokens = job.prompt - job.computed
        self.waiting_tokens -= job.prompt - job.cached_hint * self.bs
        self.running_prefill += job.prompt - job.computed
        if job.pending:
            job.phase = Phase.LOADING
            self.loading[job.rid] = job
        else:
            job.phase = Phase.PREFILL
            job.loaded_at = t
            self.prefilling[job.rid] = job

    def loaded(self, job: Job, t: float, recompute: int) -> None:
        """One of the job's loads landed (`recompute`: prompt tokens a damaged block gave back)."""
        self.running_prefill += recompute
        job.pending -= 1
        if job.pending == 0:
            del self.loading[job.rid]
            job.phase = Phase.PREFILL
            job.loaded_at = t
            job.usage.load_ms = (t - job.scheduled_at) * 1000.0
            self.prefilling[job.rid] = job
            if self.step is not None:
                self.step.cut(t)

    # ------------------------------------------------------------------ changes from outside

    def cancel(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if unknown or finished."""
        job = self.jobs.pop(request_id, None)
        if job is None:
            return False
        ph = job.phase
        if ph is Phase.WAITING:
            self.waiting.remove(job)
            self.waiting_tokens -= job.prompt - job.cached_hint * self.bs
        else:
            if ph is Phase.LOADING:
                del self.loading[job.rid]
                self.loader.drop_job(job)
                self.running_prefill -= job.prompt - job.computed
            elif ph is Phase.PREFILL:
                # (absent when cancelled from its own on_first_token callback)
                self.prefilling.pop(job.rid, None)
                self.running_prefill -= job.prompt - job.computed
            elif ph is Phase.DECODE:
                self._leave_decode(job)
            self._free(job)
        job.phase = Phase.DONE
        self.stats.cancelled += 1
        return True

    def cut_purged(self, dropped: set[bytes]) -> None:
        """Requests still computing a purged chain must not cache what follows it: their
        later blocks would hang off a parent that no longer exists."""
        for group in (self.loading, self.prefilling):
            for job in group.values():
                for i, key in enumerate(job.keys):
                    if key in dropped:
                        job.keys = job.keys[:i]
                        job.cacheable = min(job.cacheable, i)
                        job.cut = True
                        break

    # ------------------------------------------------------------------ estimates

    def estimate_queue_s(self, now: float) -> float:
        """Wait before a request arriving now starts its prefill: the step in progress, the
        prompt work queued ahead (with the decode batch riding along in every step), and,
        when the GPU pool cannot hold the waiting requests, the decode time until enough
        running requests finish. A waiting request's blocks held below GPU count as loaded
        (the links move them beside the compute), not as prompt work."""
        step = self.step
        left = max(0.0, step.end_now(now) - now) if step is not None else 0.0
        c = self.compute
        work = 0.0
        tokens = 0
        bs = self.bs
        for job in self.waiting:
            cached = job.cached_hint * bs  # what loads while it waits is not computed
            n = job.prompt - cached
            work += c.prefill_s(n, cached)
            tokens += n
        in_step = {job.rid: n for job, n in step.prefill} if step is not None else {}
        for group in (self.loading, self.prefilling):
            for job in group.values():
                done = job.computed + in_step.get(job.rid, 0)  # the chunk in this step is in `left`
                n = job.prompt - done
                if n > 0:
                    work += c.prefill_s(n, done)
                    tokens += n
        b = len(self.decoding)
        if tokens and b:
            steps = math.ceil(tokens / max(1, self.max_batched - b))
            work += steps * c.decode_step_s(b, self.decode_ctx)
        return left + work + self._memory_wait_s()

    def _memory_wait_s(self) -> float:
        """Decode time until finishing requests free the blocks the waiting queue needs."""
        if not self.waiting:
            return 0.0
        bs = self.bs
        need = 0
        for job in self.waiting:
            need += job.blocks_needed(bs) - job.gpu_hint
        deficit = need - self.kv.available()
        if deficit <= 0 or not self.decoding:
            return 0.0
        freed = 0
        step_s = self.compute.decode_step_s(len(self.decoding), self.decode_ctx)
        for job in sorted(self.decoding.values(), key=Job.tokens_left):
            freed += job.anon + len(job.pinned)
            if freed >= deficit:
                return job.tokens_left() * step_s
        return max(j.tokens_left() for j in self.decoding.values()) * step_s
