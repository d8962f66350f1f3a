"""`kvroute loadtest harden`: the adversarial suite (docs/harden.md).

Starts a real gateway and real worker processes (simulated workers, and faulty ones
from `faulty.py`) per case, sends each failure docs/harden.md lists — bursts, hanging and broken
workers, hostile tenants, the admin API, fuzzed bodies, restarts — and prints one table:
requests sent, answered, refused, 5xx (relayed or not), hung, lost, wrong, per case.
"""
from __future__ import annotations
