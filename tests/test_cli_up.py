"""The README's main command, `kvroute up --sim`, end to end: a real process tree, the SDK.

Starts the gateway and its simulated workers the way a newcomer does, asks through the
official `openai` SDK, repeats a long prompt (served from cache the second time), and
stops it with Ctrl-C (SIGINT), which must take the workers down too.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


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
