"""Block keys: the documented formula, determinism, chaining, and namespace separation."""
from __future__ import annotations

import dataclasses
import hashlib
import struct

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.keys import (
    BLOCK_TAG,
    KEY_BYTES,
    ROOT_KEY,
    BlockHasher,
    Namespace,
    digest64,
    digests64,
    tokens_to_bytes,
)

BASE = Namespace("meta-llama/Llama-3.1-8B-Instruct", revision="r1", kv_dtype="bfloat16", block_size=4)
TOKENS = list(range(1000, 1000 + 4 * 6))  # 6 blocks


def spec_keys(ns: Namespace, tokens: list[int], extra: list | None = None) -> list[bytes]:
    """The module doc's formula, written out independently of the implementation."""
    out, prev = [], ROOT_KEY
    bs = ns.block_size
    for i in range(len(tokens) // bs):
        e = extra[i] if extra else None
        ns_i = ns.digest if not e else hashlib.sha256(ns.digest + msgspec.msgpack.encode(list(e))).digest()
        block = struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs])
        prev = hashlib.sha256(ns_i + BLOCK_TAG + prev + block).digest()
        out.append(prev)
    return out


def keys_of(ns: Namespace, tokens: list[int] = TOKENS) -> list[bytes]:
    return BlockHasher.for_namespace(ns).keys_for(tokens, ns)


def test_keys_follow_the_documented_formula():
    h = BlockHasher.for_namespace(BASE)
    assert h.keys(TOKENS) == spec_keys(BASE, TOKENS)
    scoped = BASE.scoped(lora="ad", mm_hashes=("img1",), tenant_salt="t", cache_salt="c", shared_prefix_blocks=2)
    assert keys_of(scoped) == spec_keys(BASE, TOKENS, scoped.extra_keys(6))
    assert len(BLOCK_TAG) + len(BASE.digest) == 64 and all(len(k) == KEY_BYTES for k in h.keys(TOKENS))


def test_determinism_chaining_and_partial_blocks():
    h1, h2 = BlockHasher.for_namespace(BASE), BlockHasher(BASE.digest, 4)
    k = h1.keys(TOKENS)
    assert k == h2.keys(TOKENS) == h1.keys(tokens_to_bytes(TOKENS)) == h1.keys(np.array(TOKENS, dtype=np.int64))
    assert h1.keys(TOKENS + [1, 2, 3]) == k  # the trailing partial block is not keyed
    assert h1.keys(TOKENS[4:], parent=k[0]) == k[1:]  # a chain continues from its parent's key
    assert h1.keys(TOKENS, max_blocks=2) == k[:2] and h1.keys(TOKENS, max_blocks=0) == []
    assert h1.keys([1, 2, 3]) == [] and h1.keys_for([], BASE) == []
    assert len(set(k)) == len(k)
    swapped = TOKENS[:4] + TOKENS[8:12] + TOKENS[4:8] + TOKENS[12:]
    ks = h1.keys(swapped)
    assert ks[0] == k[0] and all(a != b for a, b in zip(ks[1:], k[1:], strict=True))  # order matters


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=64), cut=st.integers(0, 16))
def test_prefix_property(tokens, cut):
    h = BlockHasher.for_namespace(BASE)
    full = h.keys(tokens)
    assert h.keys(tokens[: cut * 4]) == full[:cut]
    assert full == spec_keys(BASE, tokens)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other-model"},
        {"revision": "r2"},
        {"tokenizer_revision": "tok2"},
        {"kv_dtype": "fp8_e4m3"},
        {"parallel": "tp2"},
        {"lora": "adapter"},
        {"mm_hashes": ("img-hash",)},
        {"tenant_salt": "tenant-b"},
        {"cache_salt": "req-salt"},
    ],
)
def test_every_namespace_field_separates_every_block(change):
    other = dataclasses.replace(BASE, **change)
    a, b = keys_of(BASE), keys_of(other)
    assert len(a) == len(b) == 6
    assert not set(a) & set(b)  # no key shared, at any position


