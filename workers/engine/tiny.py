"""The default model: the tiny Llama of configs/assets/tiny-llama, its weights made on first use.

Why generated: nothing may be downloaded, and 28 MB of random weights do not belong in
the repository. They come from a fixed seed, so every worker on the same torch version
makes the same model. Why atomic and verified: several workers may start at once on one
machine, and a worker killed mid-write must not leave a file the next one loads. So the
model is written into a private temporary folder, its SHA-256 stored beside it, and the
folder renamed into place in one step; a loader accepts a folder only when the weights
hash to the stored digest, and otherwise sets it aside and makes it again.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "configs" / "assets" / "tiny-llama"
MODEL_ID = "kvroute/tiny-llama"
SERVED_ALIASES = ("tiny",)  # as configs/profiles/tiny-cpu.yaml serves it
SEED = 0
RECIPE = "kvroute/tiny-llama/v1"
WEIGHTS = "model.safetensors"
DIGEST_FILE = "weights.sha256"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class ModelError(RuntimeError):
    """A model folder that cannot be used (missing, damaged, unsupported)."""


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/kvroute`, else `~/.cache/kvroute`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvroute"


def tiny_model_dir(cache_dir: Path | None = None) -> Path:
    """The default model's folder under `cache_dir`, generated if missing or damaged."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tiny-llama-{_recipe_digest()[:16]}"
    if verified(final):
        return final
    if final.exists():
        _set_aside(final)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-tmp-", dir=root))
    try:
        _generate(tmp)
        with contextlib.suppress(OSError):  # another process renamed its copy first: use that one
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not verified(final):
        raise ModelError(f"the default model in {final} fails verification right after generation")
    return final


def verified(folder: Path) -> bool:
    """True when the folder holds the weights its stored digest names (and the tokenizer)."""
    try:
        want = (folder / DIGEST_FILE).read_text().split()[0]
    except (OSError, IndexError):
        return False
    if not all((folder / f).is_file() for f in ("config.json", *TOKENIZER_FILES)):
        return False
    try:
        return sha256_file(folder / WEIGHTS) == want
    except OSError:
        return False


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _recipe_digest() -> str:
    """Names the folder: a changed config, seed or torch version makes a new model."""
    import torch

    h = hashlib.sha256(f"{RECIPE}\0{SEED}\0{torch.__version__}\0".encode())
    h.update((ASSETS / "config.json").read_bytes())
    return h.hexdigest()


def _generate(folder: Path) -> None:
    """Weights from the fixed seed (without touching the caller's RNG), tokenizer files, digest last."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ASSETS, local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = auto.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / name, folder / name)
    weights = folder / WEIGHTS
    _fsync(weights)
    digest = folder / DIGEST_FILE
    digest.write_text(f"{sha256_file(weights)}  {WEIGHTS}\n")
    _fsync(digest)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _set_aside(folder: Path) -> None:
    """Move a damaged folder out of the way (atomically), then delete it."""
    trash = folder.with_name(f".trash-{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, trash)
    except OSError:  # another process moved it already
        return
    shutil.rmtree(trash, ignore_errors=True)
