"""`kvroute loadtest harden [--size small|full] [--cases a,b] [--out DIR]` (also
`python -m loadtest.harden`): run the cases, print the table, write report.json and
report.md into the output folder. Exit status 0 when every case passed, 1 when any
request hung, was lost or answered wrongly, a 5xx was not a relayed worker failure, a
check failed or a case could not run; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..cliargs import out_dir
from . import report
from .outcome import CaseResult
from .runner import CASES, SIZES, Settings, env_summary, run_suite


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=SIZES, default="small",
                   help="small: every case, a few minutes (CI); full: the sizes docs/harden.md reports")
    p.add_argument("--cases", default=None, help="comma list of cases to run (default: all); `list` lists them")
    p.add_argument("--skip", default=None, help="comma list of cases not to run")
    p.add_argument("--out", default=None, help="output folder, new or empty (default: a new kvroute-harden-* "
                                               "folder in the system's temporary directory)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the gateway and workers")
    p.add_argument("--code-root", default=None,
                   help="run the gateway and workers from this checkout (default: this one)")
    p.add_argument("--quiet", action="store_true", help="no line per case while running")


def selected(args: argparse.Namespace) -> list[str]:
    from . import cases  # noqa: F401  (registers them)

    names = list(CASES)
    if args.cases:
        want = [c.strip() for c in args.cases.split(",") if c.strip()]
        bad = [c for c in want if c not in CASES]
        if bad:
            raise ValueError(f"unknown case {', '.join(bad)}; known: {', '.join(CASES)}")
        names = want
    if args.skip:
        skip = {c.strip() for c in args.skip.split(",") if c.strip()}
        bad = sorted(skip - set(CASES))
        if bad:
            raise ValueError(f"unknown case {', '.join(bad)}; known: {', '.join(CASES)}")
        names = [n for n in names if n not in skip]
    return names


def run(args: argparse.Namespace) -> int:
    from . import cases  # noqa: F401

    if args.cases == "list":
        for n, c in CASES.items():
            print(f"{n:<26} {c.summary}")
        return 0
    try:
        names = selected(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        out = out_dir(args.out, "harden")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = Settings(size=args.size, out=out, python=args.python,
                  code_root=Path(args.code_root).resolve() if args.code_root else Settings().code_root)
    t0 = time.monotonic()

    def progress(r: CaseResult) -> None:
        if not args.quiet:
            c = r.counts
            print(f"  {r.name:<26} {r.verdict:<5} {r.seconds:5.1f} s  sent {r.sent:<5} ok {c['answered']:<5} "
                  f"refused {c['refused']:<4} 5xx {c['5xx_relayed']}+{c['5xx']} hung {c['hung']} lost {c['lost']} "
                  f"wrong {c['wrong']}" + (f"  checks failed {len(r.failed_checks)}" if r.failed_checks else "")
                  + (f"  ({(r.error or r.skipped or '').splitlines()[0][:120]})" if r.error or r.skipped else ""),
                  flush=True)

    if not args.quiet:
        print(f"kvroute harden: {len(names)} cases, size {args.size}, output {out}", flush=True)
    results = run_suite(names, st, progress)
    wall = time.monotonic() - t0
    lines = env_summary(st) + [f"wall time {wall:.0f} s"]
    print()
    for ln in lines:
        print(ln)
    print()
    print(report.table(results))
    det = report.details(results)
    if det:
        print()
        print(det)
    js, md = report.write(results, out, {"size": args.size, "cases": names, "wall_s": round(wall, 1),
                                         "lines": lines})
    print(f"\nreport: {js}\n        {md}")
    return report.exit_status(results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvroute loadtest harden", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    try:
        return run(ap.parse_args(argv))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
