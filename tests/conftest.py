"""Suite-wide test settings."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hypothesis import settings

# The shared fakes and fixtures (tests/support/) are imported by module name from every subject
# folder (`from fakes import FakeWorker`); pytest puts only each test file's own folder on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# The simulated cluster fixture (module-scoped: one cluster per test module that asks for it).
from sim_cluster import cluster  # noqa: E402, F401

# The machine running CI is small and shared: a property test must fail on a wrong
# answer, never on a slow example.
settings.register_profile("kvroute", deadline=None)
settings.load_profile("kvroute")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Tests that need a full public trace skip without $LOADTEST_TRACES; say so out loud,
    not only in `-rs`, so a slow run that checked nothing of them does not look green."""
    from loadtest.tracefiles import ENV

    skipped = [r for r in terminalreporter.stats.get("skipped", []) if ENV in str(getattr(r, "longrepr", ""))]
    if skipped:
        terminalreporter.write_line(
            f"{len(skipped)} test(s) SKIPPED for want of the full traces: set {ENV} to the folder "
            "holding them (see README.md, Replaying traces)", yellow=True, bold=True)
