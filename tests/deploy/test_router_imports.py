"""The gateway never imports torch or workers (docs/design.md §3), checked in a fresh interpreter."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_router_never_imports_torch_or_workers() -> None:
    code = """
import sys
import kvroute.cli, router.api.app, router.gateway, router.fleet.pool, router.upstream.proxy, router.server
import router.intake.tokenize, router.telemetry.recorder, router.intake.tenancy, router.fleet.ingest_adapter
import router.config, router.telemetry.metrics
from router.config import load_config
from router.gateway import Gateway
import asyncio
async def built():
    gw = await Gateway.create(load_config('configs/default.yaml', environ={}))
    await gw.close()
    return gw
gw = asyncio.run(built())
rt = next(iter(gw.models.by_id.values()))
ids = rt.tokenizer.encode_text(rt.tokenizer.render_chat([{'role': 'user', 'content': 'hello'}]), False)
rt.key_plan(ids, '', None)
bad = sorted(m for m in sys.modules
             if m == 'torch' or m.startswith('torch.') or m == 'workers' or m.startswith('workers.')
             or m.startswith('loadtest'))
assert not bad, bad
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_real_engine_never_imports_the_simulator() -> None:
    """DESIGN §3: both engines stand on neutral modules (workers/blockmeta.py,
    workers/tokenizer.py); workers/engine imports nothing of workers/sim, read from the source."""
    import ast

    bad = []
    for path in sorted((ROOT / "workers" / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n == "workers.sim" or n.startswith("workers.sim.")]
    assert not bad, bad
