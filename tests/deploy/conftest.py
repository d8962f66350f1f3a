"""Fixtures of the packaging tests."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from deploy_rig import _Procs


@pytest.fixture
def procs() -> Iterator[_Procs]:
    ps = _Procs()
    try:
        yield ps
    finally:
        ps.stop()
