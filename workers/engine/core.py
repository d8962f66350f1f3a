"""The engine core: block manager, scheduler, runner and sampler put together, single-threaded.

A step is three calls, so that a caller can hold a lock around the bookkeeping and not
around the model (workers/engine/loop.py): `schedule()` (pure bookkeeping: what runs,
which blocks), `execute(plan)` (forwards and sampling: touches only the pool slots of the
plan's sequences and their generators), `commit(plan, result)` (bookkeeping again:
tokens appended, full blocks registered, stop conditions, finished sequences released).
`step()` does all three, for tests and benchmarks.

With lower tiers (`EngineConfig.tiers`, workers/engine/tiers.py) the core owns a
`KVTiers` whose threads move blocks in and out of the pool; they share the core's
`lock` (bookkeeping) and `wake` (a load landed: a waiting step can go on).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvindex.events import KVEvent
from kvindex.keys import BlockHasher, Namespace
from kvindex.tiers import Tier
from kvwire import BlockCounts, LoadReport, NamespaceInfo, Speeds, WorkerInfo
from workers.api import TokenLogprob
from workers.errors import BadRequest, QueueFull, RequestTooLarge
from workers.usage import Usage

from .blocks import BlockManager, EvictedBlock, EvictHook
from .detok import OutputText
from .engineconfig import EngineConfig, resolve_num_blocks
from .group_events import per_group
from .kvpool import KVPool
from .model import LoadedModel
from .pd import PdPin
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler, StepPlan
from .sequence import KeyScope, SamplingParams, SeqStatus, Sequence
from .speeds import Ewma, PrefillFit
from .tiers import KVTiers


@dataclass(slots=True)
class SeqUpdate:
    """What one step did for one request: its new token(s), the text that may be sent, the end."""

    seq: Sequence
    token_ids: list[int]
    text: str
    finished: bool
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked


@dataclass(slots=True)
class StepResult:
    tokens: dict[Sequence, int] = field(default_factory=dict)
    logits: dict[Sequence, torch.Tensor] = field(default_factory=dict)
    logprobs: dict[Sequence, TokenLogprob] = field(default_factory=dict)
    prefill_times: list[tuple[int, int, float]] = field(default_factory=list)  # (n, context, seconds)
    decode_time: float | None = None
    end: float = 0.0


@dataclass(slots=True)
class CoreStats:
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected_too_large: int = 0
    rejected_queue_full: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    pd_pins: int = 0  # prefills for a remote decode that pinned their prompt's blocks
    pd_pins_pulled: int = 0  # ... released because a peer pulled every block
    pd_pins_expired: int = 0  # ... released because the bound passed first


class EngineCore:
    def __init__(
        self,
        lm: LoadedModel,
        cfg: EngineConfig,
        *,
        on_evict: EvictHook | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if cfg.block_size < 1:
            raise ValueError("block_size must be positive")
        if cfg.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.lm = lm
        self.cfg = cfg
        self.bs = cfg.block_size
        self.namespace = Namespace(lm.model_id, lm.revision, "", lm.dtype_name, cfg.parallel, cfg.block_size)
        self.hasher = BlockHasher.for_namespace(self.namespace)
        num_blocks = resolve_num_blocks(cfg, lm)
        self.lock = threading.RLock()  # re-entrant: a store called under it may call back (on_drop)
        self.wake = threading.Condition(self.lock)
        self._clock = clock
        self.pool = KVPool(lm.kv, num_blocks, cfg.block_size, lm.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size, on_evict=on_evict)
        self.prefill_fit = PrefillFit()
        self.tiers: KVTiers | None = None
        if cfg.tiers is not None and cfg.tiers.enabled:
            self.tiers = KVTiers(cfg.tiers, pool=self.pool, blocks=self.blocks, namespace=self.namespace,
                                 lock=self.lock, wake=self.wake, on_loaded=self._loaded,
                                 prefill_cost=self.prefill_fit.predict,
                                 prefill_samples=lambda: self.prefill_fit.samples)
            offload = self.tiers.offload
            if on_evict is not None:
                user = on_evict

                def both(evicted: list[EvictedBlock]) -> None:
                    offload(evicted)
                    user(evicted)

                self.blocks.on_evict = both
            else:
                self.blocks.on_evict = offload
        self.scheduler = Scheduler(self.blocks, cfg.max_num_batched_tokens, cfg.max_num_seqs, self.tiers)
        # every layer windowed: blocks out of the window are released as sequences advance
        self.window = lm.kv.window_only
        self.blocks.window = self.window
        self.runner = ModelRunner(lm.model, self.pool, lm.device, lm.lora, window=self.window)
        self.sampler = Sampler(lm.eos_ids)
        self.decode_step = Ewma()
        self.stats = CoreStats()
        self.max_context = min(lm.max_positions, num_blocks * cfg.block_size)
        self.seqs: dict[str, Sequence] = {}
        self.pins: dict[str, PdPin] = {}  # pin id -> prompt blocks kept for a remote decode

    def close(self) -> None:
        """Stop the tiers' threads (queued writes finish first) and close their stores."""
        if self.tiers is not None:
            self.tiers.close()

    # ------------------------------------------------------------------ requests

    def new_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        shared_prefix_blocks: int = 0,
        lora: str | None = None,
    ) -> Sequence:
        """A request as the engine holds it, keys hashed (no engine state touched: no lock needed)."""
        if not prompt_ids:
            raise BadRequest("the prompt must have at least one token", param="prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.lm.vocab_size:
            raise BadRequest(f"prompt token ids must be in [0, {self.lm.vocab_size - 1}]", param="prompt")
        if shared_prefix_blocks < 0:
            raise BadRequest("shared_prefix_blocks must be >= 0", param="kv.shared_prefix_blocks")
        ns = self.namespace.scoped(
            lora=lora, cache_salt=cache_salt or "", shared_prefix_blocks=shared_prefix_blocks
        )
        scope = KeyScope(self.hasher, ns)
        tokens = list(prompt_ids)
        return Sequence(
            request_id=request_id,
            token_ids=tokens,
            prompt_len=len(tokens),
            params=params,
            scope=scope,
            keys=scope.prompt_keys(tokens),
            arrival=self._clock(),
            text=OutputText(self.lm.tokenizer.decode, tokens, params.stop),
            usage=Usage(len(tokens)),
        )

    def add(self, seq: Sequence) -> None:
        """Queue a sequence. Raises RequestTooLarge (400), QueueFull (429), BadRequest."""
        total = seq.prompt_len + seq.params.max_tokens
        if total > self.max_context:
            self.stats.rejected_too_large += 1
            raise RequestTooLarge(
                f"this worker's maximum context is {self.max_context} tokens (model positions and KV pool); "
                f"the request has {seq.prompt_len} prompt tokens + {seq.params.max_tokens} max_tokens",
                param="max_tokens",
            )
        if seq.request_id in self.seqs:
            raise BadRequest(f"request id {seq.request_id!r} is already in flight", param="request_id")
        waiting = len(self.scheduler.waiting)
        if waiting >= self.cfg.max_waiting:
            self.stats.rejected_queue_full += 1
            raise QueueFull(
                f"worker {self.cfg.worker_id} has {waiting} requests waiting (max_waiting)",
                retry_after=max(1.0, math.ceil(self.estimate_queue_s())),
            )
        seq.cached_hint = self._held_prefix(seq) * self.bs
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def _held_prefix(self, seq: Sequence) -> int:
        """Leading blocks of the request this worker holds now, on GPU or in a lower tier
        (those load beside the compute: /load and the queue estimate do not count them as
        prefill work)."""
        cap = seq.cacheable_blocks
        n = self.blocks.gpu_prefix(seq.keys, cap)
        tiers = self.tiers
        if tiers is not None:
            while n < cap and tiers.held(seq.key(n)):
                n += 1
        return n

    def abort(self, request_id: str) -> bool:
        """Drop a request (the client went away). A waiting one goes at once; a running one
        is released at the next step boundary (a forward may be using its blocks)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.aborted:
            return False
        seq.aborted = True
        if seq.status is SeqStatus.WAITING:
            self.scheduler.waiting.remove(seq)
            self._retire(seq)
        elif seq.status is SeqStatus.LOADING and self.tiers is not None:
            self.tiers.cancel(seq)  # released when its transfers moving now have landed
        return True

    # ------------------------------------------------------------------ the step

    def step(self, timeout: float = 60.0) -> list[SeqUpdate]:
        """One whole step (tests, benchmarks): waits for loads in flight when nothing else can run."""
        with self.wake:
            plan = self.schedule()
            deadline = time.monotonic() + timeout
            while plan.empty and self.scheduler.loading and time.monotonic() < deadline:
                self.wake.wait(0.05)
                plan = self.schedule()
        if plan.empty:
            return []
        result = self.execute(plan)
        with self.lock:
            return self.commit(plan, result)

    def schedule(self) -> StepPlan:
        self._reap()
        plan = self.scheduler.schedule()
        now = self._clock()
        for seq in plan.admitted + plan.loading:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            if seq.first_token is None:  # what the first token's prefill reused and computed
                self._account_admission(seq)
        self.stats.preemptions += len(plan.preempted)
        return plan

    def _account_admission(self, seq: Sequence) -> None:
        """Usage of the device prefix a sequence was admitted with; blocks a prefetch landed
        count as loaded from the prefetch's source tier."""
        u = seq.usage
        bs = self.bs
        g = seq.num_computed // bs
        u.loaded_tokens = dict.fromkeys(u.loaded_tokens, 0)
        u.prefetched_tokens = 0
        credit = self.tiers.credit_gpu_hits(seq.keys[seq.num_trimmed:g]) if self.tiers is not None else {}
        for tier, n in credit.items():
            u.loaded_tokens[tier.name] += n * bs
            u.prefetched_tokens += n * bs
        u.loaded_tokens["GPU"] = seq.num_computed - u.prefetched_tokens
        u.recomputed_tokens = seq.prompt_len - seq.num_computed
        seq.loaded_at = None

    def _loaded(self, seq: Sequence, landed: int, by_tier: dict[Tier, int], prefetched: int) -> None:
        """A LOADING sequence's transfers all ended (under the lock, on a link thread): its
        leading `landed` loaded blocks join its prefix, the rest is recomputed."""
        bs = self.bs
        self.scheduler.loading.remove(seq)
        seq.num_computed += landed * bs
        seq.loaded_at = self._clock()
        self.blocks.commit(seq)  # registers the loaded blocks (BlockStored GPU)
        if seq.aborted:
            self.blocks.release(seq)
            self._retire(seq)
            return
        if seq.first_token is None:
            u = seq.usage
            for tier, n in by_tier.items():
                u.loaded_tokens[tier.name] += n * bs
            u.prefetched_tokens += prefetched * bs
            u.recomputed_tokens = seq.prompt_len - seq.num_computed
        seq.status = SeqStatus.RUNNING
        self.scheduler.running.append(seq)

    def execute(self, plan: StepPlan) -> StepResult:
        """Forwards and sampling (no bookkeeping: safe without the caller's lock)."""
        if self.tiers is not None and self.tiers.cuda:
            self.tiers.before_compute()
        res = StepResult()
        done: list[Sequence] = []
        rows: list[torch.Tensor] = []
        for seq, n in plan.prefills:
            t = self.runner.prefill(seq, n)
            res.prefill_times.append((n, seq.num_computed, t.seconds))
            if seq.num_computed + n == seq.num_tokens:
                done.append(seq)
                rows.append(t.logits)
        if plan.decodes:
            t = self.runner.decode(plan.decodes)
            res.decode_time = t.seconds
            for row, seq in enumerate(plan.decodes):
                if seq.num_computed + 1 == seq.num_tokens:
                    done.append(seq)
                    rows.append(t.logits[row])
        if done:
            logits = torch.stack(rows)
            toks = self.sampler.sample(done, logits)
            res.tokens = dict(zip(done, toks, strict=True))
            res.logits = dict(zip(done, logits, strict=True))
            res.logprobs = {done[i]: lp for i, lp in self.sampler.logprobs(done, logits, toks).items()}
        res.end = self._clock()
        return res

    def commit(self, plan: StepPlan, result: StepResult) -> list[SeqUpdate]:
        updates: list[SeqUpdate] = []
        for seq, n in plan.items():
            seq.num_computed += n
            self.stats.computed_tokens += n
            if seq.aborted:
                continue
            self.blocks.commit(seq)
            if self.window is not None:
                self.blocks.trim(seq, self.window)
            tok = result.tokens.get(seq)
            if tok is not None:
                updates.append(self._append(seq, tok, result.end, result.logprobs.get(seq)))
        for n, c, seconds in result.prefill_times:
            self.prefill_fit.add(n, c, seconds)
        if result.decode_time is not None:
            self.decode_step.add(result.decode_time)
        self.stats.steps += 1
        self._reap()
        return updates

    def fail(self, plan: StepPlan, message: str) -> list[SeqUpdate]:
        """A step raised: every sequence in it ends with an error (its blocks freed)."""
        return self._fail([seq for seq, _ in plan.items()], message)

    def fail_all(self, message: str) -> list[SeqUpdate]:
        """The worker is going away: every accepted request ends with an error."""
        return self._fail(list(self.seqs.values()), message)

    def _fail(self, seqs: list[Sequence], message: str) -> list[SeqUpdate]:
        out = []
        for seq in seqs:
            if seq.aborted:
                continue
            seq.finish_reason = "error"
            self.abort(seq.request_id)
            out.append(SeqUpdate(seq, [], "", True, message))
        self._reap()
        return out

    def _append(self, seq: Sequence, tok: int, now: float, lp: TokenLogprob | None = None) -> SeqUpdate:
        seq.token_ids.append(tok)
        if seq.first_token is None:
            seq.first_token = now
        seq.last_token = now
        self.stats.generated_tokens += 1
        p = seq.params
        # min_tokens, as vLLM: the sampler masks EOS until that many tokens are out, and stop
        # strings are looked for only in the text of the tokens after them
        eos = tok in self.lm.eos_ids and not p.ignore_eos and seq.num_output >= p.min_tokens
        text = "" if eos else seq.text.add(tok, check_stop=seq.num_output > p.min_tokens)
        reason = None
        if eos or seq.text.stopped:
            reason = "stop"
        elif seq.num_output >= p.max_tokens or seq.num_tokens >= self.max_context:
            reason = "length"
        if reason is not None:
            text += seq.text.finish()
            seq.finish_reason = reason
            seq.status = SeqStatus.FINISHED
            self._fill_usage(seq)
            if seq.pd_pin is not None:
                self._pin_prompt(seq, seq.pd_pin)
        return SeqUpdate(seq, [tok], text, reason is not None, logprobs=None if lp is None else [lp])

    def _fill_usage(self, seq: Sequence) -> None:
        u = seq.usage
        u.completion_tokens = seq.num_output
        arrival = seq.arrival
        sched = seq.first_scheduled if seq.first_scheduled is not None else arrival
        first = seq.first_token if seq.first_token is not None else sched
        last = seq.last_token if seq.last_token is not None else first
        loaded = seq.loaded_at if seq.loaded_at is not None else sched
        u.queue_ms = (sched - arrival) * 1e3
        u.load_ms = (loaded - sched) * 1e3
        u.prefill_ms = (first - loaded) * 1e3
        u.ttft_ms = (first - arrival) * 1e3
        u.decode_ms = (last - first) * 1e3

    def _reap(self) -> None:
        """Release finished and aborted running sequences."""
        sched = self.scheduler
        gone = [s for s in sched.running if s.aborted or s.status is SeqStatus.FINISHED]
        for seq in gone:
            sched.running.remove(seq)
            self.blocks.release(seq)
            self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        if seq.finish_reason == "error":
            self.stats.failed += 1
        elif seq.aborted:
            self.stats.cancelled += 1
        else:
            self.stats.finished += 1
        seq.status = SeqStatus.FINISHED

    def calibrate(self) -> None:
        """Seed the speed fits before any traffic (and warm the kernels): prefill chunks of a
        few sizes, fresh and after as much context, and decode steps, run on free blocks
        whose content nobody reads. Only on an idle engine with an untouched pool."""
        budget = self.cfg.max_num_batched_tokens
        room = (self.blocks.num_blocks * self.bs - 1) // 2  # a chunk after as much context, in the pool
        sizes = sorted({max(2, min(budget, room, n)) for n in (self.bs, 128, 512, 2048)})
        need = -(-(2 * sizes[-1] + 1) // self.bs)
        if self.seqs or self.blocks.used() or need > self.blocks.num_blocks:
            return
        tokens = [i % self.lm.vocab_size for i in range(2 * sizes[-1] + 1)]
        seq = self.new_sequence("calibration", tokens, SamplingParams(max_tokens=1))
        seq.block_table = list(range(need))
        self.runner.prefill(seq, sizes[0])  # warm-up, not measured
        for n in sizes:
            for c in (0, n):
                seq.num_computed = c
                self.prefill_fit.add(n, c, self.runner.prefill(seq, n).seconds)
        seq.num_computed = 2 * sizes[-1]
        for _ in range(3):
            self.decode_step.add(self.runner.decode([seq]).seconds)

    # ------------------------------------------------------------------ prefill/decode pins

    def _pin_prompt(self, seq: Sequence, pin_id: str) -> None:
        """A prefill for a remote decode finished: reference the leading registered blocks of
        its prompt a decode worker can reuse (its last token is always computed there), so
        that they stay on the device until pulled or until the bound (under the lock)."""
        n = (seq.prompt_len - 1) // self.bs
        keys: list[bytes] = []
        bids: list[int] = []
        for k in seq.keys[:n]:
            bid = self.blocks.by_key.get(k)
            if bid is None:
                break
            self.blocks.acquire(bid)
            keys.append(k)
            bids.append(bid)
        self.pins[pin_id] = PdPin(keys, bids, set(keys), self._clock() + self.cfg.pd_pin_s)
        self.stats.pd_pins += 1

    def pinned_keys(self, pin_id: str) -> list[bytes]:
        pin = self.pins.get(pin_id)
        return list(pin.keys) if pin is not None else []

    def unpin(self, pin_id: str) -> bool:
        """Release a pin's blocks, tail first (under the lock). False when it is gone already."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        for bid in reversed(pin.bids):
            self.blocks.release_block(bid)
        return True

    def pulled(self, keys: list[bytes]) -> int:
        """A peer was sent the records of `keys`: pins whose every block went out are released
        (under the lock). Returns how many were."""
        if not self.pins:
            return 0
        sent = set(keys)
        done = []
        for pid, pin in self.pins.items():
            pin.pending -= sent
            if not pin.pending:
                done.append(pid)
        for pid in done:
            self.unpin(pid)
        self.stats.pd_pins_pulled += len(done)
        return len(done)

    def expire_pin(self, pin_id: str) -> bool:
        """The bound of a pin passed: release it if no peer pulled it first (under the lock)."""
        if not self.unpin(pin_id):
            return False
        self.stats.pd_pins_expired += 1
        return True

    def pinned_blocks(self) -> int:
        """Device blocks held for remote decodes now (a block in two pins counts once)."""
        return len({bid for pin in self.pins.values() for bid in pin.bids})

    # ------------------------------------------------------------------ KV

    def purge(self, cache_salt: str | None, everything: bool) -> int:
        """Drop the salt's blocks (or all) from every tier; distinct blocks dropped (under the lock)."""
        keys = self.blocks.purge_keys(cache_salt, everything)
        if self.tiers is None:
            return len(keys)
        return self.tiers.purge(cache_salt, everything, keys)

    def take_events(self) -> list[KVEvent]:
        return per_group(self.blocks.take_events(), self.lm.kv.groups if self.lm.kv.sliding else None)

    # ------------------------------------------------------------------ reports

    def estimate_queue_s(self) -> float:
        """Wait before a request arriving now starts its prefill: the prefill of everything
        queued (less what it loads) or half-prefilled (each at its own context), plus one decode step per
        budget-sized step while sequences decode alongside."""
        pending = [(s.num_tokens - s.cached_hint, s.cached_hint) for s in self.scheduler.waiting]
        pending += [(s.num_uncomputed, s.num_computed) for s in self.scheduler.running if s.num_uncomputed > 1]
        pending += [self._after_load(s) for s in self.scheduler.loading]
        tokens = sum(n for n, _ in pending)
        if not tokens:
            return 0.0
        t = sum(self.prefill_fit.predict(n, c) or 0.0 for n, c in pending)
        decoding = sum(1 for s in self.scheduler.running if s.num_uncomputed == 1)
        if decoding and self.decode_step.value is not None:
            t += math.ceil(tokens / self.cfg.max_num_batched_tokens) * self.decode_step.value
        return t

    def _after_load(self, seq: Sequence) -> tuple[int, int]:
        """(tokens left to prefill, context) of a LOADING sequence if its loads all land."""
        load = seq.loading
        done = seq.num_computed + (len(load.sources) * self.bs if load is not None else 0)
        return seq.num_tokens - done, done

    def speeds(self) -> Speeds:
        co = self.prefill_fit.coefficients()
        tps, attn, overhead = co if co is not None else (None, None, None)
        return Speeds(
            prefill_tokens_per_s=tps,
            prefill_attn_s_per_token2=attn,
            prefill_overhead_s=overhead,
            decode_step_s=self.decode_step.value,
        )

    def load_report(self) -> LoadReport:
        sched = self.scheduler
        b = self.blocks
        blocks = {"GPU": BlockCounts(b.used(), b.num_blocks - b.used(), b.num_blocks)}
        tiers = self.tiers
        if tiers is not None:
            blocks.update(tiers.blocks_report())
        return LoadReport(
            worker_id=self.cfg.worker_id,
            ts=time.time(),
            waiting_requests=len(sched.waiting),
            waiting_prefill_tokens=sum(s.num_tokens - s.cached_hint for s in sched.waiting),
            running_requests=len(sched.running) + len(sched.loading),
            running_prefill_tokens=(sum(s.num_uncomputed for s in sched.running if s.num_uncomputed > 1)
                                    + sum(self._after_load(s)[0] for s in sched.loading)),
            est_queue_s=self.estimate_queue_s(),
            blocks=blocks,
            speeds=self.speeds(),
            tiers=tiers.links_report() if tiers is not None else {},
            prefetch_queue=len(tiers.prefetches) if tiers is not None else 0,
            max_waiting=self.cfg.max_waiting,
            block_size=self.bs,
        )

    def info(self) -> WorkerInfo:
        ns = self.namespace
        return WorkerInfo(
            worker_id=self.cfg.worker_id,
            kind="kvroute",
            engine="torch",
            model=self.lm.model_id,
            served_model_names=list(self.lm.served_names),
            namespace=NamespaceInfo(
                ns.model, ns.revision, ns.tokenizer_revision, ns.kv_dtype, ns.parallel, ns.block_size
            ),
            namespace_digest=ns.digest.hex(),
            block_size=self.bs,
            block_bytes=self.pool.block_bytes,
            max_context_tokens=self.max_context,
            kv_capacity_tokens=self.blocks.num_blocks * self.bs,
            remote_group=self.tiers.remote_group if self.tiers is not None else None,
            capabilities=self.capabilities(),
            role=self.cfg.role,
        )

    def capabilities(self) -> list[str]:
        tiers = self.tiers
        if tiers is None:
            return ["purge"]
        return ["prefetch", "peer_pull", "purge"] if Tier.PEER in tiers.links else ["prefetch", "purge"]
