"""`kvroute`: the one entry point (DESIGN.md §4.5).

    kvroute serve --config FILE            the gateway, workers from the config
    kvroute up --sim [--workers N] [--profile NAME] [--config FILE] [--port P]
                                           gateway on 127.0.0.1:8000 + N local simulated workers
    kvroute sim-cluster ...                N simulated workers in one process (workers.cli)
    kvroute worker --model DIR|default --port P ...
                                           one real-engine worker (workers.cli engine; torch)
    kvroute loadtest ...                   the load-test harness (loadtest.cli)
    kvroute kv-size ...                    KV bytes per token / block / request (kvroute.kvsize)

Each command imports only its own part: the gateway process (`serve`, `up`) never
imports `workers`, `loadtest` or torch; workers run as a child process and meet the
gateway on the wire only.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

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
    if a.host:
        cfg.listen.host = a.host
    if a.port is not None:
        cfg.listen.port = a.port
    return serve(cfg)


def _read_ready(proc: subprocess.Popen[str], timeout: float) -> list[str]:
    """Worker URLs from sim-cluster's ready lines (`worker ID url=URL ...`, then `ready`)."""
    urls: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while True:
        if time.monotonic() > deadline:
            raise SystemExit(f"kvroute up: the simulated workers were not ready after {timeout:.0f}s")
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"kvroute up: the simulated workers exited (code {proc.wait()}); see their output above")
        sys.stderr.write("[workers] " + line)
        words = line.split()
        if words == ["ready"]:
            return urls
        if words and words[0] == "worker":
            for w in words[2:]:
                if w.startswith("url="):
                    urls.append(w[4:])


def _relay(stream: Any, prefix: str) -> None:
    for line in stream:
        sys.stderr.write(prefix + line)


def cmd_up(a: argparse.Namespace) -> int:
    from router.config import ConfigError, ModelConfig, WorkerConfig, apply_profiles, read_profile
    from router.server import serve

    if not a.sim:
        print("kvroute up: this build has no real-engine worker yet; run `kvroute up --sim` for simulated workers",
              file=sys.stderr)
        return 2
    cfg = _load(a.config)
    m = cfg.models[0]
    if a.profile:
        try:
            prof = read_profile(a.profile)
        except ConfigError as e:
            print(f"kvroute up: {e}", file=sys.stderr)
            return 2
        # The gateway's model must be the profile's: same id, same namespace digest as /info.
        m = ModelConfig(
            id=prof["model"],
            served_names=[n for n in prof.get("served_model_names", []) if n != prof["model"]],
            tokenizer=m.tokenizer,
            profile=a.profile,
        )
        cfg.models = [m]
        apply_profiles(cfg, REPO)
        profile = a.profile
    else:
        profile = m.profile or "h200-llama3.1-8b"
    n = a.workers
    cmd = [sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", str(n), "--profile", profile,
           "--base-port", str(a.base_port), "--host", "127.0.0.1",
           "--tokenizer", str(m.tokenizer)]  # the workers tokenize text as the gateway does
    print(f"kvroute up: starting {n} simulated workers ({profile})", file=sys.stderr)
    # Same process group: Ctrl-C reaches both. PDEATHSIG: if this process is killed
    # (SIGTERM, SIGKILL) before it can stop them, the workers go too.
    proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_die_with_parent)
    try:
        urls = _read_ready(proc, a.timeout)
        threading.Thread(target=_relay, args=(proc.stdout, "[workers] "), daemon=True).start()
        cfg.workers = [WorkerConfig(id=f"sim{i}", url=u, kind="kvroute", model=m.id) for i, u in enumerate(urls)]
        cfg.listen.port = a.port
        cfg.listen.host = a.host
        print(f"kvroute up: gateway on http://{a.host}:{a.port}/v1 (model {m.id!r}, {len(urls)} workers); "
              "Ctrl-C stops everything", file=sys.stderr)
        return serve(cfg)
    finally:
        _stop(proc)


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when its parent dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: Ctrl-C and the finally clause still stop it
        pass


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvroute", description="Cache-aware request router for LLM inference fleets.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the gateway with workers from a config file")
    s.add_argument("--config", required=True)
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.set_defaults(fn=cmd_serve)
    u = sub.add_parser("up", help="gateway on 127.0.0.1:8000 + N local workers")
    u.add_argument("--workers", type=int, default=4)
    u.add_argument("--sim", action="store_true", help="simulated workers (required: this build has no real engine)")
    u.add_argument("--config", default=str(DEFAULT_CONFIG))
    u.add_argument("--profile", default=None, help="simulated worker profile (configs/profiles/NAME.yaml)")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--base-port", type=int, default=0, help="first worker port (default 0: any free ports)")
    u.add_argument("--timeout", type=float, default=60.0)
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
