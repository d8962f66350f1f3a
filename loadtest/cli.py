"""`python -m loadtest.cli` (also `kvroute loadtest ...`): replay, simulate, scenario,
report, compare, trace.

    replay    --trace FILE [--url http://127.0.0.1:8000] [--speed X] [--concurrency N] ...
    simulate  --trace FILE --workers N --profile NAME --policies a,b,... [--tiers T | --tier-sweep]
              [--target-util U | --find-load] [--judge-from F] ...
    scenario  list | all | NAME [--size small|full]
    harden    [--size small|full] [--cases a,b | list] [--out DIR]   (adversarial suite, docs/harden.md)
    report    RESULTS.jsonl... --out DIR [--judge-from F]
    compare   --trace FILE --policies a,b [--limit N]   (offline simulator vs HTTP replay)
    trace     stats --trace FILE | convert --trace FILE --to OUT.jsonl
    calibrate --url URL --out PROFILE.yaml [--base-profile tiny-cpu]   (a real worker -> a simulator profile)

Every command writes results as JSONL plus a Markdown report with PNG plots into
`--out`, a new or empty folder (default: a new kvroute-<command>-<time>-* folder in the
system's temporary directory), prints the main table and where the files went. Exit status:
0 = done (for `scenario`: every check passed), 1 = a check failed, 2 = bad input.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .cliargs import (
    add_judge_arg,
    add_trace_args,
    delay,
    load_trace,
    out_dir,
    pd_split,
    policy_params,
    positive_float,
    trace_notes,
)
from .trace import TraceError

OUT_HELP = ("a new or empty folder for the results and report (one holding anything is refused); "
            "default: a new folder in the system's temporary directory")

# ------------------------------------------------------------------ replay


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import ReplayConfig, run_replay
    from .report import latency_table, write_report
    from .results import ResultsWriter, read_runs
    from .summary import summarize
    from .tokens import TokenSynth

    trace = load_trace(args)
    synth = TokenSynth.for_trace(trace, vocab_size=args.vocab_size, seed=args.seed)
    cfg = ReplayConfig(
        url=args.url, endpoint=args.endpoint, model=args.model, speed=args.speed, concurrency=args.concurrency,
        duration_s=args.duration, request_timeout_s=args.timeout, api_key=args.api_key,
        ignore_eos=not args.no_ignore_eos, progress=not args.no_progress and sys.stderr.isatty(),
    )
    out = out_dir(args.out, "replay")
    res_path = out / "results.jsonl"
    label = args.label or f"replay@{cfg.base.split('//', 1)[-1]}"
    with ResultsWriter(res_path) as w:
        run_replay(trace, synth, cfg, label=label, writer=w,
                   meta_extra={"policy": args.policy_label, "workers": args.workers_label})
    runs = read_runs(res_path)
    md = write_report(runs, out, title=f"Replay of {trace.name}", notes=trace_notes(trace, args.speed))
    print(latency_table([summarize(r) for r in runs]))
    print(f"\nresults: {res_path}\nreport:  {md}")
    return 0


# ------------------------------------------------------------------ simulate


def _sim_settings(args: argparse.Namespace, tiers: str) -> Any:
    from .fleet import FleetSpec
    from .simulate import SimSettings

    return SimSettings(
        fleet=FleetSpec(workers=sum(args.pd) if args.pd else args.workers, profile=args.profile, tiers=tiers,
                        block_size=args.block_size, remote_groups=args.remote_groups, max_waiting=args.max_waiting,
                        pd=args.pd, pd_link_Bps=args.pd_link_gbps * 1e9 if args.pd_link_gbps else None,
                        dp=args.dp, dp_routing=args.dp_routing),
        router=_router_settings(args),
        speed=args.speed,
        vocab_size=args.vocab_size,
        seed=args.seed,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
    )


def _router_settings(args: argparse.Namespace) -> Any:
    """`--transport` first, then any explicit `--route-delay` / `--send-delay` over it."""
    from dataclasses import replace

    from .router_model import RouterSettings

    rs = RouterSettings(poll_interval_s=args.poll_interval, event_lag_s=args.event_lag,
                        prefetch=not args.no_prefetch).with_transport(args.transport, args.transport_seed)
    if args.route_delay is not None:
        rs = replace(rs, route_delay_s=args.route_delay[0], route_delay_s_per_token=args.route_delay[1])
    if args.send_delay is not None:
        rs = replace(rs, send_delay_s=args.send_delay[0], send_delay_s_per_token=args.send_delay[1])
    return replace(rs, gateway_order=args.gateway_order, hold_target_s=args.hold_target, max_hold_s=args.max_hold)


def _holdout(runs: list[Any], judge_from: float | None, out: Path, notes: list[str]) -> list[Any]:
    """With --judge-from: both parts of every run (loadtest/holdout.py), written to
    holdout.json in `out`, and a note saying where the judged part starts."""
    from .holdout import holdout_summaries, judge_cut_s, write_holdout

    if judge_from is None or not runs:
        return []
    parts = holdout_summaries(runs, judge_from)
    path = write_holdout(parts, judge_from, out / "holdout.json")
    notes.append(f"held-out split: fit = arrivals before {judge_from:.0%} of the arrival span "
                 f"({judge_cut_s(runs[0], judge_from):.1f} s), judged = the rest ({path.name})")
    return parts


def cmd_simulate(args: argparse.Namespace) -> int:
    from router.planner.registry import POLICY_NAMES

    from .fleet import TIER_SWEEP, parse_tiers
    from .report import (
        baseline_table,
        cache_table,
        holdout_table,
        latency_table,
        prediction_table,
        serving_table,
        slowdown_table,
        summaries,
        write_report,
    )
    from .results import ResultsWriter
    from .summary import ideal_by_index, summarize
    from .sweep import find_load, find_util_speed, ideal_for, plan_jobs, run_matrix

    trace = load_trace(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad or not policies:
        raise TraceError(f"unknown policy {bad or args.policies!r}; choose from {', '.join(POLICY_NAMES)}")
    if args.load_policy not in POLICY_NAMES:
        raise TraceError(f"unknown --load-policy {args.load_policy!r}; choose from {', '.join(POLICY_NAMES)}")
    if args.pd:
        args.workers = sum(args.pd)
        agg = [p for p in policies if not p.startswith("pd_")]
        if agg:
            raise TraceError(f"--pd builds a disaggregated fleet: only the pair policies (pd_cost, pd_round_robin, "
                             f"pd_prefix) route it, not {', '.join(agg)}")
    tier_sets = list(TIER_SWEEP) if args.tier_sweep else [args.tiers]
    for t in tier_sets:
        parse_tiers(t)
    params = policy_params(args.param)
    out = out_dir(args.out, "simulate")
    notes: list[str] = []
    speed = args.speed
    if args.target_util is not None:
        if args.find_load:
            raise TraceError("--target-util and --find-load are exclusive")
        base = _sim_settings(args, tier_sets[-1])

        def show(pr: Any) -> None:
            line = (f"load search: {args.load_policy} at speed {pr.speed:.4g}: utilisation {pr.utilisation:.1%}, "
                    f"TTFT p50 {pr.p50 * 1000:.0f} ms, p99 {pr.p99 * 1000:.0f} ms")
            print(line, flush=True)
            notes.append(line)

        speed, _probes = find_util_speed(trace, base, args.target_util, policy=args.load_policy,
                                         params=params.get(args.load_policy), on_probe=show)
        notes.append(f"chosen speed {speed:.4g}: {args.load_policy} keeps the fleet's prefill busy fraction near "
                     f"{args.target_util:.0%}")
    elif args.find_load:
        base = _sim_settings(args, tier_sets[-1])
        found, probes = find_load(trace, base, ratio=args.target_ratio)
        for pr in probes:
            line = (f"load search: round_robin at speed {pr.speed:g}: TTFT p50 {pr.p50 * 1000:.0f} ms, "
                    f"p99 {pr.p99 * 1000:.0f} ms, p99/p50 = {pr.ratio:.1f}")
            print(line)
            notes.append(line)
        if found is None:
            print(f"no speed on the ladder gives p99/p50 >= {args.target_ratio}; using --speed {speed:g}")
        else:
            speed = found
            notes.append(f"chosen speed {speed:g}: the first on the ladder where round_robin's p99 TTFT >= "
                         f"{args.target_ratio:g}x its p50")
    args.speed = speed
    jobs = plan_jobs(policies, tier_sets, params)
    res_path = out / "results.jsonl"
    with ResultsWriter(res_path) as w:
        ideal = None
        if not args.no_ideal:
            ideal = ideal_for(trace, _sim_settings(args, tier_sets[0]))
            w.write_run(ideal.meta, ideal.results)
        ideal_map = ideal_by_index(ideal) if ideal is not None else None

        def done(run: Any) -> None:
            w.write_run(run.meta, run.results)
            s = summarize(run, ideal_map)
            slow = f"  slowdown p99 {s.slowdown['p99']:.2f}" if s.slowdown else ""
            print(f"  {run.meta.run:<28} TTFT p50 {s.ttft['p50'] * 1000:8.1f} ms  p99 {s.ttft['p99'] * 1000:9.1f} ms"
                  f"  mean {s.ttft['mean'] * 1000:8.1f} ms{slow}  util {s.utilisation:.1%}  ok {s.ok}/{s.requests}"
                  f"  ({run.meta.wall_s:.1f} s wall)", flush=True)

        runs = run_matrix(trace, _sim_settings(args, tier_sets[0]), jobs, parallel=args.jobs, on_run=done)
        if ideal is not None:
            runs = [ideal, *runs]
    sums = summaries(runs)
    notes = trace_notes(trace, speed) + [
        f"fleet: {args.workers} x {args.profile}"
        + (f" ({args.pd[0]} prefill + {args.pd[1]} decode)" if args.pd else "")
        + f", block size {runs[-1].meta.params.get('block_size')}, "
        f"load poll {args.poll_interval:g} s, event lag {args.event_lag:g} s, prefetch "
        f"{'off' if args.no_prefetch else 'on'}"] + notes
    holdout = _holdout(runs, args.judge_from, out, notes)
    md = write_report(runs, out, title=f"Simulation of {trace.name}", notes=notes, plots=not args.no_plots,
                      holdout=holdout)
    print()
    print(latency_table(sums))
    print()
    print(slowdown_table(sums))
    print()
    print(prediction_table(sums))
    print()
    print(baseline_table(sums))
    print()
    print(cache_table(sums))
    if holdout:
        print()
        print(holdout_table(holdout))
    print()
    print(serving_table([(s.run, "whole", s) for s in sums if s.mode != "ideal"]
                        + [(p.run, p.part, p.summary) for p in holdout if p.summary.mode != "ideal"]))
    print(f"\nresults: {res_path}\nreport:  {md}")
    return 0


# ------------------------------------------------------------------ report, trace


def cmd_report(args: argparse.Namespace) -> int:
    from .report import holdout_table, latency_table, write_report
    from .results import read_runs
    from .summary import summarize

    runs = read_runs(*args.results)
    if not runs:
        raise TraceError("no runs in the given results files")
    if args.runs:
        keep = set(args.runs.split(","))
        runs = [r for r in runs if r.meta.run in keep]
    out = out_dir(args.out, "report")
    notes: list[str] = []
    holdout = _holdout(runs, args.judge_from, out, notes)
    md = write_report(runs, out, title=args.title, notes=notes, plots=not args.no_plots, holdout=holdout)
    print(latency_table([summarize(r) for r in runs]))
    if holdout:
        print()
        print(holdout_table(holdout))
    print(f"\nreport: {md}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from .mooncake import dump_mooncake

    trace = load_trace(args)
    st = trace.stats()
    for k, v in st.to_dict().items():
        print(f"{k:>20}: {v:.4g}" if isinstance(v, float) else f"{k:>20}: {v}")
    for n in trace.notes:
        print(f"{'note':>20}: {n}")
    if args.action == "convert":
        if not args.to:
            raise TraceError("trace convert needs --to OUT.jsonl")
        if trace.block_tokens != 512:
            print(f"note: the Mooncake file will use {trace.block_tokens}-token blocks; "
                  f"read it back with --block-tokens {trace.block_tokens}")
        written = dump_mooncake(trace, args.to)
        print(f"wrote {written} requests to {args.to}")
    return 0


# ------------------------------------------------------------------ scenario, compare


def cmd_scenario(args: argparse.Namespace) -> int:
    from .scenarios import SCENARIOS, run_scenario

    if args.name == "list":
        for name, sc in SCENARIOS.items():
            print(f"{name:<22} {sc.summary}")
        return 0
    names = list(SCENARIOS) if args.name == "all" else [args.name]
    for n in names:
        if n not in SCENARIOS:
            raise TraceError(f"unknown scenario {n!r}; `scenario list` shows them")
    out = out_dir(args.out, "scenario")
    failed = 0
    for n in names:
        result = run_scenario(n, size=args.size, out_dir=out / n, seed=args.seed)
        failed += not result.passed
    if len(names) > 1:
        print(f"\n{len(names) - failed}/{len(names)} scenarios passed")
    print(f"output: {out}")
    return 1 if failed else 0


def cmd_harden(args: argparse.Namespace) -> int:
    from .harden.cli import run

    return run(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import run_calibrate

    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        raise ValueError(f"--lengths: comma-separated token counts, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 1 or args.repeats < 1:
        raise ValueError("--lengths must be positive token counts and --repeats >= 1")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists (pass --force to replace it)")
    m = run_calibrate(args.url, out, base_profile=args.base_profile, name=args.name or out.stem, model=args.model,
                      lengths=lengths, repeats=args.repeats)
    steps = ", ".join(f"batch {b}: {s * 1e3:.2f} ms" for b, s in sorted(m.decode_steps.items()))
    print(f"prefill: overhead {m.overhead_s * 1e3:.1f} ms + {m.prefill_tokens_per_s:.0f} tokens/s "
          f"({m.samples} samples, residual spread {m.rel_spread:.1%}); decode steps {steps}")
    print(f"profile written: {out} (use it with `kvroute loadtest simulate --profile {out}`)")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import CompareConfig, run_compare

    trace = load_trace(args)
    cfg = CompareConfig(
        policies=[p.strip() for p in args.policies.split(",") if p.strip()],
        workers=args.workers, profile=args.profile, speed=args.speed, block_size=args.block_size,
        tolerance=args.tolerance, seed=args.seed, vocab_size=args.vocab_size, base_port=args.base_port,
        python=args.python, transport=args.offline_transport, offline_seeds=args.offline_seeds,
        http_runs=args.http_runs, hold_target_s=args.hold_target, gateway_order=args.gateway_order,
        max_hold_s=args.max_hold,
    )
    ok = run_compare(trace, cfg, out_dir(args.out, "compare"),
                     http_from=Path(args.http_from) if args.http_from else None)
    return 0 if ok else 1


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvroute loadtest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("replay", help="open-loop HTTP replay against an OpenAI-compatible URL")
    add_trace_args(p)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL (default: the local gateway)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--concurrency", type=int, default=256, help="in-flight bound; beyond it = client queueing")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-ignore-eos", action="store_true", help="for servers that reject ignore_eos")
    p.add_argument("--label", default=None, help="run label in the results")
    p.add_argument("--policy-label", default=None, help="the server's routing policy, for the report")
    p.add_argument("--workers-label", type=int, default=None, help="the fleet size, for the report")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=cmd_replay)

    p = sub.add_parser("simulate", help="offline discrete-event comparison of routing policies")
    add_trace_args(p)
    _add_fleet_args(p)
    p.add_argument("--policies",
                   default="round_robin,least_loaded,prefix_hash,cache_aware,dynamo,kv_cost,kv_cost_true_state")
    p.add_argument("--tiers", default="all", help="gpu | gpu,cpu | gpu,cpu,disk | gpu,cpu,disk,remote | all")
    p.add_argument("--tier-sweep", action="store_true", help="run every policy with gpu, gpu,cpu, gpu,cpu,disk, all")
    p.add_argument("--find-load", action="store_true",
                   help="pick the speed where round_robin's p99 TTFT >= --target-ratio x its p50")
    p.add_argument("--target-ratio", type=float, default=5.0)
    p.add_argument("--target-util", type=float, default=None, metavar="U",
                   help="pick the speed at which --load-policy keeps the fleet's prefill busy fraction near U "
                        "(e.g. 0.8, 0.95); every run's utilisation is reported")
    p.add_argument("--load-policy", default="round_robin", help="the reference policy of --target-util")
    p.add_argument("--no-ideal", action="store_true", help="leave out the ideal run (the physical limit)")
    add_judge_arg(p)
    p.add_argument("--param", action="append", default=[], help="policy parameter: POLICY.NAME=VALUE")
    p.add_argument("--jobs", type=int, default=1, help="simulations in parallel processes")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(fn=cmd_simulate)

    p = sub.add_parser("scenario", help="the seed load tests (offline simulator)")
    p.add_argument("name", help="a scenario name, `list`, or `all`")
    p.add_argument("--size", choices=["small", "full"], default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(fn=cmd_scenario)

    p = sub.add_parser("harden", help="the adversarial suite: real gateway and workers, hostile cases (docs/harden.md)")
    from .harden.cli import add_arguments as add_harden_arguments

    add_harden_arguments(p)
    p.set_defaults(fn=cmd_harden)

    p = sub.add_parser("report", help="re-render a report from results JSONL files")
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.add_argument("--title", default="kvroute load test")
    p.add_argument("--runs", default=None, help="comma list of run labels to keep")
    add_judge_arg(p)
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("compare", help="offline simulator vs HTTP replay (sim cluster + gateway), p50 TTFT")
    add_trace_args(p)
    p.add_argument("--policies", default="round_robin,kv_cost")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--profile", default="h200-llama3.1-8b")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--base-port", type=int, default=0, help="first worker port (0 = pick free ports)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the sim cluster and gateway")
    p.add_argument("--offline-transport", default="local-http",
                   help="the offline side's model of the HTTP path: local-http (measured on this stack) | none")
    p.add_argument("--offline-seeds", type=int, default=9, help="draws of the transport jitter (median p50)")
    p.add_argument("--http-runs", type=int, default=1, help="HTTP replays per policy (median p50)")
    p.add_argument("--hold-target", type=float, default=None, metavar="S",
                   help="late binding on both sides: the gateway holds requests while every worker's predicted "
                        "queue exceeds S (routing.gateway_queue)")
    p.add_argument("--gateway-order", choices=("fifo", "spf"), default="fifo", help="order of held requests")
    p.add_argument("--max-hold", type=float, default=20.0, metavar="S", help="fairness bound of held requests")
    p.add_argument("--http-from", default=None, metavar="RESULTS_JSONL",
                   help="reuse the HTTP runs of an earlier compare instead of replaying (re-check the offline side)")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("calibrate", help="measure a real worker (vLLM or ours) and write a simulator profile")
    p.add_argument("--url", required=True, help="the worker's base URL (its OpenAI routes, not the gateway's)")
    p.add_argument("--out", required=True, help="the profile YAML to write")
    p.add_argument("--base-profile", default="tiny-cpu",
                   help="geometry, memory, tiers and scheduler come from this profile (name or path)")
    p.add_argument("--name", default=None, help="the profile's name (default: --out's stem)")
    p.add_argument("--model", default=None, help="model name to send (default: the worker's first /v1/models)")
    p.add_argument("--lengths", default="32,128,256,512,1024", help="uncached prompt lengths to time (tokens)")
    p.add_argument("--repeats", type=int, default=3, help="timings per length")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(fn=cmd_calibrate)

    p = sub.add_parser("trace", help="trace statistics, or convert to Mooncake JSONL")
    p.add_argument("action", choices=["stats", "convert"])
    add_trace_args(p)
    p.add_argument("--to", default=None, help="convert: output .jsonl")
    p.set_defaults(fn=cmd_trace)
    return ap


def _add_fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated fleet and router")
    g.add_argument("--workers", type=int, default=8)
    g.add_argument("--profile", default="h200-llama3.1-8b")
    g.add_argument("--block-size", type=int, default=None, help="override the profile's block size (e.g. 64)")
    g.add_argument("--remote-groups", type=int, default=1)
    g.add_argument("--max-waiting", type=int, default=None)
    g.add_argument("--pd", type=pd_split, default=None, metavar="P:D",
                   help="a disaggregated fleet: P prefill workers and D decode workers (replaces --workers, which "
                        "means that many aggregated workers); routed by the pair policies pd_cost, pd_round_robin, "
                        "pd_prefix")
    g.add_argument("--pd-link-gbps", type=positive_float, default=None, metavar="GB/S",
                   help="the prefill->decode KV link in GB/s (each decode worker's PEER link; default: the "
                        "profile's, 25 GB/s for the H200 profiles)")
    g.add_argument("--dp", type=int, default=1, metavar="R",
                   help="data-parallel ranks per server: --workers servers of R ranks, each rank its own engine "
                        "(loadtest/dp_fleet.py)")
    g.add_argument("--dp-routing", choices=("rank", "server"), default="rank",
                   help="with --dp: rank = every rank a worker of its own (the gateway); server = one worker per "
                        "server, its ranks' events and loads merged, the rank chosen by vLLM's balancer")
    g.add_argument("--slo-ttft", type=positive_float, default=2.0, metavar="S",
                   help="goodput's TTFT SLO in seconds (default 2)")
    g.add_argument("--slo-tpot", type=positive_float, default=0.1, metavar="S",
                   help="goodput's time-per-output-token SLO in seconds (default 0.1)")
    g.add_argument("--poll-interval", type=float, default=0.1, help="load-report poll period (s), as the gateway")
    g.add_argument("--event-lag", type=float, default=0.0, help="KV-event delivery delay (s)")
    g.add_argument("--no-prefetch", action="store_true")
    g.add_argument("--transport", default="none",
                   help="model of the HTTP path: none (the pure model) | local-http (measured on this project's "
                        "stack: intake, large-body lag, jitters, fixed delay)")
    g.add_argument("--transport-seed", type=int, default=0, help="seed of the transport's jitter")
    g.add_argument("--route-delay", type=delay, default=None, metavar="S[,S_PER_TOKEN]",
                   help="client → gateway delay before routing, seconds [+ seconds per prompt token]")
    g.add_argument("--send-delay", type=delay, default=None, metavar="S[,S_PER_TOKEN]",
                   help="gateway → worker delay (and the first byte back), seconds [+ seconds per prompt token]")
    g.add_argument("--gateway-order", choices=("none", "fifo", "spf"), default="none",
                   help="the gateway's own queue: none = route on arrival; fifo / spf = bind what arrives at one "
                        "instant in arrival order / fewest predicted prefill tokens first (router/planner/"
                        "gateway_queue.py)")
    g.add_argument("--hold-target", type=float, default=None, metavar="S",
                   help="late binding: hold requests at the gateway while every worker's predicted queue exceeds S")
    g.add_argument("--max-hold", type=float, default=2.0, metavar="S",
                   help="fairness bound of the gateway queue: a request held S seconds is bound first")


def _missing_extra() -> str | None:
    """One line naming what `pip install 'kvroute[loadtest]'` would add, if anything is missing."""
    import importlib.util

    missing = [m for m in ("rich", "matplotlib") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"kvroute loadtest needs the `loadtest` extra ({', '.join(missing)} missing): "
            "pip install 'kvroute[loadtest]', or from a checkout pip install -e '.[loadtest]'")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = _missing_extra()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    try:
        return int(args.fn(args))
    except (TraceError, ValueError) as e:  # bad input: traces, profiles, policy names/params
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
