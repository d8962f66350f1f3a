"""configs/prometheus/prometheus.yml passes `promtool check config`; the Grafana provisioning
names the dashboard's datasource and folder; the dashboard reads only metrics the code defines.
A real Prometheus (Debian's package) scrapes a real gateway, a simulated fleet and a worker
that answers 429, with the shipped scrape config (targets rewritten); after traffic with a
repeated prefix, CPU-tier hits, prefetches, retries and shedding, EVERY PromQL expression of
the dashboard is evaluated through Prometheus' HTTP API and must return data; what it reads
with rate() must be a counter (`_total`) or histogram buckets, the rest gauges, by the scraped
metadata. Each query and its result is printed (`-s` shows them).

The external tools are installed by .ci/run (apt-get); where one is missing the test skips with
a warning that pytest prints in its summary.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_rig import (
    DASHBOARD,
    GRAFANA_PROVISIONING,
    GRAFANA_VARS,
    MODEL,
    PROMETHEUS_YML,
    ROOT,
    _compose,
    _dashboard_queries,
    _expand,
    _get,
    _ids,
    _Procs,
    _ready_lines,
    _small_gpu_profile,
    _tool,
    _wait_until,
)


def test_prometheus_config_passes_promtool() -> None:
    promtool = _tool("promtool")
    r = subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_provisioning_names_the_dashboards_datasource_and_folder() -> None:
    ds = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yaml").read_text())["datasources"]
    uids = {d["uid"] for d in ds}
    assert [d["url"] for d in ds] == ["http://prometheus:9090"]
    provider = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "kvroute.yaml").read_text())["providers"][0]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in _compose()["services"]["grafana"]["volumes"]}
    assert mounts[provider["options"]["path"]] == "./configs/grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./configs/grafana/provisioning"
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 7 and all(p.get("targets") for p in panels)
    for p in panels:
        assert p["datasource"]["uid"] in uids
        assert all(t["datasource"]["uid"] in uids and t["expr"].strip() for t in p["targets"])
    titles = " | ".join(p["title"] for p in panels).lower()
    for topic in ("ttft", "prediction error", "hit rate per tier", "prefetch", "shed", "retries", "queues",
                  "index size", "ingest lag"):
        assert topic in titles, f"no panel about {topic!r}"


def _defined_metric_names() -> set[str]:
    """Metric names the gateway and workers define: string literals `kvroute_...`, plus the
    worker collector's `kvroute_worker_{name}` families (workers/metrics.py)."""
    names: set[str] = set()
    for pkg in ("router", "workers"):
        for f in (ROOT / pkg).rglob("*.py"):
            names.update(re.findall(r"[\"'](kvroute_[a-z0-9_]+)[\"']", f.read_text()))
    collector = (ROOT / "workers" / "metrics.py").read_text()
    names.update("kvroute_worker_" + n for n in re.findall(r"[\"']([a-z_]+)[\"']", collector))
    return names


def test_dashboard_reads_only_metrics_the_code_defines() -> None:
    defined = _defined_metric_names()
    used = set()
    for _title, _legend, expr in _dashboard_queries():
        _expand(expr)
        used.update(re.findall(r"\bkvroute_[a-z0-9_]+", expr))
    assert used
    for name in sorted(used):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert base in defined, f"the dashboard reads {name}, which no code defines"




