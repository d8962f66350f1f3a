"""Every scenario end to end at its reduced size: its checks hold (PENDING names a
missing engine knob and is allowed; FAIL is not)."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.scenarios import SCENARIOS, run_scenario


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_small(name: str, tmp_path: Path) -> None:
    res = run_scenario(name, size="small", out_dir=tmp_path, seed=0, verbose=False)
    lines = "\n".join(c.line() for c in res.checks)
    assert res.checks and all(c.status in ("PASS", "FAIL", "PENDING") for c in res.checks)
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
