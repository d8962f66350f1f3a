"""The README's main command, `kvroute up`, end to end: a real process tree, the SDK.

Starts the gateway and its workers the way a newcomer does (real engine workers on the
bundled tiny model; `--sim`: simulated ones), asks through the official `openai` SDK,
repeats a long prompt (served from cache the second time), checks that
`--events-base-port` puts every port the children listen on in the chosen range, and
stops it with Ctrl-C (SIGINT) or SIGTERM, which must take the workers down too.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from kvroute.up import UpError, plan_ports
from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def _wait_ready(url: str, proc: subprocess.Popen[str], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvroute up exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("kvroute up was not ready in time")


def _wait_indexed(url: str, body: dict, blocks: int, timeout: float = 10.0) -> None:  # type: ignore[type-arg]
    """Until the gateway's index holds `blocks` of the request's prefix blocks on some worker:
    the KV events of the request just served travel on their own socket, and a request sent
    before they land is routed without them."""
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(url + "/admin/route/explain", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            matches = json.loads(r.read())["matches"]
        if max((m["blocks"] for m in matches.values()), default=0) >= blocks:
            return
        assert time.monotonic() < deadline, f"the gateway's index never saw the prefix: {matches}"
        time.sleep(0.05)


def test_kvroute_up_sim_serves_the_sdk_and_stops_on_ctrl_c() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "up", "--sim", "--workers", "2", "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert "llama-3.1-8b" in [m.id for m in c.models.list().data]
        long_prompt = [{"role": "system", "content": "You answer in one word. " * 60},
                       {"role": "user", "content": "Hello"}]
        first = c.chat.completions.create(model="llama-3.1-8b", messages=long_prompt, max_tokens=4)
        assert first.choices[0].message.content and first.usage is not None and first.usage.prompt_tokens > 256
        _wait_indexed(url, {"model": "llama-3.1-8b", "messages": long_prompt}, first.usage.prompt_tokens // 16)
        second = c.chat.completions.create(model="llama-3.1-8b", messages=long_prompt, max_tokens=4)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details.cached_tokens >= 256  # routed to the worker holding it
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise AssertionError("kvroute up did not stop on SIGINT:\n" + out[-3000:]) from None
    assert proc.returncode in (0, -signal.SIGINT, 130), out[-3000:]
    assert "Traceback" not in out, out


# ---------------------------------------------------------------------- real engine workers


def _free_range(k: int) -> int:
    """A first port P with P..P+k-1 all free, below Linux's ephemeral range (32768+), so that
    no outgoing connection of the local machine takes one of them in the meantime."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - k)
        socks = []
        try:
            for p in range(base, base + k):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port range")


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _listening_ports(pids: list[int]) -> dict[int, set[int]]:
    """TCP ports each process listens on: its socket inodes matched against /proc/net/tcp{,6}."""
    listen: dict[str, int] = {}  # socket inode -> port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                listen[f[9]] = int(f[1].rsplit(":", 1)[1], 16)
    ports: dict[int, set[int]] = {}
    for pid in pids:
        ports[pid] = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listen:
                ports[pid].add(listen[target[8:-1]])
    return ports


