"""Running the gateway as an operator does: JSON request logs with the client's request id
(sent on to the worker), graceful shutdown on SIGTERM, the worker list reloaded on SIGHUP,
workers found through DNS (A records through the system resolver, SRV records from a real
DNS server on loopback), and `kvroute serve --processes N` on one port."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
import yaml
from fakes import FakeWorker, serve_fake
from gateway_fleet import MODEL, _cfg, fleet, wait_until
from hangs import patience

from loadtest.ports import free_port
from router.config import DiscoveryConfig
from router.fleet.discovery import Discovery, LookupFailed, resolve, worker_for
from router.fleet.fleetconfig import WorkerConfig
from router.telemetry.logs import JsonFormatter, client_request_id

ROOT = Path(__file__).resolve().parents[2]
DIGEST_MODEL = MODEL


class _Lines(logging.Handler):
    """Keeps every record of a logger, formatted as the gateway's JSON lines."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def request_lines() -> Any:
    h = _Lines()
    lg = logging.getLogger("kvroute.request")
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    yield h.lines
    lg.removeHandler(h)
    lg.setLevel(old)


def _body(stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 2, "stream": stream}


# ---------------------------------------------------------------------- request ids and logs


async def test_the_clients_request_id_is_logged_echoed_and_sent_to_the_worker(request_lines: Any) -> None:
    from gateway_fleet import DIGEST

    a = FakeWorker("a", DIGEST, cached_tokens=0)
    async with fleet([a]) as (_, url), aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=_body(), headers={"X-Request-Id": "req-42.a"}) as r:
            assert r.status == 200 and r.headers["x-request-id"] == "req-42.a"
            await r.read()
        async with s.post(url + "/v1/completions", json=_body(stream=True),
                          headers={"X-Request-Id": "bad id with spaces"}) as r:
            assert r.status == 200
            own = r.headers["x-request-id"]
            await r.read()
    assert own != "bad id with spaces" and client_request_id({"x-request-id": own}) == own
    assert a.completion_headers[0]["x-request-id"] == "req-42.a"
    assert a.completion_headers[1].get("x-request-id", own) == own  # never the unusable one
    done = [ln for ln in request_lines if ln["msg"] == "request done"]
    assert [ln["request_id"] for ln in done] == ["req-42.a", own]
    first = done[0]
    assert first["logger"] == "kvroute.request" and first["level"] == "INFO"
    assert first["worker"] == "a" and first["tenant"] and first["model"] == MODEL and first["policy"] == "kv_cost"
    assert first["reason"] and first["tries"] == 1 and first["ok"] is True
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] == 2
    for k in ("ttft_ms", "worker_ttft_ms", "e2e_ms", "routing_ms"):
        assert isinstance(first[k], float) and first[k] >= 0, k
    assert first["e2e_ms"] >= first["ttft_ms"] >= first["worker_ttft_ms"]


async def test_a_refused_request_is_logged_with_its_status(request_lines: Any) -> None:
    from gateway_fleet import DIGEST

    a = FakeWorker("a", DIGEST, fail_status=400)
    async with fleet([a]) as (_, url), aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=_body(), headers={"X-Request-Id": "r-400"}) as r:
            assert r.status == 400
            assert r.headers.get("x-request-id") in (None, "r-400")
    lines = [ln for ln in request_lines if ln.get("request_id") == "r-400"]
    assert lines and lines[-1]["msg"] in ("request refused", "request failed")


async def test_the_request_log_can_be_switched_off() -> None:
    from router.gateway import Gateway

    for over, logged in (({"observability": {"request_log": False}}, False), ({}, True)):
        gw = await Gateway.create(_cfg(**over))
        try:
            assert gw.observer.request_log is logged
        finally:
            await gw.close()


# ---------------------------------------------------------------------- a real `kvroute serve` process


def _write_config(path: Path, port: int, workers: list[FakeWorker], **over: Any) -> None:
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"id": MODEL, "tokenizer": str(ROOT / "configs" / "assets" / "tiny-tokenizer"),
                    "max_context_tokens": 512}],
        "workers": [{"id": w.worker_id, "url": w.url, "model": MODEL} for w in workers],
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.1, "probe_timeout_s": 0.5},
        "routing": {"policy": "round_robin", "retries": 1},
        "observability": {"log_level": "INFO", "log_format": "json"},
        **over,
    }
    path.write_text(yaml.safe_dump(data))


