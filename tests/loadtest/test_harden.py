"""The adversarial suite (`kvroute loadtest harden`, docs/harden.md) as tests.

- The counters' definitions, on synthetic replies (no process).
- The faulty worker and the raw client against each other: what a broken worker does is
  seen as hung, lost or answered exactly as docs/harden.md says.
- A quick subset of the `small` suite (~2 minutes: a real gateway and real workers per
  case) in the default run, and every case of `small` under `-m slow` (~5 minutes). Each
  case is its own test: it fails with the case's failing checks and sample requests.
"""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.harden import report
from loadtest.harden.client import Reply, request
from loadtest.harden.outcome import (
    ABANDONED,
    ANSWERED,
    CHAT,
    COMPLETION,
    HUNG,
    LOST,
    REFUSED,
    RELAYED,
    S5XX,
    WRONG,
    CaseResult,
    Spec,
    classify,
)
from loadtest.harden.procs import Procs
from loadtest.harden.runner import CASES, Settings, run_suite

ROOT = Path(__file__).resolve().parents[2]

# A subset of `small` that fits the default run (~2 minutes when the cases pass).
QUICK = ("burst_at_start", "hanging_worker", "special_tokens", "tenant_probe", "admin_ipc_bind", "admin_ssrf",
         "deep_json", "worker_killed_mid_stream", "worker_500", "gateway_restart", "client_disconnects",
         "body_413_keepalive", "fuzz_mutation")


# --------------------------------------------------------------------------- the counters' definitions


def _json(status: int, body: bytes, **headers: str) -> Reply:
    return Reply(status=status, headers={"content-type": "application/json", **headers}, body=body, complete=True)


def _sse(body: bytes, complete: bool = True) -> Reply:
    return Reply(status=200, headers={"content-type": "text/event-stream"}, body=body, complete=complete)


CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "length"}]}\n\n'
ERR = b'data: {"error": {"message": "The worker failed while generating.", "type": "upstream_error"}}\n\n'


@pytest.mark.parametrize("rep,spec,want", [
    (_json(200, b'{"choices": [{"message": {"role": "assistant", "content": "x"}}]}'), Spec(expect=CHAT), ANSWERED),
    (_json(200, b'{"choices": [{"text": "x"}]}'), Spec(expect=COMPLETION), ANSWERED),
    (_json(200, b'{"choices": []}'), Spec(expect=CHAT), WRONG),
    (_json(200, b'{"choices": [{"text": "x"}'), Spec(expect=COMPLETION), WRONG),
    (_sse(CHUNK + b"data: [DONE]\n\n"), Spec(expect=CHAT, stream=True), ANSWERED),
    (_sse(CHUNK), Spec(expect=CHAT, stream=True), LOST),  # no [DONE], no error event
    (_sse(CHUNK + ERR + b"data: [DONE]\n\n"), Spec(expect=CHAT, stream=True, worker_fault=True), RELAYED),
    (_sse(CHUNK + ERR), Spec(expect=CHAT, stream=True, worker_fault=True), RELAYED),  # an explicit error suffices
    (_sse(CHUNK + ERR + b"data: [DONE]\n\n"), Spec(expect=CHAT, stream=True), S5XX),  # a healthy worker was there
    (_sse(CHUNK + b"data: [DONE]\n\n", complete=False), Spec(expect=CHAT, stream=True), LOST),  # chunked cut short
    (_sse(b"data: {not json\n\ndata: [DONE]\n\n"), Spec(expect=CHAT, stream=True), WRONG),
    (_json(429, b'{"error": {"message": "busy", "type": "rate_limit_error"}}', **{"retry-after": "1"}), Spec(),
     REFUSED),
    (_json(429, b'{"error": {"message": "busy", "type": "rate_limit_error"}}'), Spec(), WRONG),  # no Retry-After
    (_json(400, b'{"detail": "bad"}'), Spec(), WRONG),  # not OpenAI's shape
    (_json(502, b'{"error": {"message": "A worker failed.", "type": "upstream_error"}}'), Spec(worker_fault=True),
     RELAYED),
    (_json(502, b'{"error": {"message": "A worker failed.", "type": "upstream_error"}}'), Spec(), S5XX),
    (_json(500, b'{"error": {"message": "Internal error.", "type": "internal_error"}}'), Spec(worker_fault=True),
     S5XX),  # a 500 is the gateway's own, never a relayed failure
    (_json(502, b'{"error": {"message": "worker w-7 failed: ClientPayloadError: x", "type": "e"}}'),
     Spec(worker_fault=True, secrets=("w-7",)), WRONG),
    (_json(502, b'{"error": {"message": "ServerDisconnectedError: Server disconnected", "type": "e"}}'),
     Spec(worker_fault=True), WRONG),
    (_json(502, b'{"error": {"message": "connect to http://127.0.0.1:9001 failed", "type": "e"}}'),
     Spec(worker_fault=True), WRONG),
    (_json(502, b'{"error": {"message": "The worker failed and the retry failed too.", "type": "e"}}'),
     Spec(worker_fault=True, single_worker=True), WRONG),
    (_json(201, b'{"id": "evil"}'), Spec(must_refuse=True), WRONG),
    (Reply(timed_out=True), Spec(), HUNG),
    (Reply(status=200, timed_out=True, body=CHUNK), Spec(), HUNG),
    (Reply(error="connection reset"), Spec(), LOST),
    (Reply(refused=True, error="connection refused"), Spec(), LOST),
    (Reply(abandoned=True), Spec(), ABANDONED),
])
def test_counters_follow_their_definitions(rep: Reply, spec: Spec, want: str) -> None:
    assert classify(rep, spec).category == want


