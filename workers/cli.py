"""Worker command line: `python -m workers.cli sim-cluster ...` (`kvroute sim-cluster` execs it)
and `python -m workers.cli engine ...` (`kvroute worker ...`): one real-engine worker.

    python -m workers.cli sim-cluster --workers N --profile NAME --base-port P
        [--host 127.0.0.1] [--events-base-port Q] [--remote-groups G] [--max-waiting M]
        [--block-size B] [--peer-token T] [--id-prefix w] [--tokenizer DIR]

Runs N simulated workers in this process (one asyncio loop on uvloop, one uvicorn
server with httptools each), prints one line per worker —
`worker w0 url=http://127.0.0.1:9000 events=tcp://127.0.0.1:5600 replay=tcp://... remote_group=rg0`
— then `ready`, and serves until SIGINT/SIGTERM. The peer token for `/kv/blocks`
comes from `--peer-token` or $KVROUTE_PEER_TOKEN (otherwise peer export is off). Text
and chat prompts are tokenized with the profile's tokenizer folder unless `--tokenizer`
names another (use the gateway's folder for the gateway's ids).

    python -m workers.cli engine --model DIR|default --port P [--host H] [--block-size 16]
        [--num-blocks N | --kv-bytes B] [--max-num-batched-tokens T] [--max-num-seqs S]
        [--max-waiting M] [--device cpu|cuda] [--dtype auto|float32|bfloat16|float16]
        [--events-port Q] [--worker-id ID] [--peer-token T] [--cache-dir DIR] ...

Loads a causal LM (the bundled tiny Llama by default, its weights generated on first
use) and serves it with the real engine (workers/engine, docs/engine.md), printing the
same ready line as sim-cluster, then `ready`. Imports torch only for this command.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from workers.sim.profile import ProfileError, load_profile
from workers.tokenizer import TokenizerError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="workers.cli", description="kvroute worker tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sc = sub.add_parser("sim-cluster", help="run N simulated workers in one process")
    sc.add_argument("--workers", type=int, required=True, help="number of workers (1-512)")
    sc.add_argument("--profile", required=True, help="profile name in configs/profiles or a YAML path")
    sc.add_argument("--base-port", type=int, required=True, help="HTTP port of worker 0 (worker i: +i; 0 = any free)")
    sc.add_argument("--host", default="127.0.0.1")
    sc.add_argument("--events-base-port", type=int, default=None,
                    help="PUB port of worker 0 (worker i: +2i, replay +2i+1)")
    sc.add_argument("--remote-groups", type=int, default=0, help="workers split into G groups sharing a REMOTE store")
    sc.add_argument("--max-waiting", type=int, default=None, help="waiting-queue cap per worker (429 beyond)")
    sc.add_argument("--block-size", type=int, default=None, help="override the profile's KV block size")
    sc.add_argument("--peer-token", default=None, help="bearer token for /kv/blocks (default $KVROUTE_PEER_TOKEN)")
    sc.add_argument("--id-prefix", default="w", help="worker ids are PREFIX0..PREFIX{N-1}")
    sc.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="Hugging Face tokenizer folder for text and chat prompts (default: the profile's)")
    sc.add_argument("--arrival-log", default=None, metavar="FILE",
                    help="append `monotonic_s worker request_id prompt_tokens` per accepted request "
                         "(to measure the HTTP path: bench/transport_probe.py)")
    sc.add_argument("--log-level", default="warning")
    from workers.engine.args import add_arguments  # torch-free

    add_arguments(sub.add_parser("engine", help="one real-engine worker (torch)"))
    return ap


def _check(args: argparse.Namespace) -> str | None:
    if not 1 <= args.workers <= 512:
        return "--workers must be between 1 and 512"
    if not 0 <= args.base_port <= 65535 or args.base_port + args.workers - 1 > 65535:
        return "--base-port out of range"
    if args.events_base_port is not None and not (1 <= args.events_base_port <= 65535 - 2 * args.workers):
        return "--events-base-port out of range"
    if not 0 <= args.remote_groups <= args.workers:
        return "--remote-groups must be between 0 and --workers"
    if args.max_waiting is not None and args.max_waiting < 0:
        return "--max-waiting must be >= 0"
    if args.block_size is not None and args.block_size <= 0:
        return "--block-size must be positive"
    return None


async def _sim_cluster(args: argparse.Namespace) -> int:
    from workers.cluster import SimCluster

    try:
        profile = load_profile(args.profile)
        cluster = SimCluster(
            args.workers,
            profile,
            host=args.host,
            base_port=args.base_port,
            events_base_port=args.events_base_port,
            remote_groups=args.remote_groups,
            max_waiting=args.max_waiting,
            block_size=args.block_size,
            peer_token=args.peer_token or os.environ.get("KVROUTE_PEER_TOKEN") or None,
            id_prefix=args.id_prefix,
            arrival_log=args.arrival_log,
            tokenizer=args.tokenizer,
        )
    except (ProfileError, TokenizerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        handles = await cluster.start()
    except OSError as e:
        print(f"error: cannot start the cluster: {e}", file=sys.stderr)
        return 1
    for h in handles:
        print(h.ready_line(), flush=True)
    print("ready", flush=True)
    await stop.wait()
    await cluster.stop()
    return 0


def _engine(args: argparse.Namespace) -> int:
    from workers.engine.args import check_arguments

    err = check_arguments(args)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Before transformers is imported (it reads the variable then); every load is also local_files_only.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from workers.engine.server import serve

    with asyncio.Runner() as runner:
        return runner.run(serve(args))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "sim-cluster":
        err = _check(args)
        if err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
            factory = None
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(_sim_cluster(args))
    if args.cmd == "engine":
        return _engine(args)
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
