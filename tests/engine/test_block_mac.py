"""The keyed MAC of blocks that leave a worker (workers/engine/store/mac.py), and the
REMOTE store refusing values whose MAC does not verify. Needs redis-server for the store
part (skipped loudly otherwise, like tests/engine/test_engine_store.py)."""
from __future__ import annotations

import hashlib
import hmac
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.engine.store.mac import MAC_SIZE, BlockMac
from workers.engine.store.record import encode
from workers.engine.testing import RedisServer, redis_binary
from workers.fleetkeys import block_mac_key, hkdf_sha256, peer_bearer

SECRET = "fleet-secret-for-tests"
KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
META, PAYLOAD = b"\x95\xc4\x00\x90\xc0\xc0\xc0", bytes(range(256)) * 64
SCOPE = b"REMOTE\0kvroute-abc:g0:"


def test_hkdf_matches_rfc5869_test_case_3() -> None:
    """RFC 5869 A.3 (SHA-256, no salt, no info): the KDF is HKDF, not a look-alike."""
    okm = hkdf_sha256(bytes([0x0B] * 22), b"", 42)
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
                         "9d201395faa4b61a96c8")


def test_tag_binds_scope_key_meta_payload_and_secret() -> None:
    mac = BlockMac(SECRET)
    tag = mac.tag(SCOPE, KEY, META, PAYLOAD)
    assert len(tag) == MAC_SIZE and mac.verify(SCOPE, KEY, META, PAYLOAD, tag)
    flipped = bytearray(PAYLOAD)
    flipped[1000] ^= 1
    assert not mac.verify(SCOPE, KEY, META, bytes(flipped), tag)
    assert not mac.verify(SCOPE, KEY, META + b"x", PAYLOAD, tag)
    assert not mac.verify(SCOPE, OTHER_KEY, META, PAYLOAD, tag)  # replayed under another key
    assert not mac.verify(b"REMOTE\0kvroute-abc:g1:", KEY, META, PAYLOAD, tag)  # another group
    assert not mac.verify(b"PEER\0kvroute-abc", KEY, META, PAYLOAD, tag)  # another tier
    assert not mac.verify(SCOPE, KEY, META[:-1], META[-1:] + PAYLOAD, tag)  # the same bytes framed otherwise
    assert not BlockMac(SECRET + "x").verify(SCOPE, KEY, META, PAYLOAD, tag)
    assert not mac.verify(SCOPE, KEY, META, PAYLOAD, tag[:-1])
    # the secret is not the MAC key: a tag keyed with the raw token does not verify
    raw = hmac.new(SECRET.encode(), SCOPE + KEY + META + PAYLOAD, hashlib.sha256).digest()
    assert not mac.verify(SCOPE, KEY, META, PAYLOAD, raw)
    # nor does one keyed with the bearer token peers are shown
    shown = hmac.new(peer_bearer(SECRET).encode(), SCOPE + KEY + META + PAYLOAD, hashlib.sha256).digest()
    assert not mac.verify(SCOPE, KEY, META, PAYLOAD, shown)
    assert len(block_mac_key(SECRET)) == 32
    assert SECRET not in peer_bearer(SECRET) and peer_bearer(SECRET) != peer_bearer(SECRET + "x")
    with pytest.raises(ValueError):
        BlockMac("")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    pytest.importorskip("redis")
    if redis_binary() is None:
        msg = "!!! REMOTE MAC TESTS SKIPPED: no redis-server on PATH; forged REMOTE values were NOT tested !!!"
        warnings.warn(msg, stacklevel=1)
        pytest.skip(msg)
    s = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    try:
        yield s
    finally:
        s.stop()


def _store(server: RedisServer, group: str, drops: list[bytes], secret: str = SECRET):  # type: ignore[no-untyped-def]
    from workers.engine.store.remote import RedisConfig, RedisStore

    return RedisStore(RedisConfig(port=server.port, group=group), on_drop=drops.extend, mac=BlockMac(secret))


def test_remote_value_without_a_valid_mac_is_a_miss(server: RedisServer) -> None:
    drops: list[bytes] = []
    st = _store(server, "m1", drops)
    assert st.put(KEY, META, PAYLOAD)
    rec = st.get(KEY)
    assert rec is not None and rec.payload == PAYLOAD and st.stats.mac_failures == 0
    raw = server.client()
    name = st._name(KEY)
    wrong = bytes(reversed(PAYLOAD))
    forged = encode(KEY, META, wrong)  # a valid record: layout, key and crcs
    for value in (forged + BlockMac("guessed").tag(st.scope, KEY, META, wrong), forged + b"\0" * MAC_SIZE):
        raw.set(name, value)
        assert st.get(KEY) is None
        assert not raw.exists(name) and drops[-1] == KEY  # deleted and reported
    assert st.stats.mac_failures == 2 and st.stats.checksum_errors == 0
    # a value another fleet (another secret) wrote is a miss too
    other = _store(server, "m1", [], secret="another fleet")
    assert other.put(KEY, META, PAYLOAD) and st.get(KEY) is None and st.stats.mac_failures == 3
    st.close()
    other.close()


def test_remote_value_replayed_into_another_group_is_a_miss(server: RedisServer) -> None:
    a, b = _store(server, "ga", []), _store(server, "gb", [])
    assert a.put(KEY, META, PAYLOAD)
    raw = server.client()
    raw.set(b._name(KEY), raw.get(a._name(KEY)))  # same fleet secret, same key, other group
    assert b.get(KEY) is None and b.stats.mac_failures == 1
    assert a.get(KEY) is not None
    a.close()
    b.close()
