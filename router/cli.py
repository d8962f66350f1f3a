"""`kvroute`: the one entry point (DESIGN.md §4.5).

    kvroute serve --config FILE            the gateway, workers from the config
    kvroute up [--workers N] [--sim] [--profile NAME] [--config FILE] [--port P]
                                           gateway on 127.0.0.1:8000 + N local simulated workers
    kvroute sim-cluster ...                exec `python -m workers.cli sim-cluster ...`
    kvroute loadtest ...                   exec `python -m loadtest.cli ...`
    kvroute kv-size ...                    KV bytes per token / block / request (router.kvsize)

The router never imports `workers` or `loadtest`: their commands replace this process
(os.execv) or run as a child process, and meet the gateway on the wire only.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"


def _exec_module(module: str, args: list[str]) -> int:
    """Replace this process with `python -m module args...` (no import happens here)."""
    argv = [sys.executable, "-m", module, *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 127  # pragma: no cover - execv does not return


def _load(path: str) -> Any:
    from .config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        print(f"kvroute: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_serve(a: argparse.Namespace) -> int:
    from .server import serve

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
    from .config import ConfigError, WorkerConfig, read_profile
    from .server import serve

    if not a.sim:
        print("kvroute up: the real-engine worker is not available yet; starting simulated workers (--sim)", file=sys.stderr)
    cfg = _load(a.config)
    m = cfg.models[0]
    if a.profile:
        try:
            prof = read_profile(a.profile)
        except ConfigError as e:
            print(f"kvroute up: {e}", file=sys.stderr)
            return 2
        # The gateway's model must be the profile's: same id, same namespace digest as /info.
        from .config import ModelConfig

        m = ModelConfig(
            id=prof["model"],
            served_names=[n for n in prof.get("served_model_names", []) if n != prof["model"]],
            tokenizer=m.tokenizer,
            profile=a.profile,
        )
        from .config import _apply_profiles

        cfg.models = [m]
        _apply_profiles(cfg, REPO)
        profile = a.profile
    else:
        profile = m.profile or "h200-llama3.1-8b"
    n = a.workers
    cmd = [sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", str(n), "--profile", profile,
           "--base-port", str(a.base_port), "--host", "127.0.0.1"]
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
    u = sub.add_parser("up", help="gateway on 127.0.0.1:8000 + N local simulated workers")
    u.add_argument("--workers", type=int, default=4)
    u.add_argument("--sim", action="store_true", help="simulated workers (the default while no real engine exists)")
    u.add_argument("--config", default=str(DEFAULT_CONFIG))
    u.add_argument("--profile", default=None, help="simulated worker profile (configs/profiles/NAME.yaml)")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8000)
    u.add_argument("--base-port", type=int, default=0, help="first worker port (default 0: any free ports)")
    u.add_argument("--timeout", type=float, default=60.0)
    u.set_defaults(fn=cmd_up)
    for name, module in (("sim-cluster", "workers.cli"), ("loadtest", "loadtest.cli")):
        p = sub.add_parser(name, help=f"exec python -m {module} {name if name == 'sim-cluster' else ''} ...", add_help=False)
        p.set_defaults(module=module)
    sub.add_parser("kv-size", help="KV bytes per token / block / request", add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "sim-cluster":
        return _exec_module("workers.cli", args)
    if args and args[0] == "loadtest":
        return _exec_module("loadtest.cli", args[1:])
    if args and args[0] == "kv-size":
        try:
            from .kvsize import main as kvsize_main
        except ModuleNotFoundError as e:
            print(f"kvroute kv-size: not available in this checkout ({e})", file=sys.stderr)
            return 2
        return kvsize_main(args[1:])
    a = build_parser().parse_args(args)
    return a.fn(a)


if __name__ == "__main__":
    raise SystemExit(main())
