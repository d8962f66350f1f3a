"""Starting and stopping the processes a case runs against: the gateway, simulated
workers, faulty workers. Every one is a real process in its own process group (so
stopping it stops what it started), asked to die with the suite (PR_SET_PDEATHSIG),
logging into the case's folder, and stopped by process group when the case ends.
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from ..ports import free_port

REPO = Path(__file__).resolve().parent.parent.parent

try:  # loaded here, in the parent: the child only calls it between fork and exec
    _LIBC: Any = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _LIBC = None


def _child_setup() -> None:
    """In the child before exec: its own process group, and SIGTERM when the suite dies."""
    os.setsid()
    if _LIBC is not None:
        try:
            _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except Exception:
            pass


class StartError(RuntimeError):
    """A process the case needs did not come up (the message names its log)."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class GatewayProc:
    proc: Proc
    port: int
    config_path: Path
    config: dict[str, Any]
    ready_s: float | None = None  # seconds from start to the first 200 of /ready

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class SimWorker:
    worker_id: str
    url: str
    events: str
    replay: str | None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass
class SimCluster:
    proc: Proc
    workers: list[SimWorker]
    argv: list[str]


@dataclass
class FaultyProc:
    proc: Proc
    url: str
    worker_id: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


class Procs:
    """The processes of one case (stopped together by `close`)."""

    def __init__(self, folder: Path, python: str = sys.executable, code_root: Path = REPO,
                 env: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.python = python
        self.code_root = code_root
        self.env = dict(os.environ if env is None else env)
        # The gateway's config comes from the file alone: no KVROUTE_* override from our environment.
        for k in [k for k in self.env if k.startswith("KVROUTE_")]:
            del self.env[k]
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = str(code_root) + (os.pathsep + self.env["PYTHONPATH"]
                                                   if self.env.get("PYTHONPATH") else "")
        self.procs: list[Proc] = []
        self._n = 0
        self._lock = threading.Lock()  # cases start processes from threads, some at once

    # ------------------------------------------------------------------ generic

    def spawn(self, name: str, argv: list[str], *, watch_stdout: bool = False) -> Proc:
        with self._lock:
            self._n += 1
            log = self.folder / f"{self._n:02d}-{name}.log"
        f = log.open("ab")
        p = subprocess.Popen(argv, cwd=str(self.code_root), env=self.env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE if watch_stdout else f, stderr=subprocess.STDOUT,
                             preexec_fn=_child_setup)
        proc = Proc(name, p, log, argv)
        if watch_stdout:
            assert p.stdout is not None
            threading.Thread(target=_pump, args=(p.stdout, f, proc.lines), daemon=True).start()
        else:
            f.close()
        with self._lock:
            self.procs.append(proc)
        return proc

    def wait_line(self, proc: Proc, prefix: str, timeout: float) -> list[str]:
        """Lines up to (and including) the first that starts with `prefix`."""
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartError(f"{proc.name}: no {prefix!r} line after {timeout:.0f} s (log {proc.log}):\n"
                                 + proc.tail())
            try:
                line = proc.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if not proc.alive and proc.lines.empty():
                    raise StartError(f"{proc.name} exited with {proc.popen.returncode} (log {proc.log}):\n"
                                     + proc.tail()) from None
                continue
            got.append(line)
            if line.startswith(prefix):
                return got

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 8.0) -> int | None:
        """Signal its process group; SIGKILL after `timeout`. Returns its exit status."""
        if proc.popen.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of its group (children it started)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            return None

    def kill(self, proc: Proc) -> None:
        """SIGKILL now (a crash), its whole group."""
        self.stop(proc, signal.SIGKILL, 2.0)

    def close(self) -> None:
        for p in reversed(self.procs):
            self.stop(p, timeout=5.0)

    # ------------------------------------------------------------------ the three kinds

    def gateway(self, config: dict[str, Any], *, name: str = "gateway", port: int | None = None,
                wait_ready: bool = True, timeout: float = 60.0) -> GatewayProc:
        """`python -m kvroute.cli serve --config FILE` on a free port; waits for /health
        (and /ready when `wait_ready`: a healthy worker per model)."""
        cfg = dict(config)
        port = port or free_port()
        cfg["listen"] = {"host": "127.0.0.1", "port": port}
        with self._lock:
            path = self.folder / f"{name}-{self._n + 1:02d}-{port}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        proc = self.spawn(name, [self.python, "-m", "kvroute.cli", "serve", "--config", str(path)])
        gw = GatewayProc(proc, port, path, cfg)
        self.wait_http(proc, gw.url + ("/ready" if wait_ready else "/health"), timeout)
        return gw

    def wait_http(self, proc: Proc, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if not proc.alive:
                raise StartError(f"{proc.name} exited with {proc.popen.returncode} (log {proc.log}):\n"
                                 + proc.tail())
            try:
                with urllib.request.urlopen(url, timeout=2.0) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.1)
        raise StartError(f"{proc.name}: {url} not 200 after {timeout:.0f} s ({last}; log {proc.log}):\n"
                         + proc.tail())

    def sim_cluster(self, n: int, profile: Path | str, *, name: str = "sim", base_port: int = 0,
                    events_base_port: int | None = None, id_prefix: str = "w", extra: list[str] | None = None,
                    timeout: float = 60.0) -> SimCluster:
        argv = [self.python, "-m", "workers.cli", "sim-cluster", "--workers", str(n), "--profile", str(profile),
                "--base-port", str(base_port), "--host", "127.0.0.1", "--id-prefix", id_prefix,
                "--tokenizer", str(self.code_root / "configs" / "assets" / "tiny-tokenizer")]
        if events_base_port is not None:
            argv += ["--events-base-port", str(events_base_port)]
        argv += extra or []
        proc = self.spawn(name, argv, watch_stdout=True)
        workers = []
        for line in self.wait_line(proc, "ready", timeout):
            words = line.split()
            if words and words[0] == "worker":
                kv = dict(w.split("=", 1) for w in words[2:] if "=" in w)
                workers.append(SimWorker(words[1], kv["url"], kv["events"],
                                         None if kv.get("replay", "-") == "-" else kv["replay"]))
        return SimCluster(proc, workers, argv)

    def restart_sim(self, sc: SimCluster, *, kill: bool = True, timeout: float = 60.0) -> SimCluster:
        """The same cluster again on the same ports (needs fixed --base-port/--events-base-port)."""
        if kill:
            self.kill(sc.proc)
        else:
            self.stop(sc.proc)
        proc = self.spawn("sim", sc.argv, watch_stdout=True)
        deadline = time.monotonic() + timeout
        while True:  # the old sockets may linger a moment
            try:
                lines = self.wait_line(proc, "ready", max(1.0, deadline - time.monotonic()))
                break
            except StartError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
                proc = self.spawn("sim", sc.argv, watch_stdout=True)
        workers = []
        for line in lines:
            words = line.split()
            if words and words[0] == "worker":
                kv = dict(w.split("=", 1) for w in words[2:] if "=" in w)
                workers.append(SimWorker(words[1], kv["url"], kv["events"],
                                         None if kv.get("replay", "-") == "-" else kv["replay"]))
        return SimCluster(proc, workers, sc.argv)

    def faulty(self, mode: str, *, model: str, digest: str, served: list[str] | None = None,
               kind: str = "kvroute", worker_id: str = "faulty", tokens: int = 8, token_delay: float = 0.0,
               timeout: float = 20.0, extra: list[str] | None = None) -> FaultyProc:
        # run as a script from this checkout (standard library only): --code-root may lack it
        argv = [self.python, str(Path(__file__).resolve().parent / "faulty.py"), "--mode", mode, "--kind", kind,
                "--worker-id", worker_id, "--model", model, "--digest", digest, "--tokens", str(tokens),
                "--token-delay", str(token_delay)]
        for s in served or []:
            argv += ["--served", s]
        argv += extra or []
        proc = self.spawn(f"faulty-{mode}", argv, watch_stdout=True)
        line = self.wait_line(proc, "ready", timeout)[-1]
        url = line.split("url=", 1)[1].strip()
        return FaultyProc(proc, url, worker_id)


def free_ports(n: int, avoid: set[int] | None = None) -> int:
    """A port p with p..p+n-1 all free (sim-cluster numbers its workers' ports from one)."""
    import socket

    avoid = avoid or set()
    for _ in range(500):
        p = free_port()
        if p + n > 65535 or any(q in avoid for q in range(p, p + n)):
            continue
        socks = []
        try:
            for q in range(p + 1, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return p
    raise StartError(f"no {n} consecutive free ports")


def _pump(stream: IO[bytes], log: IO[bytes], lines: queue.Queue[str]) -> None:
    """Copy a child's stdout into its log, line by line, and hand each line on."""
    try:
        for raw in iter(stream.readline, b""):
            log.write(raw)
            log.flush()
            lines.put(raw.decode(errors="replace").rstrip("\n"))
    except (OSError, ValueError):
        pass
    finally:
        try:
            log.close()
        except OSError:
            pass
