"""Every scenario end to end at its reduced size: its checks hold. The fault-injection
checks are also run with each knob disabled, to show they can fail."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.scenarios import SCENARIOS, run_scenario


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_small(name: str, tmp_path: Path) -> None:
    res = run_scenario(name, size="small", out_dir=tmp_path, seed=0, verbose=False)
    lines = "\n".join(c.line() for c in res.checks)
    assert res.checks and all(c.status in ("PASS", "FAIL") for c in res.checks)
    assert sum(c.status == "PASS" for c in res.checks) >= 3, lines
    assert res.passed, lines
    assert res.report is not None and res.report.exists()
    text = res.report.read_text()
    assert all(c.line() in text for c in res.checks)  # the report states what held and what did not


def test_registry_has_the_seed_tests_and_the_extras() -> None:
    assert len(SCENARIOS) == 12
    for n in ("long-common-prefix", "all-unique", "mixed-prefixes", "bandwidth-squeeze", "workers-churn",
              "version-switch", "backend-outage", "bad-blocks", "cold-start-burst", "all-features",
              "sleeping-sessions", "disk-fill"):
        assert n in SCENARIOS and SCENARIOS[n].summary


# The fault-injection checks must be able to fail: with each engine knob disabled, the
# checks that depend on it report FAIL (never PASS).

def _statuses(name: str) -> dict[str, str]:
    res = run_scenario(name, size="small", out_dir=None, seed=0, verbose=False)
    return {c.name: c.status for c in res.checks}


def test_bad_blocks_fails_when_corruption_goes_undetected(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.sim.kvcache import TieredKV

    monkeypatch.setattr(TieredKV, "verify", lambda self, tier, keys: [])
    st = _statuses("bad-blocks")
    assert st["corrupt copies injected"] == "PASS"
    assert st["corrupt copies are read and rejected"] == "FAIL"
    assert st["index corrected by the removal events"] == "FAIL"


def test_bad_blocks_fails_when_removals_never_reach_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvindex.events import BlockRemoved
    from kvindex.index import PrefixIndex

    real = PrefixIndex.apply

    def drop_removals(self: PrefixIndex, worker_id: str, batch):  # type: ignore[no-untyped-def]
        return real(self, worker_id, [e for e in batch if not isinstance(e, BlockRemoved)])

    monkeypatch.setattr(PrefixIndex, "apply", drop_removals)
    st = _statuses("bad-blocks")
    assert st["index corrected by the removal events"] == "FAIL"


def test_backend_outage_fails_when_the_backend_never_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.sim.remote import RemoteStore

    monkeypatch.setattr(RemoteStore, "set_available", lambda self, available: None)
    st = _statuses("backend-outage")
    assert st["backend down: lookups miss, writes skipped"] == "FAIL"
    assert st["backend down: nothing is loaded from it"] == "FAIL"
    assert st["backend down: recompute takes over"] == "FAIL"


def test_backend_outage_fails_when_the_backend_never_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.sim.remote import RemoteStore

    real = RemoteStore.set_available
    monkeypatch.setattr(RemoteStore, "set_available",
                        lambda self, available: real(self, False) if not available else None)
    st = _statuses("backend-outage")
    assert st["backend back: REMOTE loads resume"] == "FAIL"
    assert st["backend back: caches warm again, gradually"] == "FAIL"


def test_version_switch_fails_when_purge_ignores_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.sim.engine import SimEngine

    real = SimEngine.purge
    monkeypatch.setattr(SimEngine, "purge",
                        lambda self, salt, everything=False, *, lora=None: real(self, salt, everything))
    st = _statuses("version-switch")
    assert st["v1 purged on a deadline"] == "FAIL"
    assert st["the index forgets v1 (BlockRemoved published)"] == "FAIL"
