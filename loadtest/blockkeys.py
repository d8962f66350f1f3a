"""Fleet block keys for trace requests, computed once per distinct trace block.

The simulator needs every request's chained keys (kvindex.keys) at the fleet's
block size, exactly as the gateway computes them from the token ids it forwards:
`BlockHasher.for_namespace(ns).keys_for(tokens, ns.scoped(lora, cache_salt))`.
Hashing a whole 67-M-token trace block by block is seconds of work, and a third of
Mooncake's blocks repeat an earlier one; when the fleet block divides the trace
block, a trace block's fleet keys depend only on (scope, parent key, block id), so
they are memoised on that triple (bounded; cleared when full). Other block sizes
hash the whole prompt. `KeyCache` keeps each request's keys and digests for the runs
that share a trace.
"""
from __future__ import annotations

from kvindex.keys import ROOT_KEY, BlockHasher, Namespace, digests64

from .tokens import TokenSynth
from .trace import TraceRequest


class TraceKeyer:
    def __init__(self, synth: TokenSynth, ns: Namespace, *, max_memo_keys: int = 4_000_000) -> None:
        self.synth = synth
        self.ns = ns.model_level()
        self.block_size = ns.block_size
        self.hasher = BlockHasher.for_namespace(self.ns)
        bt = synth.block_tokens
        self._per_block = bt // self.block_size if bt % self.block_size == 0 else 0
        self._memo: dict[tuple[int, bytes, int], tuple[bytes, ...]] = {}
        self._memo_keys = 0
        self._max_memo_keys = max_memo_keys
        self._scopes: dict[tuple[str | None, str | None, int], tuple[int, Namespace]] = {}
        self.hashed_blocks = 0  # blocks actually hashed (memo misses)

    def scope(self, req: TraceRequest, shared_prefix_blocks: int = 0) -> tuple[int, Namespace]:
        """(small id, namespace) of the request's LoRA / cache-salt scope."""
        sk = (req.lora, req.cache_salt, shared_prefix_blocks)
        s = self._scopes.get(sk)
        if s is None:
            ns = self.ns.scoped(
                lora=req.lora, cache_salt=req.cache_salt or "", shared_prefix_blocks=shared_prefix_blocks
            )
            s = self._scopes[sk] = (len(self._scopes), ns)
        return s

    def keys(self, req: TraceRequest, shared_prefix_blocks: int = 0) -> list[bytes]:
        """Keys of every full fleet block of the request's prompt."""
        sid, ns = self.scope(req, shared_prefix_blocks)
        B = self.block_size
        n_full = req.input_length // B
        extra = ns.extra_keys(n_full)
        k = self._per_block
        if not k:
            self.hashed_blocks += n_full
            return self.hasher.keys(self.synth.token_bytes(req), extra)
        bt = self.synth.block_tokens
        out: list[bytes] = []
        parent = ROOT_KEY
        memo = self._memo
        for j, h in enumerate(req.hash_ids):
            first = j * k
            if first >= n_full:
                break
            if (j + 1) * bt <= req.input_length:
                mk = (sid, parent, h)
                ks = memo.get(mk)
                if ks is None:
                    ks = tuple(
                        self.hasher.keys(
                            self.synth.block(h).tobytes(),
                            extra[first : first + k] if extra is not None else None,
                            parent,
                        )
                    )
                    self.hashed_blocks += k
                    if self._memo_keys + k > self._max_memo_keys:
                        memo.clear()
                        self._memo_keys = 0
                    memo[mk] = ks
                    self._memo_keys += k
                out.extend(ks)
            else:  # the partial last trace block: its full fleet blocks only, not memoised
                n = n_full - first
                ks2 = self.hasher.keys(
                    self.synth.block(h)[: n * B].tobytes(),
                    extra[first : first + n] if extra is not None else None,
                    parent,
                )
                self.hashed_blocks += n
                out.extend(ks2)
                break
            parent = out[-1]
        return out


class KeyCache:
    """Per-request keys and digests of one trace at one namespace, shared by runs
    (cached by request index and scope, so a scenario's per-run LoRA/salt changes stay apart)."""

    def __init__(self, keyer: TraceKeyer) -> None:
        self.keyer = keyer
        self._cache: dict[tuple[int, str | None, str | None], tuple[list[bytes], list[int]]] = {}

    def get(self, req: TraceRequest) -> tuple[list[bytes], list[int]]:
        ck = (req.index, req.lora, req.cache_salt)
        kd = self._cache.get(ck)
        if kd is None:
            keys = self.keyer.keys(req)
            kd = self._cache[ck] = (keys, digests64(keys))
        return kd
