"""`kvroute loadtest calibrate`: a worker measured over HTTP becomes a simulator profile
(loadtest/calibrate.py). The worker here is a small aiohttp server that answers as an
engine of known speeds would; the measured profile must load and carry those speeds."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from loadtest.calibrate import run_calibrate
from loadtest.cli import main as loadtest_main
from workers.sim.profile import load_profile

TPS = 5000.0
OVERHEAD = 0.02
STEP = 0.004


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = len(body["prompt"])
    assert body["cache_salt"]  # every probe is uncached
    if not body.get("stream"):
        await asyncio.sleep(OVERHEAD + n / TPS)
        return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": n, "completion_tokens": 1}})
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(body["max_tokens"]):
        await asyncio.sleep(STEP)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _models(_request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "fake-engine"}]})


@pytest.fixture
def engine_url() -> Iterator[str]:
    import threading

    port: list[int] = []
    # Events of another loop are only set/waited there: use threading primitives around them.
    started = threading.Event()

    def run() -> None:
        async def main() -> None:
            app = web.Application()
            app.add_routes([web.post("/v1/completions", _completions), web.get("/v1/models", _models)])
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
            started.set()
            while not done.is_set():
                await asyncio.sleep(0.05)
            await runner.cleanup()

        asyncio.run(main())

    done = threading.Event()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port[0]}"
    done.set()
    t.join(10)


def test_measured_speeds_become_a_loadable_profile(engine_url: str, tmp_path: Path) -> None:
    out = tmp_path / "measured.yaml"
    m = run_calibrate(engine_url, out, base_profile="tiny-cpu", name="measured", model=None,
                      lengths=(64, 256, 1024), repeats=2)
    # The fit keeps the base profile's form (linear + attention). A loaded machine only makes
    # the fake slower than its sleeps, never faster: so the bounds are one-sided (what it
    # predicts is at least near the engine's time, and grows with the prompt).
    preds = [m.overhead_s + n / m.prefill_tokens_per_s + m.prefill_attn_s_per_token2 * n * n / 2
             for n in (64, 256, 1024)]
    assert all(p >= 0.7 * (OVERHEAD + n / TPS) for p, n in zip(preds, (64, 256, 1024), strict=True)), preds
    assert preds[0] < preds[1] < preds[2]
    assert set(m.decode_steps) == {1, 4, 8} and all(s > STEP * 0.5 for s in m.decode_steps.values())
    prof = load_profile(out)
    assert prof.name == "measured" and prof.compute.prefill_tokens_per_s == pytest.approx(m.prefill_tokens_per_s, 0.01)
    assert prof.geometry == load_profile("tiny-cpu").geometry  # what HTTP cannot show comes from the base
    assert "Measured by `kvroute loadtest calibrate`" in out.read_text()


def test_cli_refuses_bad_input_and_an_existing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.yaml"
    out.write_text("keep me")
    assert loadtest_main(["calibrate", "--url", "http://127.0.0.1:9", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "keep me"
    assert loadtest_main(["calibrate", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "q.yaml"),
                          "--lengths", "a,b"]) == 2
