"""`kvroute up`: the gateway on 127.0.0.1:8000 and N local workers, one command (docs/design.md §4.5).

Real workers by default: N processes of `python -m workers.cli engine` (the torch engine,
docs/engine.md) serving the bundled tiny Llama, each with a CPU tier, a DISK tier under
the state directory and peer pulls authenticated by one random token shared by the
fleet; the gateway serves the same model (`kvroute/tiny-llama`, profile `tiny-cpu`,
tokenizer `configs/assets/tiny-tokenizer`), so its namespace digest is the workers'.
`--sim`: one `sim-cluster` process of simulated workers instead.

Ports. The gateway listens on `--port`. Without `--events-base-port` the workers take
any free ports (or worker i's HTTP port is `--base-port` + i). With `--events-base-port P`
every port the children open is chosen from P upward: worker i publishes KV events on
P + 2i and answers replays on P + 2i + 1, and its HTTP port is `--base-port` + i, or
P + 2N + i when `--base-port` is not given; so the whole fleet lives in [P, P + 3N).

Stopping. The children run in their own sessions, so a terminal's Ctrl-C reaches this
process only; on SIGINT or SIGTERM the gateway shuts down first, then every child gets
SIGTERM (SIGKILL after a grace period). Each child also asks Linux to SIGTERM it when
this process dies (PR_SET_PDEATHSIG), so not even a SIGKILL here leaves workers behind.

This process never imports torch or `workers`: they run as child processes and meet the
gateway on the wire only.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
REAL_MODEL = "kvroute/tiny-llama"  # workers/engine/tiny.py MODEL_ID: the engine's default model
REAL_PROFILE = "tiny-cpu"  # configs/profiles/tiny-cpu.yaml: that model's namespace and cost defaults
REAL_TOKENIZER = REPO / "configs" / "assets" / "tiny-tokenizer"  # the tiny Llama's own tokenizer files
SIM_PROFILE = "h200-llama3.1-8b"
REAL_TIMEOUT_S = 180.0  # the first start generates the weights (from a fixed seed), then each worker calibrates
SIM_TIMEOUT_S = 60.0
PAIR_POLICIES = ("pd_cost", "pd_round_robin", "pd_prefix")  # router/planner/pd.py
STOP_GRACE_S = 15.0


class UpError(Exception):
    """`kvroute up` cannot go on; the message says why (printed, exit code 1 or 2)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def default_state_dir(port: int) -> Path:
    """Where the real workers keep their DISK tiers: `$XDG_STATE_HOME/kvroute/up-PORT`
    (else `~/.local/state/...`). One folder per gateway port: a restart on the same port
    finds its DISK blocks again, two fleets on different ports never share a folder."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvroute" / f"up-{port}"


@dataclass(frozen=True, slots=True)
class PortPlan:
    http: list[int]  # worker i's HTTP port (0: any free port)
    events: list[int] | None  # worker i's KV-event PUB port (replay: +1); None: any free ports


def plan_ports(n: int, base_port: int, events_base_port: int | None) -> PortPlan:
    """Every worker port, as the module docstring says."""
    if n < 1:
        raise UpError("--workers must be at least 1", 2)
    if not 0 <= base_port <= 65535 - (n - 1):
        raise UpError("--base-port out of range", 2)
    if events_base_port is None:
        return PortPlan([base_port + i if base_port else 0 for i in range(n)], None)
    top = events_base_port + 2 * n + (0 if base_port else n) - 1
    if events_base_port < 1 or top > 65535:
        raise UpError(f"--events-base-port {events_base_port}: {n} workers need ports up to {top} (max 65535)", 2)
    http = [base_port + i if base_port else events_base_port + 2 * n + i for i in range(n)]
    return PortPlan(http, [events_base_port + 2 * i for i in range(n)])


# ---------------------------------------------------------------------- child processes


_prctl: Callable[..., Any] | None = None


def _prepare_pdeathsig() -> None:
    """Look prctl up here, in the parent: the child (between fork and exec) only calls it."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            import ctypes

            _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = None


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _die_with_parent() -> None:
    """In the child, before exec: take the stop signals again (the parent blocks them
    while it spawns, `Child.spawn`) and ask Linux to SIGTERM it when its parent dies."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One child process (a worker, or the sim-cluster); its output relayed with a prefix."""

    name: str
    proc: subprocess.Popen[str]
    ready: threading.Event = field(default_factory=threading.Event)
    urls: dict[str, str] = field(default_factory=dict)  # worker id -> URL, from the ready lines
    _pump: threading.Thread | None = None

    @classmethod
    def spawn(cls, name: str, cmd: list[str], into: list[Child], env: dict[str, str] | None = None) -> None:
        """Start it and add it to `into`, with SIGINT/SIGTERM held back in between: a stop
        arriving then would leave a running child that no list knows, so nothing stops it."""
        _prepare_pdeathsig()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            proc = subprocess.Popen(cmd, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                                    start_new_session=True, preexec_fn=_die_with_parent)
            into.append(cls(name, proc))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def start_relay(self) -> None:
        """Relay the output (and read the ready lines) on a thread. Started only once every
        child is spawned: a fork while another thread holds a lock is a fork to avoid."""
        self._pump = threading.Thread(target=self._relay, name=f"relay-{self.name}", daemon=True)
        self._pump.start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stderr.write(f"[{self.name}] {line}")
            if self.ready.is_set():
                continue
            words = line.split()
            if words == ["ready"]:
                self.ready.set()
            elif len(words) > 2 and words[0] == "worker":
                for w in words[2:]:
                    if w.startswith("url="):
                        self.urls[words[1]] = w[4:]

    def join_relay(self, timeout: float) -> None:
        if self._pump is not None:
            self._pump.join(timeout)


