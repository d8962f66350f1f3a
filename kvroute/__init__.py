"""kvroute: the command line (`kvroute ...`) over the gateway, workers and load-test harness.

Each subcommand imports only the part it runs (kvroute/cli.py), so the gateway
process stays free of torch and of the workers' code.
"""
from __future__ import annotations