def test_4xx_may_echo_the_clients_own_words() -> None:
    """A 400 naming the client's own (odd) model name is no leak; a traceback is."""
    ok = _json(404, b'{"error": {"message": "The model `http://x/FooError` does not exist.", "type": "x"}}')
    assert classify(ok, Spec()).category == REFUSED
    tb = _json(400, b'{"error": {"message": "Traceback (most recent call last): ...", "type": "x"}}')
    assert classify(tb, Spec()).category == WRONG


# --------------------------------------------------------------------------- the faulty worker, seen by the client


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def test_faulty_worker_modes_are_seen_as_documented(procs: Procs) -> None:
    fp = procs.faulty("ok", model="m", digest="0" * 64, served=["m"], tokens=4)
    host, port = "127.0.0.1", fp.port
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
    comp = Spec(expect=COMPLETION, stream=True)

    async def mode(m: str) -> None:
        r = await request(host, port, "POST", "/_mode", {"mode": m}, timeout=5)
        assert r.status == 200

    async def go() -> dict[str, str]:
        out = {}
        for m, timeout in (("ok", 5.0), ("truncated", 5.0), ("reset_mid", 5.0), ("garbage", 5.0),
                           ("s429", 5.0), ("hang", 1.0), ("stall", 1.0)):
            await mode(m)
            out[m] = classify(await request(host, port, "POST", "/v1/completions", body, timeout=timeout),
                              comp).category
        stats = await request(host, port, "GET", "/_stats", timeout=5)
        out["stats"] = stats.body.decode()
        return out

    got = asyncio.run(go())
    assert got["ok"] == ANSWERED
    assert got["truncated"] == LOST and got["reset_mid"] == LOST  # a cut stream, no error event
    assert got["garbage"] == WRONG
    assert got["s429"] == REFUSED  # OpenAI's shape, with Retry-After
    assert got["hang"] == HUNG and got["stall"] == HUNG
    assert '"completions": 7' in got["stats"]
    procs.stop(fp.proc, signal.SIGTERM)


# --------------------------------------------------------------------------- the suite


def _run(names: tuple[str, ...], out: Path) -> dict[str, CaseResult]:
    from loadtest.harden import cases  # noqa: F401  (registers them)

    results = run_suite(list(names), Settings(size="small", out=out))
    print("\n" + report.table(results) + "\n\n" + report.details(results))
    return {r.name: r for r in results}


def _assert_case(r: CaseResult) -> None:
    """Every column and functional check; the timing checks (wall-clock bounds, scaled by
    the load) are the report's: a busy machine must not fail the test run (they are
    printed with the table above)."""
    if r.verdict == "SKIP":
        pytest.skip(r.skipped or "skipped")
    assert r.functional_verdict == "PASS", f"{r.name}: {r.verdict}\n{report.table([r])}\n{report.details([r])}"


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CaseResult]:
    return _run(QUICK, tmp_path_factory.mktemp("harden-quick"))


@pytest.mark.parametrize("name", QUICK)
def test_harden_quick(name: str, quick_results: dict[str, CaseResult]) -> None:
    """No request hung, lost or answered wrongly; no 5xx but a relayed worker failure;
    every check of the case held."""
    _assert_case(quick_results[name])


def _all_cases() -> list[str]:
    from loadtest.harden import cases  # noqa: F401

    return list(CASES)


@pytest.fixture(scope="module")
def small_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CaseResult]:
    return _run(tuple(_all_cases()), tmp_path_factory.mktemp("harden-small"))


@pytest.mark.slow
@pytest.mark.parametrize("name", _all_cases())
def test_harden_small(name: str, small_results: dict[str, CaseResult]) -> None:
    _assert_case(small_results[name])


def test_a_reused_out_folder_is_refused_before_any_case_runs(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest.harden.cli import main

    (tmp_path / "report.json").write_text("{}")
    assert main(["--cases", "deep_json", "--out", str(tmp_path), "--quiet"]) == 2
    assert str(tmp_path) in capsys.readouterr().err and (tmp_path / "report.json").read_text() == "{}"
