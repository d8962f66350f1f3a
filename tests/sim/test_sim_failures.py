"""Failure knobs of the simulated engine (virtual clock): a REMOTE backend that goes down
(lookups miss, writes are skipped, everything recomputes, nothing fails), damaged copies
(read, rejected, dropped with BlockRemoved, recomputed from the first bad block), and a
purge by LoRA adapter."""
from __future__ import annotations

from kvindex.events import BlockRemoved, BlockStored
from kvindex.keys import BlockHasher, digests64
from kvindex.tiers import Tier
from workers.sim import RemoteStore, SimEngine, SimRequest
from workers.sim.testing import drain, make_profile

BS = 4


def run(eng: SimEngine | list[SimEngine], target: SimEngine, tokens: list[int], t: float, **kw: object):
    out: dict[str, object] = {}
    target.submit(SimRequest(f"r{t}", len(tokens), 1, token_ids=tokens,
                             on_first_token=lambda tt, u: out.setdefault("ft", tt),
                             on_finish=lambda tt, u: out.setdefault("u", u), **kw), t)  # type: ignore[arg-type]
    drain(eng)
    return out["ft"] - t, out["u"]  # type: ignore[operator]


def toks(seed: int, n: int = 64) -> list[int]:
    return [(seed * 97 + i * 13) % 9000 for i in range(n)]


def test_remote_outage_recomputes_then_recovers() -> None:
    prof = make_profile(block_size=BS, gpu_blocks=17, remote_blocks=100)
    store = RemoteStore("rg0", 100, BS)
    w0, w1 = SimEngine("w0", prof, remote=store), SimEngine("w1", prof, remote=store)
    fleet = [w0, w1]
    a = toks(1)
    miss, _ = run(fleet, w0, a, 1.0)
    run(fleet, w0, toks(2), 2.0)  # a's blocks go to the group's store
    assert len(store) >= 15
    store.set_available(False)
    t_down, u = run(fleet, w1, a, 3.0)
    assert u.loaded_tokens["REMOTE"] == 0 and u.recomputed_tokens == 64
    assert abs(t_down - miss) < 1e-9 and w1.kv.remote_unavailable > 0
    written = store.blocks_written
    run(fleet, w1, toks(3), 4.0)  # w1 evicts: writes are skipped while down
    assert store.blocks_written == written and w1.kv.remote_write_skipped > 0
    keys2 = BlockHasher.for_namespace(prof.namespace()).keys_for(toks(2), prof.namespace().scoped())
    assert w1.match_tiers(keys2)[0] is None
    store.set_available(True)
    t_up, u = run(fleet, w0, toks(2), 5.0)  # w0's blocks of toks(2) left for the store earlier
    assert u.loaded_tokens["REMOTE"] + u.loaded_tokens["GPU"] > 0


def test_damaged_disk_copy_is_dropped_and_recomputed() -> None:
    events: list = []
    prof = make_profile(block_size=BS, gpu_blocks=17, disk_blocks=100)
    eng = SimEngine("w0", prof, on_events=events.extend)
    a = toks(1)
    miss, _ = run(eng, eng, a, 1.0)
    run(eng, eng, toks(2), 2.0)
    ns = prof.namespace()
    keys = BlockHasher.for_namespace(ns).keys_for(a, ns.scoped())
    assert set(keys) <= eng.tiers_snapshot()[Tier.DISK]
    clean, _ = run(eng, eng, toks(2), 3.0)  # (keeps a on DISK only)
    assert eng.corrupt([keys[5]], Tier.DISK) == 1
    events.clear()
    t_bad, u = run(eng, eng, a, 4.0)
    assert eng.kv.checksum_errors == 1
    assert u.loaded_tokens["DISK"] == 5 * BS and u.recomputed_tokens == 64 - 5 * BS
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK"]
    assert removed and removed[0].block_hashes == digests64([keys[5]])
    assert keys[5] not in eng.tiers_snapshot()[Tier.DISK]
    # the recomputed blocks were stored again: the next request hits them on GPU
    stored = {h for e in events if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes}
    assert digests64([keys[5]])[0] in stored
    _, u2 = run(eng, eng, a, 5.0)
    assert u2.loaded_tokens["GPU"] == 60 and eng.kv.checksum_errors == 1


def test_purge_by_lora() -> None:
    prof = make_profile(block_size=BS, gpu_blocks=100)
    eng = SimEngine("w0", prof)
    a = toks(1)
    run(eng, eng, a, 1.0, lora="v1")
    run(eng, eng, a, 2.0, lora="v2")
    run(eng, eng, a, 3.0)
    assert eng.purge(None, lora="v1") == 16
    _, u = run(eng, eng, a, 4.0, lora="v1")
    assert u.cached_tokens == 0
    _, u = run(eng, eng, a, 5.0, lora="v2")
    assert u.cached_tokens == 60
    _, u = run(eng, eng, a, 6.0)
    assert u.cached_tokens == 60
