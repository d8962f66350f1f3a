"""Cache-aware routing over real engine workers: a long prefix on worker A's DISK tier.

    .venv/bin/python bench/bench_real_routing.py [--prefix-tokens 4096] [--reps 3] [--threads 1]
        [--queue-tokens 2048] [--cpu-blocks 128] [--peer] [--max-seconds 900] [--json FILE]

Starts two real engine workers (`python -m workers.cli engine`: the bundled tiny Llama, a
device pool that holds the request and the one ahead of it, a CPU tier of `--cpu-blocks`,
a DISK tier that admits every offloaded block) and the gateway (`kvroute serve`, policy
`kv_cost`, prefetch on), all on 127.0.0.1. Each repetition, with a fresh random prefix P:

1. warms P on worker A (sent to A directly);
2. sends other prompts to A until P has left A's device pool and CPU tier: the gateway's
   index (`/admin/route/explain`) sees P's blocks on A only in DISK;
3. gives A a queue: a prompt of `--queue-tokens` new tokens sent to A directly, and waits
   until the gateway sees A busy;
4. asks the gateway to explain request R = P + a new question (predicted TTFT on A and B),
   then sends R through the gateway, streaming: which worker served it
   (`x-kvroute-worker`), the measured TTFT (first token at the client), usage
   (`cached_tokens`, tokens per tier, `prefetched_tokens`, the engine's own `ttft_ms` and
   `queue_ms`), the prefetch the gateway issued (`kvroute_prefetch_sent_total`,
   `..._used_tokens_total`) and what worker A did with it
   (`kvroute_worker_prefetch_requests_total`, `..._prefetch_blocks_landed_total`,
   `..._prefetched_tokens_total`): R waits in A's queue while P's blocks come up from DISK;
5. sends B directly a prompt of R's length it never saw (a fresh prefix): the TTFT of the
   miss the routing avoided.

Peer pulls are off unless `--peer`: with them, an idle B may rightly win by pulling P's
blocks from A (the gateway's other answer to the same question), which is not what this
bench measures. A step budget of a whole prompt keeps every prompt one prefill chunk.
`--gpu-blocks` / `--budget` set other sizes.

Prints one row per repetition and the medians. Everything is bounded (`--max-seconds`,
a count of fillers per repetition, HTTP timeouts) and every process it started is
stopped at exit, also on an error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from loadtest.ports import free_port  # noqa: E402

BLOCK = 16
BLOCK_BYTES = 65536  # the tiny Llama in fp32: 4 layers x 2 x 2 KV heads x 64 x 4 B x 16 tokens
MODEL = "kvroute/tiny-llama"
HOST = "127.0.0.1"
_CHILDREN: list[subprocess.Popen[str]] = []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--queue-tokens", type=int, default=2048,
                    help="a prompt sent to A just before R, so that R queues there (0: none)")
    ap.add_argument("--peer", action="store_true", help="let the workers pull blocks from each other")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--gpu-blocks", type=int, default=None,
                    help="each worker's device pool in 16-token blocks (default: R, the request ahead of it "
                         "and a few blocks)")
    ap.add_argument("--budget", type=int, default=None,
                    help="max_num_batched_tokens (default: the whole request, so a prompt is one step)")
    ap.add_argument("--cpu-blocks", type=int, default=128, help="each worker's CPU tier (blocks)")
    ap.add_argument("--max-fillers", type=int, default=12, help="filler prompts per repetition at most")
    ap.add_argument("--max-seconds", type=float, default=900.0, help="give up after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--log-dir", default=None, help="keep the gateway's log here (default: dropped at exit)")
    a = ap.parse_args()
    total = a.prefix_tokens + a.question_tokens
    need = -(-(total + 4) // BLOCK)  # the request's blocks, prompt and output
    if a.gpu_blocks is None:
        a.gpu_blocks = need + -(-(a.queue_tokens + 1) // BLOCK) + 4
    if a.budget is None:
        a.budget = -(-max(total, a.queue_tokens) // BLOCK) * BLOCK
    if a.gpu_blocks < need:
        ap.error(f"--gpu-blocks must hold one request: at least {need} for {total} tokens")
    if a.prefix_tokens + a.question_tokens + 8 > 8192:
        ap.error("the tiny Llama has 8192 positions")
    deadline = time.monotonic() + a.max_seconds
    tmp = Path(tempfile.mkdtemp(prefix="bench-real-routing-"))
    try:
        return run(a, tmp, deadline)
    finally:
        stop_children()
        shutil.rmtree(tmp, ignore_errors=True)


def run(a: argparse.Namespace, tmp: Path, deadline: float) -> int:
    token = secrets.token_urlsafe(16) if a.peer else None
    print(f"starting workers A and B (device pool {a.gpu_blocks} blocks = {a.gpu_blocks * BLOCK} tokens, "
          f"CPU tier {a.cpu_blocks} blocks, DISK, peer pulls {'on' if a.peer else 'off'}; step budget {a.budget} "
          "tokens) and the gateway (kv_cost) ...",
          flush=True)
    wa = start_worker("A", a, tmp, token)
    wb = start_worker("B", a, tmp, token)
    wait_workers([wa, wb], deadline)
    gw = start_gateway(Path(a.log_dir) if a.log_dir else tmp, tmp, {"A": wa.url, "B": wb.url})
    wait_http(gw + "/ready", deadline)
    wait_healthy(gw, deadline)
    print(f"workers A {wa.url}, B {wb.url}; gateway {gw}", flush=True)

    rng = random.Random(a.seed)
    rows: list[dict[str, Any]] = []
    for rep in range(a.reps):
        check_time(deadline)
        prefix = tokens(rng, a.prefix_tokens)
        post(wa.url + "/v1/completions", {"prompt": prefix + tokens(rng, a.question_tokens), "max_tokens": 1})
        request = prefix + tokens(rng, a.question_tokens)  # a new question after the same long prefix
        body = {"model": MODEL, "prompt": request, "max_tokens": 4, "temperature": 0}
        fillers, where = push_to_disk(wa, gw, body, rng, a, deadline)
        ahead = queue_on(wa, gw, body, tokens(rng, a.queue_tokens), deadline) if a.queue_tokens else None
        explain = post(gw + "/admin/route/explain", body)
        est = {e["worker_id"]: e for e in explain["workers"]}
        g0, m0 = metrics(gw), metrics(wa.url)
        via = stream(gw + "/v1/completions", body)
        if ahead is not None:
            ahead.join(120)
        time.sleep(0.3)  # the gateway's prefetch bookkeeping ends with the request
        g1, m1 = metrics(gw), metrics(wa.url)
        miss = tokens(rng, a.prefix_tokens + a.question_tokens)  # R's length, never seen by B
        cold = stream(wb.url + "/v1/completions", {**body, "prompt": miss})
        kv = via["usage"]["kv"]
        row = {
            "rep": rep + 1,
            "fillers": fillers,
            "match_on_A": where,
            "decision": explain["decision"]["worker_id"],
            "routed_to": via["worker"],
            "prefetch_blocks_planned": explain["decision"]["prefetch_blocks"],
            "gw_prefetch_sent": delta(g0, g1, "kvroute_prefetch_sent_total"),
            "gw_prefetch_requested_tokens": delta(g0, g1, "kvroute_prefetch_requested_tokens_total"),
            "gw_prefetch_used_tokens": delta(g0, g1, "kvroute_prefetch_used_tokens_total"),
            "A_prefetch_requests": delta(m0, m1, "kvroute_worker_prefetch_requests_total"),
            "A_prefetch_blocks_landed": delta(m0, m1, "kvroute_worker_prefetch_blocks_landed_total"),
            "A_prefetched_tokens": delta(m0, m1, "kvroute_worker_prefetched_tokens_total"),
            "prompt_tokens": via["usage"]["prompt_tokens"],
            "cached_tokens": via["usage"]["prompt_tokens_details"]["cached_tokens"],
            "loaded_tokens": kv["loaded_tokens"],
            "prefetched_tokens": kv["prefetched_tokens"],
            "recomputed_tokens": kv["recomputed_tokens"],
            "load_ms": kv["load_ms"],
            "queue_ms": kv["queue_ms"],
            "pred_A_queue_ms": 1000 * est["A"]["t_queue_s"],
            "pred_A_ms": 1000 * est["A"]["t_ttft_s"],
            "pred_B_ms": 1000 * est["B"]["t_ttft_s"],
            "pred_header_ms": via["predicted_ms"],
            "ttft_via_gateway_ms": via["ttft_ms"],
            "engine_ttft_A_ms": kv["ttft_ms"],
            "ttft_B_direct_ms": cold["ttft_ms"],
            "engine_ttft_B_ms": cold["usage"]["kv"]["ttft_ms"],
            "B_cached_tokens": cold["usage"]["prompt_tokens_details"]["cached_tokens"],
        }
        rows.append(row)
        print(f"rep {rep + 1}: {fillers} fillers, P on A: {where}; routed to {row['routed_to']}, "
              f"cached {row['cached_tokens']}/{row['prompt_tokens']} (DISK {kv['loaded_tokens']['DISK']}, "
              f"prefetched {kv['prefetched_tokens']}; queued {kv['queue_ms']:.0f} ms, load {kv['load_ms']:.0f} ms), "
              f"TTFT {row['ttft_via_gateway_ms']:.0f} ms (predicted {row['pred_A_ms']:.0f}); "
              f"a miss on B {row['ttft_B_direct_ms']:.0f} ms (predicted for R there {row['pred_B_ms']:.0f})",
              flush=True)
    report(rows, a)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    ok = all(r["routed_to"] == "A" and r["cached_tokens"] > 0 for r in rows) or a.peer
    return 0 if ok else 1


# ---------------------------------------------------------------------- the steps


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 8000) for _ in range(n)]  # ordinary ids of the 8192-token vocabulary


def push_to_disk(wa: Proc, gw: str, body: dict[str, Any], rng: random.Random, a: argparse.Namespace,
                 deadline: float) -> tuple[int, str]:
    """Filler prompts to A until the gateway's index has the request's prefix on A only in DISK."""
    want = (a.prefix_tokens // BLOCK) * 9 // 10
    for n in range(a.max_fillers + 1):
        if n:
            post(wa.url + "/v1/completions", {"prompt": tokens(rng, a.prefix_tokens + a.question_tokens),
                                              "max_tokens": 1})
        for _ in range(20):  # the KV events reach the gateway within milliseconds; allow a second or two
            check_time(deadline)
            m = post(gw + "/admin/route/explain", body)["matches"].get("A", {"runs": []})
            tiers = dict((t, 0) for t in ("GPU", "CPU", "DISK"))
            for t, k in m["runs"]:
                tiers[t] = tiers.get(t, 0) + k
            where = " ".join(f"{t} {k}" for t, k in tiers.items()) + " blocks"
            if tiers["GPU"] == 0 and tiers["CPU"] == 0 and tiers["DISK"] >= want:
                return n, where
            if tiers["GPU"] or tiers["CPU"]:
                break  # not there yet: another filler
            time.sleep(0.1)
    raise SystemExit(f"the prefix did not reach A's DISK tier after {a.max_fillers} fillers ({where})")


def queue_on(wa: Proc, gw: str, body: dict[str, Any], prompt: list[int], deadline: float) -> threading.Thread:
    """Send A a prompt (on a thread) and wait until the gateway sees it queued or running there."""
    t = threading.Thread(target=post, args=(wa.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1}),
                         daemon=True)
    t.start()
    end = min(deadline, time.monotonic() + 5)
    while time.monotonic() < end and t.is_alive():
        est = {e["worker_id"]: e for e in post(gw + "/admin/route/explain", body)["workers"]}
        if est["A"]["t_queue_s"] > 0:
            break
        time.sleep(0.02)
    return t


def report(rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    cols: list[tuple[str, str | None]] = [
        ("rep", "rep"),
        ("routed", "routed_to"),
        ("cached/prompt", None),
        ("DISK/prefetched tok", None),
        ("prefetch sent/used tok", None),
        ("A landed blk", "A_prefetch_blocks_landed"),
        ("pred A queue ms", "pred_A_queue_ms"),
        ("R queued on A ms", "queue_ms"),
        ("A load ms", "load_ms"),
        ("pred A ms", "pred_A_ms"),
        ("pred at routing ms", "pred_header_ms"),
        ("TTFT via gw ms", "ttft_via_gateway_ms"),
        ("engine TTFT A ms", "engine_ttft_A_ms"),
        ("pred B ms", "pred_B_ms"),
        ("miss on B ms", "ttft_B_direct_ms"),
    ]
    numeric = [k for _, k in cols[5:] if k is not None]

    def cell(r: dict[str, Any], name: str, key: str | None) -> str:
        if name == "cached/prompt":
            return f"{r['cached_tokens']}/{r['prompt_tokens']}"
        if name == "DISK/prefetched tok":
            return f"{r['loaded_tokens']['DISK']}/{r['prefetched_tokens']}"
        if name == "prefetch sent/used tok":
            return f"{r['gw_prefetch_sent']:.0f}/{r['gw_prefetch_used_tokens']:.0f}"
        assert key is not None
        v = r[key]
        return f"{v:.0f}" if isinstance(v, float) else str(v)

    med = {k: statistics.median(r[k] for r in rows) for k in numeric}
    table = [[name for name, _ in cols]]
    table += [[cell(r, *c) for c in cols] for r in rows]
    table.append(["median", "", "", "", "", *[f"{med[k]:.0f}" for k in numeric]])
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    print()
    print(f"prefix {a.prefix_tokens} tokens + question {a.question_tokens}; {len(rows)} repetitions; the prefix "
          f"on worker A's DISK tier only; {a.queue_tokens} tokens ahead of R on A; B never saw it")
    for i, row in enumerate(table):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    speed = med["ttft_B_direct_ms"] / med["ttft_via_gateway_ms"] if med["ttft_via_gateway_ms"] else float("nan")
    print(f"\nrouted to A {sum(r['routed_to'] == 'A' for r in rows)}/{len(rows)}; "
          f"median TTFT via the gateway {med['ttft_via_gateway_ms']:.0f} ms vs {med['ttft_B_direct_ms']:.0f} ms "
          f"for a miss on B ({speed:.1f}x); prediction for A {med['pred_A_ms']:.0f} ms, "
          f"for B {med['pred_B_ms']:.0f} ms")


# ---------------------------------------------------------------------- processes and HTTP


class Proc:
    def __init__(self, name: str, proc: subprocess.Popen[str]) -> None:
        self.name = name
        self.proc = proc
        self.url = ""


def _spawn(cmd: list[str], env: dict[str, str] | None = None, out: Path | None = None) -> subprocess.Popen[str]:
    stdout: Any = subprocess.PIPE if out is None else open(out, "w")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen(cmd, cwd=str(ROOT), stdout=stdout, stderr=subprocess.STDOUT, text=True, env=env,
                         stdin=subprocess.DEVNULL)
    _CHILDREN.append(p)
    return p


def start_worker(name: str, a: argparse.Namespace, tmp: Path, token: str | None) -> Proc:
    cmd = [sys.executable, "-m", "workers.cli", "engine", "--port", "0", "--host", HOST, "--worker-id", name,
           "--threads", str(a.threads), "--num-blocks", str(a.gpu_blocks), "--max-num-batched-tokens", str(a.budget),
           "--cpu-bytes", str(a.cpu_blocks * BLOCK_BYTES), "--disk-dir", str(tmp / f"kv-{name}"),
           "--disk-admit-after", "1", "--disk-fsync", "never"]
    env = {k: v for k, v in os.environ.items() if k != "KVROUTE_PEER_TOKEN"}
    env["HF_HUB_OFFLINE"] = "1"
    if token is not None:
        env["KVROUTE_PEER_TOKEN"] = token
    return Proc(name, _spawn(cmd, env))


def wait_workers(procs: list[Proc], deadline: float) -> None:
    for w in procs:
        assert w.proc.stdout is not None
        for line in w.proc.stdout:
            check_time(deadline)
            if line.startswith("worker "):
                w.url = line.split("url=")[1].split()[0]
            if line.strip() == "ready":
                break
            if not line.startswith("worker "):
                sys.stdout.write(f"[{w.name}] {line}")
        if not w.url:
            raise SystemExit(f"worker {w.name} did not start (code {w.proc.poll()})")
        threading.Thread(target=_relay, args=(w,), daemon=True).start()  # a full pipe would block the worker


def _relay(w: Proc) -> None:
    assert w.proc.stdout is not None
    for line in w.proc.stdout:
        sys.stdout.write(f"[{w.name}] {line}")


def start_gateway(logs: Path, tmp: Path, workers: dict[str, str]) -> str:
    port = free_port(HOST)
    cfg = {
        "listen": {"host": HOST, "port": port},
        "models": [{"id": MODEL, "served_names": ["tiny"], "tokenizer": str(ROOT / "configs/assets/tiny-tokenizer"),
                    "profile": "tiny-cpu"}],
        "workers": [{"id": wid, "url": url, "kind": "kvroute"} for wid, url in workers.items()],
        "routing": {"policy": "kv_cost", "prefetch": {"enabled": True, "min_blocks": 1, "margin_s": 0.05}},
        "observability": {"log_level": "WARNING"},
        "pool": {"load_poll_interval_s": 0.1, "health_interval_s": 1.0},
    }
    path = tmp / "gateway.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    _spawn([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)], out=logs / "gateway.log")
    return f"http://{HOST}:{port}"


def wait_http(url: str, deadline: float) -> None:
    while True:
        check_time(deadline)
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        for p in _CHILDREN:
            if p.poll() is not None:
                raise SystemExit(f"a process exited (code {p.returncode}): {p.args!r}")
        time.sleep(0.2)


def wait_healthy(gw: str, deadline: float) -> None:
    while True:
        check_time(deadline)
        ws = get(gw + "/admin/workers")["workers"]
        if all(w["state"] == "healthy" and "prefetch" in w["capabilities"] for w in ws):
            return
        time.sleep(0.2)


def check_time(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise SystemExit("out of time (--max-seconds)")


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a streaming completion; the time to the first text chunk, the text, the usage, the
    worker that served it and the gateway's predicted TTFT for it (its headers; NaN without)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or HOST, u.port, timeout=120)
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", u.path, body=payload, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft = None
    text = ""
    usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("choices"):
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += ev["choices"][0].get("text") or ""
        if ev.get("usage"):
            usage = ev["usage"]
    conn.close()
    if ttft is None or usage is None:
        raise SystemExit(f"{url}: no token or no usage in the stream")
    pred = resp.getheader("x-kvroute-predicted-ttft-ms")
    return {"ttft_ms": 1000 * ttft, "text": text, "usage": usage, "worker": resp.getheader("x-kvroute-worker"),
            "predicted_ms": float(pred) if pred else float("nan")}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def metrics(base: str) -> dict[str, float]:
    """Prometheus text: each series' value, summed over labels, by metric name."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def stop_children() -> None:
    for p in _CHILDREN:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    end = time.monotonic() + 15
    for p in _CHILDREN:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)  # the finally clause stops the children
    sys.exit(main())
