"""`python -m workers.cli sim-cluster`: N workers in one process, one ready line each then
"ready", serving until SIGTERM, text tokenized with `--tokenizer`; bad arguments exit 2
with a message."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from router.intake.tokenize import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
QWEN_LIKE = ROOT / "tests" / "data" / "tokenizers" / "qwen2.5-style"


def test_sim_cluster_cli_serves_and_stops() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "sim-cluster", "--workers", "3", "--profile", "tiny-cpu",
         "--base-port", "0", "--remote-groups", "1", "--tokenizer", str(QWEN_LIKE)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KVROUTE_PEER_TOKEN": "t"},
    )
    try:
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, proc.stderr.read()  # type: ignore[union-attr]
            if line.strip() == "ready":
                break
            lines.append(line.split())
        assert [w[1] for w in lines] == ["w0", "w1", "w2"]
        for words in lines:
            fields = dict(x.split("=", 1) for x in words[2:])
            with urllib.request.urlopen(fields["url"] + "/info", timeout=5) as r:
                info = json.load(r)
            assert info["worker_id"] == words[1] and info["events"]["endpoint"] == fields["events"]
            assert info["remote_group"] == fields["remote_group"] == "rg0"
            req = urllib.request.Request(
                fields["url"] + "/v1/completions", data=json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=5) as r:
                assert json.load(r)["usage"]["completion_tokens"] == 2
        messages = [{"role": "user", "content": "Hello, tokenizer of the gateway!"}]
        req = urllib.request.Request(
            fields["url"] + "/v1/chat/completions", data=json.dumps({"messages": messages, "max_tokens": 1}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            prompt_tokens = json.load(r)["usage"]["prompt_tokens"]
        gw = Tokenizer(QWEN_LIKE)
        assert prompt_tokens == len(gw.encode_text(gw.render_chat(messages), False))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sim_cluster_bad_arguments() -> None:
    for args in (["--workers", "0", "--profile", "tiny-cpu", "--base-port", "0"],
                 ["--workers", "1", "--profile", "nope", "--base-port", "0"],
                 ["--workers", "2", "--profile", "tiny-cpu", "--base-port", "0", "--remote-groups", "3"],
                 ["--workers", "1", "--profile", "tiny-cpu", "--base-port", "0", "--tokenizer", "no/such/folder"]):
        r = subprocess.run([sys.executable, "-m", "workers.cli", "sim-cluster", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.startswith("error:"), (args, r.stderr)
