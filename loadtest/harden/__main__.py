"""`python -m loadtest.harden ...`: the same as `kvroute loadtest harden ...`."""
from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
