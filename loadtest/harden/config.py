"""The fleet the suite runs: a simulated-worker profile sized for a 2-core machine, the
gateway config around it, and the namespace digest a faulty worker must report.

The model is the bundled tiny Llama's (`kvroute/tiny-llama`, served as `tiny`, the
bundled tokenizer); the profile is `tiny-cpu` with a small scheduler (so a burst is
several times what the fleet holds) and fast decode steps (so long answers cost
little wall time). Everything is written into the run's folder.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from .procs import REPO

MODEL = "kvroute/tiny-llama"
SERVED = "tiny"
TOKENIZER = REPO / "configs" / "assets" / "tiny-tokenizer"

# Short upstream timeouts for the `small` run (a hanging worker costs seconds, not
# minutes). Applied only to the fields this gateway's config has; `full` runs with
# the gateway's own defaults. The report says which were applied.
SMALL_TIMEOUTS: dict[str, float] = {"first_byte_min_s": 3.0, "idle_timeout_s": 3.0}


DECODE_BASE_S = 0.002  # the suite's decode step: short answers cost little wall time


def write_profile(folder: Path, *, max_num_seqs: int = 8, max_waiting: int = 8, decode_base_s: float = DECODE_BASE_S,
                  name: str = "harden") -> Path:
    """tiny-cpu with a small scheduler: capacity per worker = max_num_seqs + max_waiting."""
    data = yaml.safe_load((REPO / "configs" / "profiles" / "tiny-cpu.yaml").read_text())
    data["name"] = name
    data["scheduler"]["max_num_seqs"] = max_num_seqs
    data["scheduler"]["max_waiting"] = max_waiting
    # decode fixed here (the profile's calibration may change): short answers cost little wall time
    data["compute"]["decode_base_s"] = decode_base_s
    data["compute"]["decode_per_seq_s"] = 0.0002
    data["compute"]["decode_per_ctx_token_s"] = 4.0e-8
    path = folder / f"{name}-profile.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def namespace_digest(profile: Path | str) -> str:
    """The digest our workers of this profile put in /info (the gateway checks it)."""
    from workers.sim.profile import load_profile

    return load_profile(str(profile)).namespace().digest.hex()


def gateway_config(profile: Path, workers: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    """A gateway config for the tiny model; `sections` replace or extend the defaults
    (`pool={...}` is merged into the pool section, others replace theirs)."""
    cfg: dict[str, Any] = {
        "models": [{"id": MODEL, "served_names": [SERVED], "tokenizer": str(TOKENIZER), "profile": str(profile)}],
        "workers": workers,
        "routing": {"policy": "kv_cost"},
        "observability": {"log_level": "WARNING"},
        "pool": {},
    }
    for k, v in sections.items():
        if k == "pool":
            cfg["pool"].update(v)
        else:
            cfg[k] = v
    if not cfg["pool"]:
        del cfg["pool"]
    return cfg


def kvroute_worker(wid: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"id": wid, "url": url, "kind": "kvroute", **extra}


def pool_fields(python: str, code_root: Path) -> list[str]:
    """The `pool` fields of the gateway's config schema in `code_root` (asked in a child:
    the suite never imports the gateway)."""
    code = "import json; from router.config import PoolConfig; print(json.dumps(sorted(PoolConfig.model_fields)))"
    try:
        r = subprocess.run([python, "-c", code], cwd=str(code_root), capture_output=True, text=True, timeout=60)
        out: list[str] = json.loads(r.stdout.strip().splitlines()[-1])
        return out
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return []
