"""The cases, one module per concern; importing this package registers them all
(runner.CASES, in the order the table lists them)."""
from __future__ import annotations

from . import events, faults, overload, timeouts  # noqa: F401
