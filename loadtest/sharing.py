"""A seeded prefix-sharing model for traces that carry none (Azure, BurstGPT).

Those traces give only arrival times and lengths, but routing is about prefixes, so
we lay a documented, reproducible structure over them. Every prompt is cut into
`block_tokens`-token blocks (16 by default, so sharing is token-accurate to 16
tokens) and each block gets an id; equal ids are equal tokens (`loadtest.tokens`).
A prompt is built, in this order of preference:

1. **Follow-up turn.** With probability `followup_prob` (or always, when the trace
   names the request's session and that session's previous prompt fits), the request
   continues an earlier conversation that has been active within `session_idle_s`:
   its prompt starts with the previous prompt of that conversation (all of it,
   rounded up to a whole block — the new turn completes the partial block) and
   the rest is new. Only conversations whose previous prompt is no longer than this
   prompt qualify (a later turn never shrinks the context). Candidates are sampled
   among the `session_candidates` most recently active conversations.
2. **Shared system prompt.** Otherwise, with probability `system_prob`, the prompt
   starts with one of `system_prompts` system prompts, picked with Zipf popularity
   (rank^-`system_zipf`); their lengths are lognormal (median
   `system_tokens_median`, sigma `system_tokens_sigma`), rounded to whole blocks.
   A prompt shorter than its system prompt is a prefix of it.
3. Otherwise the prompt is unique.

Output tokens never become part of a later prompt's shared prefix: a replayed
engine generates its own tokens, which no synthesised prompt could reproduce.
Everything is drawn from one `numpy` generator seeded with `seed`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from .trace import Trace, TraceError, TraceRequest


@dataclass(frozen=True, slots=True)
class SharingModel:
    seed: int = 0
    block_tokens: int = 16
    system_prompts: int = 8
    system_prob: float = 0.6
    system_zipf: float = 1.2
    system_tokens_median: int = 768
    system_tokens_sigma: float = 0.6
    followup_prob: float = 0.3
    session_idle_s: float = 900.0
    session_candidates: int = 32
    max_sessions: int = 8192

    def __post_init__(self) -> None:
        for name in ("system_prob", "followup_prob"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise TraceError(f"sharing.{name} must be in [0, 1], got {v}")
        if self.block_tokens <= 0 or self.system_prompts < 0 or self.system_tokens_median <= 0:
            raise TraceError("sharing: block_tokens and system_tokens_median must be > 0, system_prompts >= 0")
        if self.session_idle_s <= 0 or self.session_candidates <= 0 or self.max_sessions <= 0:
            raise TraceError("sharing: session_idle_s, session_candidates and max_sessions must be > 0")

    def describe(self) -> str:
        return (
            f"sharing model (loadtest/sharing.py): seed={self.seed}, block={self.block_tokens} tokens, "
            f"follow-ups p={self.followup_prob} within {self.session_idle_s:g}s, "
            f"{self.system_prompts} system prompts p={self.system_prob} zipf={self.system_zipf} "
            f"median {self.system_tokens_median} tokens"
        )


# The default model of the trace loaders (`sharing=`); frozen, so one shared instance is safe.
DEFAULT_SHARING = SharingModel()


@dataclass(slots=True)
class SharingStats:
    followups: int = 0
    system_prefixed: int = 0
    unique: int = 0

    def describe(self, n: int) -> str:
        n = max(n, 1)
        return (
            f"follow-up turns {self.followups / n:.1%}, system-prompted {self.system_prefixed / n:.1%}, "
            f"unique {self.unique / n:.1%}"
        )


def assign_hash_ids(
    model: SharingModel,
    arrivals: Sequence[float],
    input_lengths: Sequence[int],
    sessions: Sequence[str | None] | None = None,
) -> tuple[list[tuple[int, ...]], SharingStats]:
    """Block ids for each request, in order, per the model above."""
    rng = np.random.default_rng(model.seed)
    bt = model.block_tokens
    next_id = 0

    def fresh(n: int) -> tuple[int, ...]:
        nonlocal next_id
        out = tuple(range(next_id, next_id + n))
        next_id += n
        return out

    # System prompts: lengths in whole blocks, ids allocated up front.
    sys_ids: list[tuple[int, ...]] = []
    if model.system_prompts:
        lens = rng.lognormal(np.log(model.system_tokens_median), model.system_tokens_sigma, model.system_prompts)
        for L in lens:
            sys_ids.append(fresh(max(1, int(round(L / bt)))))
        w = np.arange(1, model.system_prompts + 1, dtype=np.float64) ** -model.system_zipf
        sys_p = w / w.sum()

    # Conversations: key -> (last arrival, ids, input length), most recent last.
    convs: OrderedDict[str, tuple[float, tuple[int, ...], int]] = OrderedDict()
    stats = SharingStats()
    out: list[tuple[int, ...]] = []
    anon = 0
    for i, (t, L) in enumerate(zip(arrivals, input_lengths, strict=True)):
        n_blocks = -(-L // bt)
        sess = sessions[i] if sessions is not None else None
        prefix: tuple[int, ...] = ()
        key: str | None = None
        if sess is not None:
            prev = convs.get(sess)
            key = sess
            if prev is not None and t - prev[0] <= model.session_idle_s and len(prev[1]) * bt <= L:
                prefix = prev[1]
        elif convs and rng.random() < model.followup_prob:
            # Sample among the most recently active conversations.
            keys = list(islice(reversed(convs), model.session_candidates))
            order = rng.permutation(len(keys))
            for k in order:
                last, ids, _ = convs[keys[k]]
                if t - last > model.session_idle_s:
                    continue
                if len(ids) * bt <= L:
                    prefix, key = ids, keys[k]
                    break
        if prefix:
            stats.followups += 1
        elif sys_ids and rng.random() < model.system_prob:
            k = int(rng.choice(len(sys_ids), p=sys_p))
            prefix = sys_ids[k][:n_blocks]
            stats.system_prefixed += 1
        else:
            stats.unique += 1
        ids = prefix + fresh(n_blocks - len(prefix))
        out.append(ids)
        if key is None:
            key = f"anon-{anon}"
            anon += 1
        convs[key] = (t, ids, L)
        convs.move_to_end(key)
        while len(convs) > model.max_sessions:
            convs.popitem(last=False)
    return out, stats


def trace_from_lengths(
    name: str,
    source: str,
    ts: list[float],
    ins: list[int],
    outs: list[int],
    sessions: list[str | None] | None,
    sharing: SharingModel | None,
    models: list[str | None] | None = None,
) -> Trace:
    """A trace from arrival times and lengths (the CSV loaders): re-base, lay the model, build."""
    t0 = ts[0] if ts else 0.0
    arrivals = [t - t0 for t in ts]
    model = sharing or SharingModel(followup_prob=0.0, system_prob=0.0, system_prompts=0)
    if sharing is None and sessions is not None:
        sessions = None  # no sharing asked for: ignore session ids too
    ids, st = assign_hash_ids(model, arrivals, ins, sessions)
    reqs = [
        TraceRequest(
            index=k,
            arrival_s=arrivals[k],
            input_length=ins[k],
            output_length=max(1, outs[k]),
            hash_ids=ids[k],
            session=sessions[k] if sessions is not None else None,
            model=models[k] if models is not None else None,
        )
        for k in range(len(ts))
    ]
    desc = model.describe() if sharing is not None else "none (every prompt unique)"
    notes = [f"prefix sharing: {desc}; {st.describe(len(reqs))}"]
    return Trace(name, model.block_tokens, reqs, source=source, sharing=desc, notes=notes)
