"""The suite's one table, its JSON report, and the exit status."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .outcome import ANSWERED, HUNG, LOST, REFUSED, RELAYED, S5XX, WRONG, CaseResult

HEAD = ("case", "sent", "answered", "refused", "5xx relayed", "5xx", "hung", "lost", "wrong", "checks",
        "rss max/end MiB", "ready s", "s", "verdict")


def _row(r: CaseResult) -> list[str]:
    c = r.counts
    failed = len(r.failed_checks)
    checks = "-" if not r.checks else ("ok" if not failed else f"{failed}/{len(r.checks)} failed")
    rss = f"{r.rss_mb['max']:.0f}/{r.rss_mb['end']:.0f}" if r.rss_mb else "-"
    ready = f"{max(r.ready_s):.1f}" if r.ready_s else "-"
    return [r.name, str(r.sent), str(c[ANSWERED]), str(c[REFUSED]), str(c[RELAYED]), str(c[S5XX]), str(c[HUNG]),
            str(c[LOST]), str(c[WRONG]), checks, rss, ready, f"{r.seconds:.0f}", r.verdict]


def table(results: list[CaseResult]) -> str:
    rows = [list(HEAD)] + [_row(r) for r in results]
    tot = CaseResult("TOTAL")
    for r in results:
        for k, v in r.counts.items():
            tot.counts[k] = tot.counts.get(k, 0) + v
    bad = sum(r.verdict in ("FAIL", "ERROR") for r in results)
    total = _row(tot)
    total[9] = str(sum(len(r.failed_checks) for r in results)) + " failed"
    total[10] = ""
    total[11] = ""
    total[12] = f"{sum(r.seconds for r in results):.0f}"
    total[13] = f"{bad} failing"
    rows.append(total)
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEAD))]

    def fmt(row: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths,
                                                                                                       strict=True)))

    sep = "  ".join("-" * w for w in widths)
    lines = [fmt(rows[0]), sep] + [fmt(r) for r in rows[1:-1]] + [sep, fmt(rows[-1])]
    return "\n".join(lines)


def details(results: list[CaseResult]) -> str:
    """Why each failing case fails: failed checks, a few samples per bad column, errors."""
    out: list[str] = []
    for r in results:
        if r.verdict == "PASS":
            continue
        out.append(f"{r.name}: {r.verdict}" + (f" — {r.skipped}" if r.skipped else ""))
        if r.error:
            out.append(f"  error: {r.error.splitlines()[0][:400]}")
        for ck in r.failed_checks:
            out.append(f"  {'timing check' if ck.timing else 'check'} failed: {ck.name}: {ck.detail}")
        for cat in (S5XX, HUNG, LOST, WRONG):
            for s in r.samples.get(cat, [])[:3]:
                out.append(f"  {cat}: [{s['label'] or '-'}] {s['why'][:300]}")
        for n in r.notes[:4]:
            out.append(f"  note: {n[:300]}")
    return "\n".join(out)


def exit_status(results: list[CaseResult]) -> int:
    return 1 if any(r.verdict in ("FAIL", "ERROR") for r in results) else 0


def write(results: list[CaseResult], out: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js = out / "report.json"
    js.write_text(json.dumps({"meta": meta, "cases": [r.to_dict() for r in results],
                              "exit_status": exit_status(results)}, indent=2))
    md = out / "report.md"
    md.write_text("# kvroute harden\n\n" + "\n".join(f"- {m}" for m in meta.get("lines", [])) + "\n\n```\n"
                  + table(results) + "\n```\n\n```\n" + details(results) + "\n```\n")
    return js, md
