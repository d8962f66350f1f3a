"""Suite-wide test settings."""
from __future__ import annotations

from hypothesis import settings

# The machine running CI is small and shared: a property test must fail on a wrong
# answer, never on a slow example.
settings.register_profile("kvroute", deadline=None)
settings.load_profile("kvroute")
