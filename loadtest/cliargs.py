"""What the loadtest commands share: trace options and loading, output folders, --param values.

Split from cli.py so that each command's module reads only its own logic.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from .trace import Trace, TraceError


def out_dir(arg: str | None, what: str) -> Path:
    """The folder a command writes its results and report into, created and empty.

    Without --out: a new folder under the system's temporary directory
    (`kvroute-<what>-<time>-<random>`), never one inside the working directory. With --out:
    that folder, created when missing; one that already holds anything is refused
    (ValueError, exit 2), since a second run would be appended to its results.jsonl and its
    report rewritten over the first run's."""
    if not arg:
        return Path(tempfile.mkdtemp(prefix=f"kvroute-{what}-{time.strftime('%Y%m%d-%H%M%S')}-"))
    p = Path(arg)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {p}: exists and is not a folder")
    if p.is_dir() and any(p.iterdir()):
        raise ValueError(f"--out {p}: the folder is not empty (an earlier run?); name a new or empty folder, "
                         "or remove it first")
    p.mkdir(parents=True, exist_ok=True)
    return p


def _value(s: str) -> Any:
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


def policy_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """`--param kv_cost.balance_eps=0.2` → {"kv_cost": {"balance_eps": 0.2}}."""
    out: dict[str, dict[str, Any]] = {}
    for it in items:
        key, sep, val = it.partition("=")
        pol, dot, name = key.partition(".")
        if not sep or not dot or not pol or not name:
            raise TraceError(f"--param {it!r}: expected POLICY.NAME=VALUE")
        out.setdefault(pol, {})[name] = _value(val)
    return out


def positive_float(s: str) -> float:
    """An argparse type: a finite number above 0 (a rate factor divides arrival times)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not math.isfinite(v) or v <= 0.0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {s}")
    return v


def pd_split(s: str) -> tuple[int, int]:
    """`P:D` (prefill and decode workers), each at least 1."""
    parts = s.split(":")
    try:
        p, d = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D (prefill:decode workers), got {s!r}") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"P:D needs at least one worker of each role, got {s!r}")
    return p, d


def judge_fraction(s: str) -> float:
    """An argparse type: the share of a run's arrival span fitted on before the judged part
    starts (loadtest/holdout.py), strictly between 0 and 1."""
    from .holdout import check_fraction

    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    try:
        return check_fraction(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_judge_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--judge-from", type=judge_fraction, default=None, metavar="F",
                   help="held-out evaluation: report each run's requests arriving in the first F of its arrival "
                        "span (fit) and the rest (judged) apart, in the tables and holdout.json (e.g. 0.6)")


def add_trace_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--trace", required=required, help="trace file (Mooncake JSONL, Azure CSV, BurstGPT CSV)")
    g.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure", "burstgpt"])
    g.add_argument("--block-tokens", type=int, default=512, help="Mooncake file's block size (default 512)")
    g.add_argument("--start", type=float, default=0.0, help="skip arrivals before this many trace seconds")
    g.add_argument("--duration", type=float, default=None,
                   help="bound the run: keep the arrivals of its first S seconds (after --speed)")
    g.add_argument("--limit", type=int, default=None, help="keep at most this many requests")
    g.add_argument("--speed", type=positive_float, default=1.0, help="arrival-rate factor (2 = twice as fast)")
    g.add_argument("--vocab-size", type=int, default=8192, help="synthesised token ids lie below this")
    g.add_argument("--seed", type=int, default=0, help="token synthesis and sharing-model seed")
    s = p.add_argument_group("prefix-sharing model for traces without prefixes (loadtest/sharing.py)")
    s.add_argument("--sharing", choices=["model", "none"], default="model")
    s.add_argument("--followup-prob", type=float, default=0.3)
    s.add_argument("--system-prob", type=float, default=0.6)
    s.add_argument("--system-prompts", type=int, default=8)
    s.add_argument("--system-tokens", type=int, default=768, help="median system-prompt length")
    s.add_argument("--session-idle", type=float, default=900.0)
    s.add_argument("--burst-model", default=None, help="BurstGPT: keep only this Model")
    s.add_argument("--burst-log-type", default=None, help='BurstGPT: keep only this Log Type ("Conversation log")')


def load_trace(args: argparse.Namespace) -> Trace:
    from .sharing import SharingModel
    from .traces import load_trace

    sharing = None
    if args.sharing == "model":
        sharing = SharingModel(
            seed=args.seed, followup_prob=args.followup_prob, system_prob=args.system_prob,
            system_prompts=args.system_prompts, system_tokens_median=args.system_tokens,
            session_idle_s=args.session_idle,
        )
    trace = load_trace(args.trace, args.format, block_tokens=args.block_tokens, sharing=sharing,
                       model=args.burst_model, log_type=args.burst_log_type)
    if args.start or args.duration is not None or args.limit is not None:
        span = args.duration * args.speed if args.duration is not None else None
        trace = trace.window(args.start, span, args.limit)
    if not trace.requests:
        raise TraceError("the selected window of the trace has no requests")
    trace.validate()
    return trace


def trace_notes(trace: Trace, speed: float) -> list[str]:
    st = trace.stats()
    notes = [
        f"trace {trace.name} ({trace.source or 'in memory'}): {st.requests} requests over {st.span_s:.0f} s "
        f"({st.rate_rps:.2f} req/s at speed 1), input p50 {st.input_p50:.0f} / p99 {st.input_p99:.0f} tokens, "
        f"ideal prefix reuse {st.ideal_token_reuse:.1%} of tokens",
        f"speed factor {speed:g} (arrival times divided by it)",
    ]
    notes += trace.notes
    return notes


def delay(text: str) -> tuple[float, float]:
    """`0.003` or `0.003,1e-7`: a fixed delay and an optional per-token one, both >= 0."""
    parts = text.split(",")
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected S or S,S_PER_TOKEN (seconds), got {text!r}") from None
    if len(vals) > 2 or not all(math.isfinite(v) and v >= 0.0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected one or two finite non-negative numbers, got {text!r}")
    return (vals[0], vals[1] if len(vals) > 1 else 0.0)
