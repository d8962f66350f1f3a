"""`kvroute`: the one entry point (docs/design.md §4.5).

    kvroute serve --config FILE [--processes N]
                                           the gateway, workers from the config (SIGHUP reloads it)
    kvroute up [--workers N | --pd P:D] [--sim] [--config FILE] [--port P] [--events-base-port Q] ...
                                           gateway on 127.0.0.1:8000 + N local workers: real engine
                                           workers on the bundled tiny model, or simulated (kvroute.up)
    kvroute sim-cluster ...                N simulated workers in one process (workers.cli)
    kvroute worker --model DIR|default --port P ...
                                           one real-engine worker (workers.cli engine; torch)
    kvroute loadtest ...                   the load-test harness (loadtest.cli)
    kvroute kv-size ...                    KV bytes per token / block / request (kvroute.kvsize)

Each command imports only its own part: the gateway process (`serve`, `up`) never
imports `workers`, `loadtest` or torch; workers run as child processes and meet the
gateway on the wire only.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .up import add_arguments as add_up_arguments

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"


def _load(path: str) -> Any:
    from router.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        print(f"kvroute: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_serve(a: argparse.Namespace) -> int:
    from router.server import serve

    cfg = _load(a.config)

    def overrides(c: Any) -> None:
        """The command line over the file, at start and on every SIGHUP re-read."""
        if a.host:
            c.listen.host = a.host
        if a.port is not None:
            c.listen.port = a.port
        if a.replicas is not None:  # a floor: --processes sets it, the file does not know it
            c.routing.replicas = max(c.routing.replicas, a.replicas)

    overrides(cfg)
    if a.processes < 1 or (a.replicas is not None and a.replicas < 1):
        print("kvroute serve: --processes and --replicas must be at least 1", file=sys.stderr)
        return 2
    if a.processes > 1:
        from router.processes import Supervisor
        from router.telemetry.logs import setup_logging

        if cfg.listen.port == 0:
            print("kvroute serve: --processes needs a fixed port (every process binds the same one)", file=sys.stderr)
            return 2
        setup_logging(cfg.observability.log_level, cfg.observability.log_format)
        return Supervisor(a.processes, Path(a.config), cfg.listen.host, cfg.listen.port).run()
    sync = (Path(a.admin_sync), a.process_index, a.process_count) if a.admin_sync else None
    return serve(cfg, config_path=a.config, reuse_port=a.reuse_port, overrides=overrides, sync=sync)


def cmd_up(a: argparse.Namespace) -> int:
    from .up import cmd_up as up

    return up(a)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvroute", description="Cache-aware request router for LLM inference fleets.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the gateway with workers from a config file")
    s.add_argument("--config", required=True)
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--processes", type=int, default=1,
                   help="N gateway processes on one port (SO_REUSEPORT), each a full replica (docs/replicas.md)")
    s.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT, to share the port with other gateway processes")
    s.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="gateway replicas sharing the fleet (raises routing.replicas to N; --processes sets it)")
    # set by --processes for its children (router/processes.py, router/fleet/replica_sync.py)
    s.add_argument("--admin-sync", default=None, help=argparse.SUPPRESS)
    s.add_argument("--process-index", type=int, default=0, help=argparse.SUPPRESS)
    s.add_argument("--process-count", type=int, default=1, help=argparse.SUPPRESS)
    s.set_defaults(fn=cmd_serve)
    u = sub.add_parser("up", help="gateway on 127.0.0.1:8000 + N local workers (real engine; --sim: simulated)")
    add_up_arguments(u)
    u.set_defaults(fn=cmd_up)
    sub.add_parser("sim-cluster", help="N simulated workers in one process (see: kvroute sim-cluster --help)",
                   add_help=False)
    sub.add_parser("worker", help="one real-engine worker (see: kvroute worker --help)", add_help=False)
    sub.add_parser("loadtest", help="replay traces, simulate policies, run scenarios (kvroute loadtest --help)",
                   add_help=False)
    sub.add_parser("kv-size", help="KV bytes per token / block / request (kvroute kv-size --help)", add_help=False)
    return ap


def _sim_cluster(args: list[str]) -> int:
    from workers.cli import main as workers_main

    return workers_main(args)


def _worker(args: list[str]) -> int:
    from workers.cli import main as workers_main

    return workers_main(["engine", *args])


def _loadtest(args: list[str]) -> int:
    from loadtest.cli import main as loadtest_main

    return loadtest_main(args)


def _kv_size(args: list[str]) -> int:
    from .kvsize import main as kvsize_main

    return kvsize_main(args)


# Subcommands whose own parser takes every argument after their name.
_DELEGATED = {
    "sim-cluster": lambda a: _sim_cluster(["sim-cluster", *a]),
    "worker": _worker,
    "loadtest": _loadtest,
    "kv-size": _kv_size,
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _DELEGATED:
        return int(_DELEGATED[args[0]](args[1:]))
    a = build_parser().parse_args(args)
    return int(a.fn(a))


if __name__ == "__main__":
    raise SystemExit(main())