def _get(url: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> str:
    proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"kvroute up did not stop on signal {sig}:\n" + out[-3000:]) from None
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _up_real(port: int, tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    # Small pools (256 GPU blocks = 4096 tokens, 32 MB of CPU tier): quick to start, little memory.
    return subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", "up", "--port", str(port), "--state-dir", str(tmp_path / "state"),
         "--num-blocks", "256", "--cpu-bytes", "3.2e7", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_kvroute_up_real_engine_serves_caches_keeps_its_ports_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    n = 2
    port = free_port()
    base = _free_range(3 * n)
    proc = _up_real(port, tmp_path, "--workers", str(n), "--events-base-port", str(base))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, timeout=150)  # the first start on a machine generates the weights
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["kvroute/tiny-llama", "tiny"]
        hello = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        assert hello.choices[0].message.content and hello.usage is not None and hello.usage.completion_tokens == 4
        # A long shared prefix: the second request goes where it is cached and reuses it.
        doc = " ".join(f"Clause {i}: the tenant keeps the premises in good repair." for i in range(40))
        long_prompt = [{"role": "system", "content": doc}, {"role": "user", "content": "Who repairs the roof?"}]
        first = c.chat.completions.with_raw_response.create(model="kvroute/tiny-llama", messages=long_prompt,
                                                            max_tokens=4, temperature=0)
        f = first.parse()
        assert f.usage is not None and f.usage.prompt_tokens > 512
        _wait_indexed(url, {"model": "kvroute/tiny-llama", "messages": long_prompt}, f.usage.prompt_tokens // 16)
        second = c.chat.completions.with_raw_response.create(model="kvroute/tiny-llama", messages=long_prompt,
                                                             max_tokens=4, temperature=0)
        s = second.parse()
        assert s.usage is not None and s.usage.prompt_tokens_details is not None and s.usage.model_extra
        cached, kv = s.usage.prompt_tokens_details.cached_tokens or 0, s.usage.model_extra["kv"]
        if second.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]:
            assert cached >= f.usage.prompt_tokens - 16 and kv["loaded_tokens"]["GPU"] == cached  # all but the tail
        else:  # the gateway may rather have the idle worker pull the prefix from the first one
            assert kv["loaded_tokens"]["PEER"] == cached >= f.usage.prompt_tokens // 2, kv
        assert s.choices[0].message.content == f.choices[0].message.content  # greedy, exact reuse

        # Every port the children listen on is in [base, base + 3n); the gateway's is --port.
        kids = _children(proc.pid)
        assert len(kids) == n
        listening = _listening_ports([proc.pid, *kids])
        assert listening[proc.pid] == {port}
        child_ports = set().union(*(listening[k] for k in kids))
        assert child_ports == set(range(base, base + 3 * n)), (base, listening)
        workers = _get(url + "/admin/workers")["workers"]
        assert sorted(w["id"] for w in workers) == ["w0", "w1"]
        for w in workers:
            assert w["state"] == "healthy" and "prefetch" in w["capabilities"] and "peer_pull" in w["capabilities"]
            info = _get(w["url"] + "/info")
            endpoints = [w["url"], info["events"]["endpoint"], info["events"]["replay_endpoint"]]
            assert all(base <= int(e.rsplit(":", 1)[1]) < base + 3 * n for e in endpoints), endpoints
            assert info["engine"] == "torch" and info["model"] == "kvroute/tiny-llama"
        assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["kv-w0", "kv-w1"]
    finally:
        kids = _children(proc.pid)
        out = _stop(proc)
    assert proc.returncode in (0, -signal.SIGINT, 130), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert all(_gone(k) for k in kids), kids
    assert "[w0] worker w0 url=" in out and "[w1] ready" in out  # the workers' output is relayed


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_kvroute_up_stops_its_workers_on_sigterm_while_starting_and_on_sigkill(tmp_path: Path) -> None:
    # SIGTERM while the workers are still loading: `up` stops them and exits, nothing stays.
    proc = _up_real(free_port(), tmp_path, "--workers", "2")
    deadline = time.monotonic() + 30
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    kids = _children(proc.pid)
    assert len(kids) == 2
    out = _stop(proc, signal.SIGTERM)
    assert proc.returncode in (0, 130), out[-3000:]
    assert all(_gone(k) for k in kids), kids
    # SIGKILL once serving: `up` cannot clean up, the workers go anyway (PR_SET_PDEATHSIG).
    port = free_port()
    proc = _up_real(port, tmp_path, "--workers", "1")
    _wait_ready(f"http://127.0.0.1:{port}", proc, timeout=150)
    kids = _children(proc.pid)
    assert len(kids) == 1
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + 30
    while not all(_gone(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(k) for k in kids), kids


def test_port_plan() -> None:
    assert plan_ports(2, 0, None).http == [0, 0] and plan_ports(2, 0, None).events is None
    assert plan_ports(2, 9000, None).http == [9000, 9001]
    p = plan_ports(3, 0, 30000)  # events/replay pairs first, then the HTTP ports: [P, P + 3N)
    assert p.events == [30000, 30002, 30004] and p.http == [30006, 30007, 30008]
    p = plan_ports(2, 9000, 30000)  # an explicit --base-port keeps the HTTP ports there
    assert p.events == [30000, 30002] and p.http == [9000, 9001]
    with pytest.raises(UpError):
        plan_ports(4, 0, 65530)
    with pytest.raises(UpError):
        plan_ports(0, 0, None)


def test_up_refuses_flags_of_the_other_fleet() -> None:
    r = subprocess.run([sys.executable, "-m", "kvroute.cli", "up", "--profile", "tiny-cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--sim" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvroute.cli", "up", "--sim", "--num-blocks", "64"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "real engine" in r.stderr


def test_up_pd_plans_prefill_and_decode_workers_and_a_pair_policy(tmp_path: Path) -> None:
    """`--pd P:D`: the engine commands carry each worker's role, the gateway's config lists
    the roles and routes by pd_cost (the config's own pair policy is kept)."""
    from kvroute.cli import build_parser
    from kvroute.up import fleet_config, real_worker_cmds
    from router.config import load_config

    a = build_parser().parse_args(["up", "--pd", "1:2", "--engine-arg=--no-calibrate"])
    cmds = real_worker_cmds(a, plan_ports(3, 9000, None), tmp_path)
    assert [wid for wid, _ in cmds] == ["p0", "d0", "d1"]
    for (wid, cmd), role in zip(cmds, ("prefill", "decode", "decode"), strict=True):
        assert cmd[cmd.index("--role") + 1] == role and cmd[cmd.index("--worker-id") + 1] == wid
        assert cmd[-1] == "--no-calibrate"
    cfg = load_config(str(ROOT / "configs" / "default.yaml"))
    fleet_config(cfg, a, [("p0", "http://127.0.0.1:9000"), ("d0", "http://127.0.0.1:9001"),
                          ("d1", "http://127.0.0.1:9002")])
    assert [(w.id, w.role, w.kind) for w in cfg.workers] == [
        ("p0", "prefill", "kvroute"), ("d0", "decode", "kvroute"), ("d1", "decode", "kvroute")]
    assert cfg.routing.policy == "pd_cost" and cfg.routing.params == {}
    cfg.routing.policy = "pd_prefix"
    fleet_config(cfg, a, [("p0", "http://127.0.0.1:9000"), ("d0", "http://127.0.0.1:9001")])
    assert cfg.routing.policy == "pd_prefix"
    # without --pd: workers of role both, no --role flag, the config's policy
    b = build_parser().parse_args(["up", "--workers", "2"])
    assert all("--role" not in cmd for _, cmd in real_worker_cmds(b, plan_ports(2, 9000, None), tmp_path))
    cfg = load_config(str(ROOT / "configs" / "default.yaml"))
    fleet_config(cfg, b, [("w0", "http://127.0.0.1:9000")])
    assert cfg.workers[0].role == "both" and cfg.routing.policy == "kv_cost"


def test_up_pd_refuses_bad_splits_and_other_fleets() -> None:
    for args, said in ((["--pd", "0:1"], "at least one"), (["--pd", "2"], "expected P:D"),
                       (["--pd", "1:1", "--sim"], "not --sim"), (["--pd", "1:1", "--workers", "2"], "--workers")):
        r = subprocess.run([sys.executable, "-m", "kvroute.cli", "up", *args],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and said in r.stderr, (args, r.stderr)
