"""The default model's weights (generated from a fixed seed, written atomically, verified
by SHA-256 on every load) and the worker command line (`python -m workers.cli engine`,
`kvroute worker`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from workers.engine.tiny import DIGEST_FILE, WEIGHTS, tiny_model_dir, verified

ROOT = Path(__file__).resolve().parents[2]


def digest_of(folder: Path) -> str:
    return (folder / DIGEST_FILE).read_text().split()[0]


def test_weights_are_generated_once_verified_and_repaired(tmp_path: Path) -> None:
    d = tiny_model_dir(tmp_path)
    assert verified(d) and {"config.json", "tokenizer.json", "chat_template.jinja", WEIGHTS} <= {
        p.name for p in d.iterdir()}
    first, mtime = digest_of(d), (d / WEIGHTS).stat().st_mtime_ns
    assert tiny_model_dir(tmp_path) == d and (d / WEIGHTS).stat().st_mtime_ns == mtime  # reused as is
    with open(d / WEIGHTS, "r+b") as f:  # a truncated file is never loaded: it is made again
        f.truncate(4096)
    assert not verified(d)
    assert tiny_model_dir(tmp_path) == d and verified(d)
    assert digest_of(d) == first  # same seed, same weights
    assert [p.name for p in tmp_path.iterdir()] == [d.name]  # no temporary or set-aside folder left


def test_worker_parser_does_not_import_torch() -> None:
    code = ("import sys, workers.cli, kvroute.cli; workers.cli._parser(); kvroute.cli.build_parser(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.slow
def test_racing_processes_agree_on_one_folder(tmp_path: Path) -> None:
    code = "import sys; from pathlib import Path; from workers.engine.tiny import tiny_model_dir; " \
           "print(tiny_model_dir(Path(sys.argv[1])))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1000:] for _, e in outs]
    folders = {o.strip() for o, _ in outs}
    assert len(folders) == 1 and verified(Path(folders.pop()))
    assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.slow
def test_kvroute_worker_serves_until_sigint(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvroute.cli", "worker", "--port", "0", "--cache-dir", str(tmp_path),
           "--threads", "1", "--num-blocks", "64", "--no-calibrate", "--worker-id", "e0"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:2] == ["worker", "e0"] and proc.stdout.readline().strip() == "ready"
        fields = dict(w.split("=", 1) for w in line[2:])
        assert fields["events"].startswith("tcp://") and fields["replay"].startswith("tcp://")
        body = json.dumps({"prompt": "Hello", "max_tokens": 3}).encode()
        req = urllib.request.Request(fields["url"] + "/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