def test_block_size_is_part_of_the_namespace():
    a = keys_of(BASE)
    b = keys_of(dataclasses.replace(BASE, block_size=8))
    assert not set(a) & set(b)
    assert BASE.digest != dataclasses.replace(BASE, block_size=8).digest


def test_salts_and_shared_prefix_blocks():
    plain = keys_of(BASE)
    t1 = keys_of(BASE.scoped(tenant_salt="t1"))
    t2 = keys_of(BASE.scoped(tenant_salt="t2"))
    assert not set(t1) & set(t2) and not set(t1) & set(plain)
    # a declared shared prefix: the salt applies from block 2 on
    s1 = keys_of(BASE.scoped(tenant_salt="t1", shared_prefix_blocks=2))
    s2 = keys_of(BASE.scoped(tenant_salt="t2", shared_prefix_blocks=2))
    assert s1[:2] == s2[:2] == plain[:2]
    assert not set(s1[2:]) & set(s2[2:]) and not set(s1[2:]) & set(plain)
    # tenant salt and request salt combine; the same request salt under two tenants differs
    assert not set(keys_of(BASE.scoped(tenant_salt="t1", cache_salt="c"))) & set(
        keys_of(BASE.scoped(tenant_salt="t2", cache_salt="c"))
    )


def test_wire_salt_lets_a_worker_reproduce_router_keys():
    router = BASE.scoped(lora="ad", tenant_salt="secret-tenant", cache_salt="c1")
    salt = router.wire_salt
    assert salt is not None and "secret-tenant" not in salt and salt.startswith("t:")
    worker = BASE.scoped(lora="ad", cache_salt=salt)  # what the worker does with the received salt
    assert keys_of(worker) == keys_of(router)
    assert BASE.scoped(cache_salt="c1").wire_salt == "c1" and BASE.wire_salt is None


def test_extra_keys_layout():
    ns = BASE.scoped(lora="L", mm_hashes=("m1", "m2"), cache_salt="s", shared_prefix_blocks=2)
    assert ns.extra_keys(4) == [("L", "m1", "m2"), ("L",), ("L", "s"), ("L",)]
    assert BASE.scoped(cache_salt="s").extra_keys(3) == [("s",), None, None]
    assert BASE.extra_keys(3) is None
    assert BASE.scoped(cache_salt="s", shared_prefix_blocks=-1).extra_keys(2) == [("s",), None]  # clamped
    # extra keys as decoded from the wire (lists inside) key like tuples
    h = BlockHasher.for_namespace(BASE)
    assert h.keys(TOKENS, [(["a", 1],), None]) == h.keys(TOKENS, [(("a", 1),), None])
    # equal in Python, different on the wire: different keys
    assert h.keys(TOKENS, [(1,), (True,)])[1] != h.keys(TOKENS, [(1,), (1,)])[1]
    # an extra key on block j changes block j and everything after it, nothing before
    k = h.keys(TOKENS)
    kx = h.keys(TOKENS, [None, None, None, ("x",)])
    assert kx[:3] == k[:3] and not set(kx[3:]) & set(k)


def test_bad_input_is_refused_clearly():
    h = BlockHasher.for_namespace(BASE)
    with pytest.raises(OverflowError):
        h.keys([1, 2, 3, -1])
    with pytest.raises(OverflowError):
        h.keys([2**32, 0, 0, 0])
    with pytest.raises(OverflowError):
        tokens_to_bytes(np.array([-1, 0]))
    with pytest.raises(TypeError):
        h.keys(["a", "b", "c", "d"])
    with pytest.raises(ValueError):
        BlockHasher(b"short", 4)
    with pytest.raises(ValueError):
        BlockHasher(BASE.digest, 0)


def test_digests():
    k = keys_of(BASE)
    assert digests64(k) == [digest64(x) for x in k] == [int.from_bytes(x[:8], "little") for x in k]
    assert digests64([]) == []