def _prometheus_config(gateway: str, workers: dict[str, str]) -> dict[str, Any]:
    """The shipped scrape config with the compose targets replaced by the test's processes."""
    prom: dict[str, Any] = yaml.safe_load(PROMETHEUS_YML.read_text())
    prom["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    jobs["kvroute-gateway"]["static_configs"] = [{"targets": [gateway]}]
    jobs["kvroute-workers"]["static_configs"] = [{"targets": [addr], "labels": {"worker": wid}}
                                                 for wid, addr in workers.items()]
    prom["scrape_configs"] = [jobs["kvroute-gateway"], jobs["kvroute-workers"]]
    return prom


async def _traffic(url: str, worker_urls: list[str], phase: str) -> dict[str, int]:
    """Requests through the gateway (and straight to the workers, to push blocks to CPU)."""
    import aiohttp

    statuses: dict[str, int] = {}

    async def complete(s: aiohttp.ClientSession, prompt: list[int], max_tokens: int = 4, stream: bool = False,
                       base: str | None = None) -> None:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        async with s.post((base or url) + "/v1/completions", json=body) as r:
            text = await r.read()
            assert r.status in (200, 429), (r.status, text[:300])
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1

    salt = 1000 * len(phase) + int(time.time() * 1000) % 100_000  # fresh prompts every phase
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        if phase == "warm":
            await complete(s, _ids(salt, 16 * 4))
            return statuses
        # a long shared prefix, asked again and again with different tails: GPU hits on its holder
        prefix = _ids(1, 16 * 60)
        for k in range(6):
            await complete(s, prefix + _ids(salt + k, 8))
        # fresh prompts: the cost model prices the idle 429-answering worker low -> retries
        for k in range(6):
            await complete(s, _ids(salt + 100 + k, 16 * 6))
        # push the prefix out of every worker's GPU (straight to the workers), then ask for it again:
        # matched on CPU, prefetched toward GPU while the request waits
        for k, base in enumerate(worker_urls):
            for j in range(3):
                await complete(s, _ids(salt + 200 + 3 * k + j, 16 * 60), max_tokens=1, base=base)
        await _until_indexed_on_cpu(s, url, prefix)
        for k in range(3):
            await complete(s, prefix + _ids(salt + 300 + k, 8))
        # a burst beyond every worker's in-flight cap: shed with 429
        await asyncio.gather(*(complete(s, _ids(salt + 400 + k, 48), max_tokens=48, stream=True) for k in range(24)))
    return statuses


async def _until_indexed_on_cpu(s: Any, url: str, prefix: list[int], timeout: float = 15.0) -> None:
    """Until the gateway's index places `prefix` on some worker's CPU tier (the offload events of
    the requests just sent straight to the workers have been ingested): /admin/route/explain."""
    body = {"model": MODEL, "prompt": prefix, "max_tokens": 1}
    deadline = time.monotonic() + timeout
    while True:
        async with s.post(url + "/admin/route/explain", json=body) as r:
            assert r.status == 200, await r.text()
            matches = (await r.json())["matches"]
        if any(tier == "CPU" for m in matches.values() for tier, _n in m["runs"]):
            return
        assert time.monotonic() < deadline, f"the prefix never showed on a CPU tier in the index: {matches}"
        await asyncio.sleep(0.05)


def _wait_scrapes(prom: str, n: int, proc: subprocess.Popen[Any], log: Path) -> None:
    """Until Prometheus has scraped every target `n` more times (the timestamps of its `up` samples)."""
    for _ in range(n):
        mark = time.time()

        def scraped(mark: float = mark) -> bool:
            qs = urllib.parse.urlencode({"query": "min(timestamp(up))"})
            result = json.loads(_get(f"{prom}/api/v1/query?{qs}")[1])["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) > mark

        _wait_until(scraped, 15, "a scrape of every target", proc, log)


def _prom_query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    qs = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"})
    status, body = _get(f"{prom}/api/v1/query_range?{qs}", timeout=30)
    data = json.loads(body)
    assert status == 200 and data["status"] == "success", f"{expr}: {body[:500]!r}"
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


def _peak(series: dict[str, Any]) -> float:
    vals = [float(v) for _, v in series["values"]]
    return max((v for v in vals if math.isfinite(v)), default=0.0)


# (panel, legend) -> the series (label values joined by ",") the test's traffic makes non-zero
NONZERO = {
    ("TTFT (gateway)", "p50"): "",
    ("TTFT prediction error", "p95 |error|"): "",
    ("Hit rate per tier (workers)", "{{tier}}"): "GPU",
    ("Hit rate per tier (gateway index)", "index {{tier}}"): "GPU",
    ("Prefetches", "sent"): "",
    ("Shed by reason", "{{reason}}"): "worker_caps",
    ("Retries and upstream errors", "retry {{reason}}"): "before_first_byte",
    ("Index size", "blocks {{model}}"): MODEL,
    ("KV events ingested", "events {{worker}}"): "w0",
}


def _summary(result: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """Finite points in all, and `labels: last value (max)` per series."""
    finite = 0
    lines = []
    for series in result:
        vals = [float(v) for _, v in series["values"]]
        ok = [v for v in vals if math.isfinite(v)]
        finite += len(ok)
        labels = ",".join(f"{k}={v}" for k, v in sorted(series["metric"].items())) or "{}"
        last = f"{ok[-1]:.4g}" if ok else "NaN"
        peak = f"{max(ok):.4g}" if ok else "NaN"
        lines.append(f"{labels}: last {last}, max {peak}")
    return finite, lines


@pytest.mark.slow
def test_prometheus_scrapes_the_stack_and_every_dashboard_query_returns_data(tmp_path: Path,
                                                                              procs: _Procs) -> None:
    from kvindex.keys import Namespace
    from loadtest.ports import free_port
    from router.config import build_config

    prometheus = _tool("prometheus")
    profile = _small_gpu_profile(tmp_path)
    py = sys.executable

    # the simulated fleet (2 workers) and a worker whose every completion is a 429
    sim_log = tmp_path / "sim.log"
    sim = procs.start([py, "-m", "workers.cli", "sim-cluster", "--workers", "2", "--profile", str(profile),
                       "--base-port", "0", "--host", "127.0.0.1",
                       "--tokenizer", str(ROOT / "configs" / "assets" / "tiny-tokenizer")], sim_log)
    lines = _ready_lines(sim_log, sim)
    workers = {}
    for line in lines:
        words = line.split()
        if words and words[0] == "worker":
            workers[words[1]] = next(w[4:] for w in words if w.startswith("url="))
    assert len(workers) == 2, lines
    model = {"id": MODEL, "served_names": ["llama-3.1-8b"], "tokenizer": str(ROOT / "configs/assets/tiny-tokenizer"),
             "profile": str(profile)}
    m = build_config({"models": [model]}, ROOT, environ={}).models[0]
    ns = m.namespace
    digest = Namespace(m.id, ns.revision, ns.tokenizer_revision, ns.kv_dtype, ns.parallel, ns.block_size).digest
    faulty_log = tmp_path / "faulty.log"
    faulty = procs.start([py, "-m", "loadtest.harden.faulty", "--mode", "s429", "--digest", digest.hex(),
                          "--model", MODEL, "--served", "llama-3.1-8b", "--worker-id", "busy"], faulty_log)
    faulty_url = _ready_lines(faulty_log, faulty, 30)[0].split("url=")[1].strip()

    # the gateway, as `kvroute serve` runs it
    port = free_port()
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [model],
        "workers": [{"id": wid, "url": u} for wid, u in workers.items()] + [{"id": "busy", "url": faulty_url}],
        "routing": {"policy": "kv_cost", "retries": 1},
        "limits": {"worker_max_inflight": 3},
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.2},
        "shutdown": {"grace_s": 0, "drain_timeout_s": 5},
    }
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(cfg))
    gw_log = tmp_path / "gateway.log"
    gw = procs.start([py, "-m", "kvroute.cli", "serve", "--config", str(tmp_path / "gateway.yaml")], gw_log,
                     env={**{k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}})
    url = f"http://127.0.0.1:{port}"
    _wait_until(lambda: _get(url + "/ready", 1)[0] == 200, 60, "gateway /ready", gw, gw_log)

    # Prometheus on the shipped scrape config
    prom_port = free_port()
    prom_cfg = _prometheus_config(f"127.0.0.1:{port}", {wid: u.removeprefix("http://") for wid, u in workers.items()})
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
    prom_log = tmp_path / "prometheus.log"
    prom_proc = procs.start([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            prom_log)
    prom = f"http://127.0.0.1:{prom_port}"
    _wait_until(lambda: _get(prom + "/-/ready", 1)[0] == 200, 60, "prometheus /-/ready", prom_proc, prom_log)

    def targets_up() -> bool:
        active = json.loads(_get(prom + "/api/v1/targets")[1])["data"]["activeTargets"]
        return len(active) == 3 and all(t["health"] == "up" for t in active)

    _wait_until(targets_up, 30, "every target up", prom_proc, prom_log)
    start = time.time()
    worker_urls = list(workers.values())
    asyncio.run(_traffic(url, worker_urls, "warm"))
    _wait_scrapes(prom, 2, prom_proc, prom_log)  # the series exist in two scrapes before the traffic counts
    statuses = asyncio.run(_traffic(url, worker_urls, "main"))
    _wait_scrapes(prom, 1, prom_proc, prom_log)
    statuses2 = asyncio.run(_traffic(url, worker_urls, "main"))  # twice: counters born in the first rise again
    _wait_scrapes(prom, 2, prom_proc, prom_log)
    end = time.time()
    print(f"\ntraffic answered: {statuses} then {statuses2}")
    assert statuses.get("200") and statuses.get("429"), statuses

    missing, peaks = [], {}
    print(f"\n{len(_dashboard_queries())} dashboard queries over [{end - start:.0f} s], step 1 s, "
          f"{', '.join(f'{k} = {v}' for k, v in GRAFANA_VARS.items())}:")
    for title, legend, expr in _dashboard_queries():
        result = _prom_query_range(prom, _expand(expr), start, end)
        finite, lines = _summary(result)
        print(f"\n[{title}] {legend}\n  {expr}")
        for line in lines or ["(no series)"]:
            print(f"    {line}")
        if not finite:
            missing.append(f"{title} / {legend}: {expr}")
        peaks[(title, legend)] = {",".join(f"{v}" for _, v in sorted(r["metric"].items())): _peak(r) for r in result}
    assert not missing, "queries without data:\n" + "\n".join(missing)
    # counters are counters: what the dashboard rates is a counter (or a histogram's buckets), the
    # rest are gauges, as the scraped `# TYPE` lines say (Prometheus' metadata API)
    metadata = json.loads(_get(f"{prom}/api/v1/metadata")[1])["data"]
    for _title, _legend, expr in _dashboard_queries():
        rated = set(re.findall(r"rate\((kvroute_[a-z0-9_]+)", expr))
        for name in set(re.findall(r"\bkvroute_[a-z0-9_]+", expr)):
            family = re.sub(r"_(total|bucket)$", "", name)
            meta = metadata.get(name) or metadata.get(family)
            assert meta, f"{name}: no metadata in Prometheus"
            kind = meta[0]["type"]
            if name in rated:
                want = "histogram" if name.endswith("_bucket") else "counter"
                assert kind == want and (name.endswith(("_total", "_bucket"))), f"rate({name}): a {kind}"
            else:
                assert kind == "gauge", f"{name} is read as a gauge, but it is a {kind}"
    # and what this traffic must have made non-zero
    for key, series in NONZERO.items():
        assert peaks[key].get(series, 0) > 0, f"{key} {series!r}: {peaks[key]}"
