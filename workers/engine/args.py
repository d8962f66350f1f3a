"""The `engine` subcommand's flags (`python -m workers.cli engine`, `kvroute worker`).

Apart from workers/engine/server.py so that building the worker CLI's parser (and
`--help`) never imports torch.
"""
from __future__ import annotations

import argparse


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The `engine` subcommand's flags (no torch import here: `--help` stays fast)."""
    ap.add_argument("--model", default="default",
                    help="model folder (Hugging Face layout) or `default` (the bundled tiny Llama)")
    ap.add_argument("--port", type=int, required=True, help="HTTP port (0: any free port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--worker-id", default="w0")
    ap.add_argument("--model-id", default=None,
                    help="model id in the key namespace and /info (default: kvroute/tiny-llama or the folder name)")
    ap.add_argument("--revision", default="", help="weight revision in the key namespace")
    ap.add_argument("--served-model-name", action="append", default=None, dest="served_names",
                    help="a name clients may use (repeatable; default: the model id)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    pool = ap.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    pool.add_argument("--kv-bytes", type=float, default=None,
                      help="KV pool size in bytes (default: 85%% of free CUDA memory - 1 GiB, or 512 MiB on CPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once")
    ap.add_argument("--max-waiting", type=int, default=64, help="waiting-queue cap (429 beyond)")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--events-port", type=int, default=None, help="KV-event PUB port (replay: +1; default: any)")
    ap.add_argument("--peer-token", default=None, help="bearer token for /kv/blocks (default $KVROUTE_PEER_TOKEN)")
    ap.add_argument("--cache-dir", default=None,
                    help="where the default model's weights are generated (default $XDG_CACHE_HOME/kvroute)")
    ap.add_argument("--no-calibrate", action="store_true", help="skip the speed calibration at start")
    ap.add_argument("--log-level", default="warning")


def check_arguments(a: argparse.Namespace) -> str | None:
    if not 0 <= a.port <= 65535:
        return "--port out of range"
    if a.events_port is not None and not 1 <= a.events_port <= 65534:
        return "--events-port out of range"
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(a, name) < 1:
            return f"--{name.replace('_', '-')} must be positive"
    if a.max_waiting < 0:
        return "--max-waiting must be >= 0"
    if a.num_blocks is not None and a.num_blocks < 1:
        return "--num-blocks must be positive"
    if a.kv_bytes is not None and a.kv_bytes <= 0:
        return "--kv-bytes must be positive"
    if a.threads is not None and a.threads < 1:
        return "--threads must be positive"
    return None