def wait_ready(children: list[Child], timeout: float) -> None:
    """Until every child printed `ready`; an exit or the deadline first is an UpError."""
    deadline = time.monotonic() + timeout
    while True:
        pending = [c for c in children if not c.ready.is_set()]
        if not pending:
            return
        for c in pending:
            code = c.proc.poll()
            if code is not None:
                c.join_relay(2.0)  # its last words (the error) first
                if not c.ready.is_set():
                    raise UpError(f"kvroute up: {c.name} exited (code {code}) before it was ready; "
                                  "see its output above")
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise UpError(f"kvroute up: not ready after {timeout:.0f}s: {names} (--timeout to wait longer)")
        pending[0].ready.wait(0.1)


def stop_all(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child at once, wait for all up to `grace_s`, then SIGKILL the rest."""
    for c in children:
        if c.proc.poll() is None:
            try:
                c.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"kvroute up: {c.name} did not stop within {grace_s:.0f}s; killing it", file=sys.stderr)
            c.proc.kill()
            c.proc.wait(timeout=5)
    for c in children:
        c.join_relay(1.0)


# ---------------------------------------------------------------------- the fleets


def parse_pd(text: str) -> tuple[int, int]:
    """`--pd P:D`: P prefill workers and D decode workers, each at least 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise UpError(f"kvroute up: --pd {text!r}: expected P:D, e.g. 1:1 (prefill and decode workers)", 2) from None
    if p < 1 or d < 1:
        raise UpError("kvroute up: --pd P:D needs at least one prefill and one decode worker", 2)
    return p, d


def worker_roles(a: argparse.Namespace, n: int) -> list[tuple[str, str]]:
    """(worker id, role) of each local worker: `--pd P:D` gives P prefill workers p0.. and D
    decode workers d0..; otherwise n workers w0.. of role both."""
    if a.pd is None:
        return [(f"w{i}", "both") for i in range(n)]
    p, d = parse_pd(a.pd)
    return [(f"p{i}", "prefill") for i in range(p)] + [(f"d{i}", "decode") for i in range(d)]


def real_worker_cmds(a: argparse.Namespace, ports: PortPlan, state_dir: Path) -> list[tuple[str, list[str]]]:
    """(worker id, command) of each real-engine worker; a prefill or decode worker is told
    its role (the engine's `--role`)."""
    cmds = []
    for i, (port, (wid, role)) in enumerate(zip(ports.http, worker_roles(a, len(ports.http)), strict=True)):
        # wid is also the relay prefix and the name in messages: "w0 exited ..."
        cmd = [sys.executable, "-m", "workers.cli", "engine", "--port", str(port), "--host", "127.0.0.1",
               "--worker-id", wid, "--threads", "1", "--cpu-bytes", _num(a.cpu_bytes),
               "--disk-dir", str(state_dir / f"kv-{wid}")]
        if ports.events is not None:
            cmd += ["--events-port", str(ports.events[i])]
        if a.num_blocks is not None:
            cmd += ["--num-blocks", str(a.num_blocks)]
        if role != "both":
            cmd += ["--role", role]
        cmd += list(a.engine_arg or [])
        cmds.append((wid, cmd))
    return cmds


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def start_real(a: argparse.Namespace, n: int, ports: PortPlan, children: list[Child]) -> list[tuple[str, str]]:
    """Spawn the engine workers into `children` (the caller stops them) and wait for them."""
    state_dir = Path(a.state_dir).expanduser() if a.state_dir else default_state_dir(a.port)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UpError(f"kvroute up: cannot create the state directory {state_dir}: {e.strerror or e}") from None
    # One token for the fleet: it authenticates peer pulls (/kv/blocks) between the workers.
    # In the environment, not on the command line, where every local user could read it.
    env = {**os.environ, "KVROUTE_PEER_TOKEN": secrets.token_urlsafe(32), "HF_HUB_OFFLINE": "1"}
    print(f"kvroute up: starting {n} engine workers ({REAL_MODEL}; DISK tiers under {state_dir}; "
          f"the first start generates the model's weights)", file=sys.stderr, flush=True)
    first = len(children)
    try:
        for wid, cmd in real_worker_cmds(a, ports, state_dir):
            Child.spawn(wid, cmd, children, env)
    finally:  # after every fork; a failed spawn still relays the output of those that started
        for c in children[first:]:
            c.start_relay()
    wait_ready(children[first:], a.timeout or REAL_TIMEOUT_S)
    return [(wid, url) for c in children[first:] for wid, url in c.urls.items()]


def start_sim(a: argparse.Namespace, n: int, ports: PortPlan, profile: str, tokenizer: Path,
              children: list[Child]) -> list[tuple[str, str]]:
    """Spawn the sim-cluster into `children` (the caller stops it) and wait for it."""
    cmd = [sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", str(n), "--profile", profile,
           "--base-port", str(ports.http[0]), "--host", "127.0.0.1",
           "--tokenizer", str(tokenizer)]  # the workers tokenize text as the gateway does
    if ports.events is not None:
        cmd += ["--events-base-port", str(ports.events[0])]
    print(f"kvroute up: starting {n} simulated workers ({profile})", file=sys.stderr, flush=True)
    Child.spawn("sim-cluster", cmd, children)
    child = children[-1]
    child.start_relay()
    wait_ready([child], a.timeout or SIM_TIMEOUT_S)
    return [(f"sim{i}", url) for i, url in enumerate(child.urls.values())]


def _gateway_config(a: argparse.Namespace) -> tuple[Any, str]:
    """The gateway's config (from --config) with its model set for the fleet; and the sim profile."""
    from router.config import ConfigError, apply_profiles, load_config, read_profile
    from router.fleet.fleetconfig import ModelConfig

    try:
        cfg = load_config(a.config)
    except ConfigError as e:
        raise UpError(f"kvroute: config error: {e}", 2) from None
    m = cfg.models[0]
    if a.sim and not a.profile:
        return cfg, m.profile or SIM_PROFILE
    profile = a.profile if a.sim else REAL_PROFILE
    try:
        prof = read_profile(profile)
    except ConfigError as e:
        raise UpError(f"kvroute up: {e}", 2) from None
    # The gateway's model must be the workers': same id, same namespace digest as their /info.
    cfg.models = [ModelConfig(
        id=prof["model"],
        served_names=[s for s in prof.get("served_model_names", []) if s != prof["model"]],
        tokenizer=m.tokenizer if a.sim else REAL_TOKENIZER,
        profile=profile,
    )]
    try:
        apply_profiles(cfg, REPO)
    except ConfigError as e:
        raise UpError(f"kvroute up: {e}", 2) from None
    if not a.sim and cfg.models[0].id != REAL_MODEL:
        raise UpError(f"kvroute up: profile {profile} serves {cfg.models[0].id!r}, not {REAL_MODEL!r}", 2)
    return cfg, profile


def fleet_config(cfg: Any, a: argparse.Namespace, workers: list[tuple[str, str]]) -> None:
    """The gateway's workers (id, url) as config entries, with their roles; a `--pd` fleet
    is routed by pd_cost unless the config already names a pair policy."""
    from router.config import RoutingConfig
    from router.fleet.fleetconfig import WorkerConfig

    m = cfg.models[0]
    roles = dict(worker_roles(a, len(workers)))
    cfg.workers = [WorkerConfig(id=wid, url=url, kind="kvroute", model=m.id, role=roles.get(wid, "both"))
                   for wid, url in workers]
    if a.pd is not None and cfg.routing.policy not in PAIR_POLICIES:
        data = cfg.routing.model_dump()
        data.update(policy="pd_cost", params={})
        cfg.routing = RoutingConfig.model_validate(data)


def _check(a: argparse.Namespace) -> None:
    if a.pd is not None:
        if a.sim:
            raise UpError("kvroute up: --pd starts engine workers (prefill and decode roles), not --sim", 2)
        if a.workers is not None:
            raise UpError("kvroute up: --pd P:D sets the number of workers (P + D); leave out --workers", 2)
        parse_pd(a.pd)
    if a.sim:
        given = [f for f, v in (("--num-blocks", a.num_blocks), ("--engine-arg", a.engine_arg),
                                ("--state-dir", a.state_dir)) if v]
        if given:
            raise UpError(f"kvroute up: {', '.join(given)} configure the real engine workers, not --sim", 2)
    elif a.profile:
        raise UpError("kvroute up: --profile picks a simulated profile (with --sim); the real workers serve "
                      f"{REAL_MODEL} (profile {REAL_PROFILE})", 2)
    if a.timeout is not None and a.timeout <= 0:
        raise UpError("kvroute up: --timeout must be positive", 2)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_up(a: argparse.Namespace) -> int:
    from router.server import serve

    children: list[Child] = []
    # SIGTERM stops `up` the way Ctrl-C does (the finally clause stops the children). uvicorn
    # takes both signals while it serves and hands them back here when it is done.
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _check(a)
        cfg, profile = _gateway_config(a)
        m = cfg.models[0]
        n = a.workers if a.workers is not None else default_workers()
        if a.pd is not None:
            n = sum(parse_pd(a.pd))
        ports = plan_ports(n, a.base_port, a.events_base_port)
        if a.sim:
            workers = start_sim(a, n, ports, profile, m.tokenizer, children)
        else:
            workers = start_real(a, n, ports, children)
        fleet_config(cfg, a, workers)
        cfg.listen.port = a.port
        cfg.listen.host = a.host
        kind = "simulated" if a.sim else "engine"
        names = ", ".join([m.id, *m.served_names])
        print(f"kvroute up: gateway on http://{a.host}:{a.port}/v1 (model {names}; {len(workers)} {kind} workers); "
              "Ctrl-C stops everything", file=sys.stderr, flush=True)
        return serve(cfg)
    except UpError as e:
        print(e, file=sys.stderr)
        return e.code
    except KeyboardInterrupt:  # before the gateway served (it handles the signals itself)
        print("kvroute up: interrupted; stopping the workers", file=sys.stderr)
        return 130
    finally:
        try:
            stop_all(children)
        finally:
            signal.signal(signal.SIGTERM, old_term)


def add_arguments(u: argparse.ArgumentParser) -> None:
    u.add_argument("--workers", type=int, default=None, help="local workers (default: min(4, CPU cores))")
    u.add_argument("--pd", default=None, metavar="P:D",
                   help="a disaggregated fleet: P prefill-role and D decode-role engine workers, routed by pd_cost")
    u.add_argument("--sim", action="store_true", help="simulated workers instead of the real engine")
    u.add_argument("--config", default=str(REPO / "configs" / "default.yaml"),
                   help="gateway config (routing, limits, tenants...); its models are replaced by the fleet's")
    u.add_argument("--profile", default=None, help="with --sim: simulated worker profile (configs/profiles/NAME)")
    u.add_argument("--host", default="127.0.0.1", help="the gateway's listen address (workers: 127.0.0.1)")
    u.add_argument("--port", type=int, default=8000, help="the gateway's port")
    u.add_argument("--base-port", type=int, default=0, help="worker i's HTTP port is P+i (default: any free ports)")
    u.add_argument("--events-base-port", type=int, default=None, metavar="P",
                   help="choose every worker port from P up: worker i's KV events on P+2i, replay P+2i+1, "
                        "HTTP on P+2N+i unless --base-port is given")
    u.add_argument("--timeout", type=float, default=None,
                   help=f"seconds to wait for the workers (default {REAL_TIMEOUT_S:.0f}, --sim {SIM_TIMEOUT_S:.0f})")
    e = u.add_argument_group("real engine workers (python -m workers.cli engine --help)")
    e.add_argument("--cpu-bytes", type=float, default=1e9, help="each worker's CPU DRAM tier (default 1e9)")
    e.add_argument("--num-blocks", type=int, default=None,
                   help="each worker's device KV pool in blocks (default: the engine's, 512 MiB on CPU)")
    e.add_argument("--state-dir", default=None,
                   help="DISK tiers go to DIR/kv-wI (default $XDG_STATE_HOME/kvroute/up-PORT)")
    e.add_argument("--engine-arg", action="append", default=None, metavar="ARG",
                   help="one more flag for every worker, e.g. --engine-arg=--no-calibrate (repeatable)")
