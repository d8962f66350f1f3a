"""router: the OpenAI-compatible gateway (docs/design.md §2, §4.4, §5). Never imports workers or torch."""
from __future__ import annotations
