"""kvindex: block keys, the KV-event wire codec, the global prefix index and event ingestion.

This package imports nothing else of the project: the router, the
workers and the load-test harness all build on it.
"""
from __future__ import annotations