@asynccontextmanager
async def gateway_process(config: Path, *extra: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`kvroute serve --config FILE` as a child; its stderr collected into `proc.lines`. It
    runs in a session of its own, killed whole at the end: a replica (`--processes`) left
    behind would hold the stderr pipe and the workers' connections open."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config), *extra, cwd=str(ROOT),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    lines: list[str] = []
    proc.lines = lines  # type: ignore[attr-defined]

    async def pump() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            lines.append(raw.decode(errors="replace").rstrip("\n"))

    reader = asyncio.get_running_loop().create_task(pump())
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the gateway and any replica it forked
        await proc.wait()
        await asyncio.wait_for(reader, patience(5.0))


async def _get(s: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        return r.status, await r.json(content_type=None)


async def _until_ready(s: aiohttp.ClientSession, base: str, proc: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise AssertionError("the gateway exited:\n" + "\n".join(proc.lines[-30:]))
        try:
            if (await _get(s, base + "/ready"))[0] == 200:
                return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the gateway never became ready:\n" + "\n".join(proc.lines[-30:]))


async def _all_replicas_ready(base: str, proc: Any, timeout: float = 30.0) -> None:
    """Ready on fresh connections, several in a row: the kernel picks the replica per
    connection, and one `/ready` answer speaks for one replica only."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise AssertionError("the gateway exited:\n" + "\n".join(proc.lines[-30:]))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            try:
                if all([(await _get(s, base + "/ready"))[0] == 200 for _ in range(8)]):
                    return
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(0.1)
    raise AssertionError("not every replica became ready:\n" + "\n".join(proc.lines[-30:]))


def _json_lines(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for ln in lines:
        if ln.startswith("{"):
            out.append(json.loads(ln))
    return out


async def test_sigterm_stops_taking_work_gracefully_and_exits_clean(tmp_path: Path) -> None:
    from gateway_fleet import DIGEST

    slow = FakeWorker("a", DIGEST, token_delay_s=0.2)  # a 10-token stream lasts ~2 s
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with serve_fake(slow):
        cfg = tmp_path / "gw.yaml"
        grace = patience(1.0)  # long enough, on the machine running the test now, to send a request inside it
        _write_config(cfg, port, [slow], shutdown={"grace_s": grace, "drain_timeout_s": 10.0})
        async with gateway_process(cfg) as proc, aiohttp.ClientSession() as s:
            await _until_ready(s, base, proc)

            async def stream() -> str:
                async with aiohttp.ClientSession() as s2, s2.post(
                        base + "/v1/completions", json={**_body(stream=True), "max_tokens": 10}) as r:
                    assert r.status == 200
                    return (await r.read()).decode()

            in_flight = asyncio.get_running_loop().create_task(stream())
            await wait_until(lambda: len(slow.completions) == 1, 10.0, "the stream reaching the worker")
            t_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status, body = 200, {}
            while status == 200 and time.monotonic() - t_term < 0.8 * grace:
                status, body = await _get(s, base + "/ready")
            assert status == 503 and body["stopping"] is True  # not ready at once
            async with aiohttp.ClientSession() as s3, s3.post(base + "/v1/completions", json=_body()) as r:
                assert r.status == 200  # still taken within the grace period
            assert time.monotonic() - t_term < grace  # (else the request above proved nothing)
            text = await asyncio.wait_for(in_flight, patience(15.0))
            assert text.rstrip().endswith("data: [DONE]") and text.count("data: {") >= 10  # finished, whole
            code = await asyncio.wait_for(proc.wait(), patience(15.0))
            assert code == 0, "\n".join(proc.lines[-20:])
            with pytest.raises(aiohttp.ClientConnectionError):
                await _get(s, base + "/health")
    logs = _json_lines(proc.lines)  # type: ignore[attr-defined]
    assert any(ln["msg"].startswith("stopping: /ready answers 503") for ln in logs)
    assert all("Traceback" not in ln for ln in proc.lines), "\n".join(proc.lines)  # type: ignore[attr-defined]


async def test_sighup_reloads_the_worker_list_and_logs_the_diff(tmp_path: Path) -> None:
    from gateway_fleet import DIGEST

    a, b = FakeWorker("a", DIGEST), FakeWorker("b", DIGEST)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with serve_fake(a), serve_fake(b):
        cfg = tmp_path / "gw.yaml"
        _write_config(cfg, port, [a])
        async with gateway_process(cfg) as proc, aiohttp.ClientSession() as s:
            await _until_ready(s, base, proc)
            _write_config(cfg, port, [b], routing={"policy": "kv_cost"})
            proc.send_signal(signal.SIGHUP)

            async def ids() -> list[str]:
                st, body = await _get(s, base + "/admin/workers")
                assert st == 200, body
                return sorted(w["id"] for w in body["workers"])

            deadline = time.monotonic() + 10
            while await ids() != ["b"]:
                assert time.monotonic() < deadline, proc.lines[-10:]  # type: ignore[attr-defined]
                await asyncio.sleep(0.1)
            await _until_ready(s, base, proc)
            async with s.post(base + "/v1/completions", json=_body()) as r:
                assert r.status == 200 and r.headers["x-kvroute-worker"] == "b"
            cfg.write_text("workers: [this is not: valid")  # a broken file: the running config stays
            proc.send_signal(signal.SIGHUP)
            await wait_until(lambda: any("config not reloaded" in ln for ln in proc.lines), 10.0,  # type: ignore[attr-defined]
                             "the refusal in the log")
            assert await ids() == ["b"]
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), patience(20.0)) == 0
    logs = _json_lines(proc.lines)  # type: ignore[attr-defined]
    diff = [ln for ln in logs if ln.get("reason") == "reload"]
    assert diff and diff[0]["added"] == ["b"] and diff[0]["removed"] == ["a"]
    restart = [ln for ln in logs if "restart_needed" in ln]
    assert restart and restart[0]["restart_needed"] == ["routing"]


async def test_sighup_keeps_the_command_line_overrides(tmp_path: Path) -> None:
    """`--port` on the command line beats the file's `listen.port`, on SIGHUP as at start:
    a reload of an unchanged file reports no section needing a restart."""
    from gateway_fleet import DIGEST

    a = FakeWorker("a", DIGEST)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with serve_fake(a):
        cfg = tmp_path / "gw.yaml"
        _write_config(cfg, free_port(), [a])  # the file names another port
        async with gateway_process(cfg, "--port", str(port)) as proc, aiohttp.ClientSession() as s:
            await _until_ready(s, base, proc)
            proc.send_signal(signal.SIGHUP)
            await wait_until(lambda: any("config reloaded from" in ln for ln in proc.lines), 10.0,  # type: ignore[attr-defined]
                             "the reload in the log")
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), patience(20.0)) == 0
    logs = _json_lines(proc.lines)  # type: ignore[attr-defined]
    assert not [ln for ln in logs if ln.get("restart_needed")], proc.lines[-10:]  # type: ignore[attr-defined]


async def test_serve_processes_runs_replicas_on_one_port(tmp_path: Path) -> None:
    from gateway_fleet import DIGEST

    a = FakeWorker("a", DIGEST)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with serve_fake(a):
        cfg = tmp_path / "gw.yaml"
        _write_config(cfg, port, [a], shutdown={"grace_s": 0.0, "drain_timeout_s": 5.0})
        async with gateway_process(cfg, "--processes", "2") as proc, aiohttp.ClientSession() as s:
            await _until_ready(s, base, proc)
            children = await _listeners(port, 2)
            assert len(children) == 2 and proc.pid not in children  # two processes bound to the one port
            await _all_replicas_ready(base, proc)
            for _ in range(10):
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s1, \
                        s1.post(base + "/v1/completions", json=_body()) as r:
                    assert r.status == 200
            os.kill(children[0], signal.SIGKILL)  # one replica dies: restarted, the port keeps answering
            again = await _listeners(port, 2, avoid=children[0])
            assert children[0] not in again and children[1] in again
            await _until_ready(s, base, proc)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), patience(20.0))
            assert code == 0, "\n".join(ln for ln in proc.lines if "request done" not in ln)  # type: ignore[attr-defined]
        assert all(_gone(pid) for pid in again)
    assert len(a.completions) == 10


async def _listeners(port: int, n: int, avoid: int | None = None, timeout: float = 30.0) -> list[int]:
    """Pids of processes with a socket listening on `port` (read from /proc), once there are `n`."""
    deadline = time.monotonic() + timeout
    while True:
        pids = sorted(p for p in _pids_listening(port) if p != avoid) if avoid else sorted(_pids_listening(port))
        if len(pids) >= n or time.monotonic() > deadline:
            return pids
        await asyncio.sleep(0.2)


def _pids_listening(port: int) -> set[int]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # state LISTEN
                inodes.add(f[9])
    pids = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.add(int(d.name))
                    break
        except OSError:
            continue
    return pids


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0


def test_processes_needs_a_fixed_port(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    _write_config(cfg, 0, [])
    r = subprocess.run([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(cfg), "--processes", "2"],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "fixed port" in r.stderr


# ---------------------------------------------------------------------- discovery


async def test_workers_come_and_go_with_the_names_a_records() -> None:
    from gateway_fleet import DIGEST

    a = FakeWorker("a", DIGEST)
    async with serve_fake(a):
        entry = {"name": "localhost", "port": a.port, "interval_s": 0.2}
        cfg = _cfg(discovery=[entry], pool={"load_poll_interval_s": 0.05, "health_interval_s": 0.1,
                                            "probe_timeout_s": 0.3, "unhealthy_after": 1})
        async with fleet([], cfg, ready=False) as (gw, url):
            wid = f"localhost-127.0.0.1-{a.port}"
            await wait_until(lambda: wid in gw.pool.workers, 5.0, "the discovered worker")
            await gw.pool.wait_ready(5.0)
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=_body()) as r:
                assert r.status == 200
            assert len(a.completions) == 1


class _Dns(asyncio.DatagramProtocol):
    """A DNS server on loopback answering SRV queries from `records` (name -> [(target, port)])."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, int]]] = {}
        self.transport: asyncio.DatagramTransport | None = None
        self.queries = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        q = dns.message.from_wire(data)
        self.queries += 1
        r = dns.message.make_response(q)
        name = q.question[0].name.to_text()
        if q.question[0].rdtype == dns.rdatatype.SRV and name in self.records:
            rrs = [f"0 10 {port} {target}" for target, port in self.records[name]]
            if rrs:
                r.answer.append(dns.rrset.from_text(name, 5, "IN", "SRV", *rrs))
        else:
            r.set_rcode(dns.rcode.NXDOMAIN)
        assert self.transport is not None
        self.transport.sendto(r.to_wire(), addr)


async def test_srv_records_from_a_dns_server_are_followed() -> None:
    loop = asyncio.get_running_loop()
    transport, srv = await loop.create_datagram_endpoint(_Dns, local_addr=("127.0.0.1", 0))
    try:
        ns = [("127.0.0.1", transport.get_extra_info("sockname")[1])]
        name = "_http._tcp.workers.test."
        srv.records[name] = [("localhost.", 9001), ("localhost.", 9002)]
        entry = DiscoveryConfig(name=name, srv=True, interval_s=0.05, model=MODEL)
        seen: list[dict[str, WorkerConfig]] = []
        d = Discovery([entry], seen.append, resolver=functools.partial(resolve, nameservers=ns))
        await d.start()
        try:
            assert sorted(w.url for w in seen[-1].values()) == ["http://localhost:9001", "http://localhost:9002"]
            assert sorted(seen[-1]) == ["workers-localhost-9001", "workers-localhost-9002"]
            srv.records[name] = [("localhost.", 9002)]  # one pod went away
            await wait_until(lambda: len(seen) == 2, 5.0, "the shrunk answer")
            assert list(seen[-1]) == ["workers-localhost-9002"]
            q = srv.queries
            await wait_until(lambda: srv.queries >= q + 3, 5.0, "more lookups")
            assert len(seen) == 2  # the same answer again is no change
            del srv.records[name]  # the name is gone: no workers
            await wait_until(lambda: len(seen) == 3, 5.0, "the empty answer")
            assert seen[-1] == {}
        finally:
            await d.close()
        with pytest.raises(LookupFailed):  # nobody answers: a failure, not an empty fleet
            await resolve(entry, nameservers=[("127.0.0.1", free_port())])
    finally:
        transport.close()


async def test_a_failed_lookup_keeps_the_last_answer() -> None:
    answers: list[Any] = [[("10.0.0.1", 80)], LookupFailed("down"), [("10.0.0.2", 80)]]

    async def fake(entry: DiscoveryConfig) -> list[tuple[str, int]]:
        a = answers.pop(0) if answers else [("10.0.0.2", 80)]
        if isinstance(a, Exception):
            raise a
        return list(a)

    seen: list[dict[str, WorkerConfig]] = []
    d = Discovery([DiscoveryConfig(name="w.ns.svc", port=80, interval_s=0.02, model=MODEL)], seen.append, fake)
    await d.start()
    try:
        await wait_until(lambda: len(seen) == 2, 5.0, "the second answer")
    finally:
        await d.close()
    assert list(seen[0]) == ["w-10.0.0.1-80"] and list(seen[1]) == ["w-10.0.0.2-80"]
    assert d.failures == 1


def test_worker_for_fills_the_template() -> None:
    e = DiscoveryConfig(name="vllm.default.svc.cluster.local", port=8000, kind="vllm", model=MODEL,
                        events={"endpoint": "tcp://{host}:5557", "replay_endpoint": "tcp://{host}:5558"})
    w = worker_for(e, "fd00::7", 8000)
    assert w.id == "vllm-fd00__7-8000" and w.url == "http://[fd00::7]:8000" and w.kind == "vllm"
    assert w.events is not None and w.events.endpoint == "tcp://[fd00::7]:5557"
    assert w.events.replay_endpoint == "tcp://[fd00::7]:5558"
    with pytest.raises(ValueError, match="port"):
        DiscoveryConfig(name="x", model=MODEL)


# ---------------------------------------------------------------------- OpenTelemetry


async def test_each_request_is_a_span_when_tracing_is_on() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the OpenTelemetry SDK (extra `otel`) is not installed")
    from gateway_fleet import DIGEST
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from router.telemetry.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    a = FakeWorker("a", DIGEST, token_delay_s=0.05)
    async with fleet([a], _cfg(observability={"otel": {"enabled": True}})) as (gw, url):
        tracer = RequestTracer(provider.get_tracer("test"), gw.observer.tracer.status)  # type: ignore[union-attr]
        gw.observer.tracer = tracer  # the global provider is process-wide: the test's own instead
        t0 = time.time_ns()
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={**_body(), "max_tokens": 4},
                                                        headers={"X-Request-Id": "span-1"}) as r:
            assert r.status == 200
            await r.read()
        t1 = time.time_ns()
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvroute.request" and span.status.is_ok
    attrs = dict(span.attributes or {})
    assert attrs["kvroute.request_id"] == "span-1" and attrs["kvroute.worker"] == "a"
    assert attrs["kvroute.policy"] == "kv_cost" and attrs["kvroute.reason"]
    assert all(v is not None for v in attrs.values())
    assert span.start_time is not None and span.end_time is not None
    assert t0 <= span.start_time < span.end_time <= t1 + 10**6
    assert span.end_time - span.start_time >= 0.15e9  # the whole request: four tokens 50 ms apart
    assert trace.get_tracer_provider() is not provider


def test_tracing_off_or_without_the_sdk_costs_nothing() -> None:
    from router.config import OtelConfig
    from router.telemetry.tracing import RequestTracer

    assert RequestTracer.build(OtelConfig()) is None
    import builtins

    real = builtins.__import__

    def no_otel(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ImportError(name)
        return real(name, *args, **kw)

    builtins.__import__ = no_otel
    try:
        assert RequestTracer.build(OtelConfig(enabled=True)) is None
    finally:
        builtins.__import__ = real


# ---------------------------------------------------------------------- replicas


async def test_a_replica_counts_its_unseen_dispatches_for_the_others() -> None:
    from router.gateway import Gateway
    from router.planner.inflight import InflightLedger
    from router.planner.types import CostParams, WorkerView

    led = InflightLedger("w", replicas=2)
    led.dispatched(0.0, 100, 120)
    t = led.dispatched(0.0, 50, 60)
    v = WorkerView("w", CostParams(block_size=16, block_bytes=1 << 21, prefill_tokens_per_s=1e4))
    led.fill(v, 0.0)
    assert v.inflight_since_report_requests == 4 and v.inflight_since_report_prefill_tokens == 300
    assert v.inflight_requests == 2 and v.inflight_prefill_tokens == 150  # its own, counted once
    led.accepted(t, 0.1)
    led.report_taken(sent_at=0.2)  # the report knows `t`: only the other is unseen now
    led.fill(v, 0.3)
    assert v.inflight_since_report_requests == 2 and v.inflight_since_report_prefill_tokens == 200
    gw = await Gateway.create(_cfg(routing={"policy": "kv_cost", "replicas": 3}))
    try:
        assert gw.cfg.routing.replicas == 3
    finally:
        await gw.close()
