"""The `engine` subcommand's flags (`python -m workers.cli engine`, `kvroute worker`).

Apart from workers/engine/server.py so that building the worker CLI's parser (and
`--help`) never imports torch.
"""
from __future__ import annotations

import argparse
import re

# A LoRA adapter name (`--lora NAME=DIR`): the model id clients ask for.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


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
    ap.add_argument("--lora", action="append", default=None, metavar="NAME=DIR", dest="loras",
                    help="serve the LoRA adapter in DIR (peft's format) as model NAME (repeatable)")
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
    ap.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                    help="prefill/decode disaggregation: what this worker is for (in /info; default both)")
    ap.add_argument("--pd-pin-s", type=float, default=30.0,
                    help="how long a prefill for a remote decode keeps the prompt's blocks pinned (default 30 s)")
    ap.add_argument("--no-calibrate", action="store_true", help="skip the speed calibration at start")
    ap.add_argument("--log-level", default="warning")
    t = ap.add_argument_group("KV tiers below the pool (docs/engine.md § Tiers)")
    t.add_argument("--cpu-bytes", type=float, default=None,
                   help="CPU DRAM tier size in bytes (pinned when on CUDA; default: none, or 1 GiB "
                        "when --disk-dir or --remote-url is given)")
    t.add_argument("--disk-dir", default=None, help="DISK tier directory (log-structured segments)")
    t.add_argument("--disk-bytes", type=float, default=10 * 2**30, help="DISK tier capacity (default 10 GiB)")
    t.add_argument("--disk-segment-bytes", type=float, default=64 * 2**20, help="DISK segment size (default 64 MiB)")
    t.add_argument("--disk-admit-after", type=int, default=2,
                   help="write a block to DISK on its N-th offload within 10 min (default 2; 1: always)")
    t.add_argument("--disk-write-bytes-per-s", type=float, default=None, help="DISK write budget (SSD endurance)")
    t.add_argument("--disk-fsync", default="close", choices=["never", "close", "segment", "record"])
    t.add_argument("--remote-url", default=None,
                   help="REMOTE tier: redis://[:password@]host:port[/db] (Redis >= 6.2 or Valkey)")
    t.add_argument("--remote-group", default="default",
                   help="workers sharing REMOTE blocks (same model deployment); in /info and the ready line")
    t.add_argument("--remote-ttl", type=float, default=3600.0, help="REMOTE block TTL in s, renewed on hits")
    t.add_argument("--remote-write", default="gpu-evict", choices=["gpu-evict", "cpu-evict"],
                   help="write to REMOTE as a block leaves GPU (default) or as it leaves CPU")
    t.add_argument("--prefetch-queue", type=int, default=16, help="prefetches in flight at most (429 beyond)")


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
    if a.cpu_bytes is not None and a.cpu_bytes < 0:
        return "--cpu-bytes must be >= 0"
    if a.cpu_bytes == 0 and (a.disk_dir or a.remote_url):
        return "--disk-dir and --remote-url need a CPU tier (--cpu-bytes > 0): it stages their writes"
    if a.disk_dir and (a.disk_bytes < 2 * a.disk_segment_bytes or a.disk_segment_bytes <= 0):
        return "--disk-bytes must be at least twice --disk-segment-bytes"
    if a.disk_admit_after < 1:
        return "--disk-admit-after must be >= 1"
    if a.remote_url and not a.remote_url.startswith(("redis://", "rediss://")):
        return "--remote-url must be redis://host:port[/db] or rediss://..."
    if not a.pd_pin_s > 0:
        return "--pd-pin-s must be positive"
    if a.prefetch_queue < 0:
        return "--prefetch-queue must be >= 0"
    seen: set[str] = set()
    for value in getattr(a, "loras", None) or ():
        try:
            name, _ = parse_lora_flag(value)
        except ValueError as e:
            return str(e)
        if name in seen:
            return f"--lora {name} is given twice"
        seen.add(name)
    return None


def parse_lora_flag(value: str) -> tuple[str, str]:
    """`NAME=DIR` of `--lora` as (name, folder); ValueError when malformed."""
    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise ValueError(f"--lora takes NAME=DIR, got {value!r}")
    if not ADAPTER_NAME.match(name):
        raise ValueError(f"bad LoRA adapter name {name!r}: letters, digits and ._:/@+- only")
    return name, folder
