"""Probe a real vLLM (CPU build, tiny random Llama) and record what docs/vllm.md states.

Why: the gateway must pass every vLLM request field through and read vLLM's KV events as
they really are on the wire; this script asks a real server instead of trusting vLLM's
docs. It writes, for the installed vLLM version V:

- tests/data/vllm/request-fields-V.json: every field of vLLM's ChatCompletionRequest and
  CompletionRequest (name, type, default), read from the installed package;
- tests/data/vllm/events-V.msgpack: the raw multipart frames a scripted request sequence
  produced on the events socket (with evictions and a cache reset), and the replay socket's
  raw answers (format in tests/data/vllm/README.md);
- a JSON report of the API answers (--report; default kvroute-vllm-probe.json in the system's
  temporary directory, not the checkout).

Run (two servers, ~3-4 min with the vLLM venv cached):

    .venv/bin/python scripts/vllm_probe.py [--report FILE.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
import vllm_harness as vh  # noqa: E402

DATA = ROOT / "tests" / "data" / "vllm"
# Run inside the vLLM venv: pydantic field list -> JSON rows with readable type names.
FIELDS_SNIPPET = r'''
import json, types, typing
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from pydantic_core import PydanticUndefined

def fmt(t):
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return fmt(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(fmt(a) for a in args)
    if origin is typing.Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin).replace("typing.", ""))
        return name + "[" + ", ".join(fmt(a) for a in args) + "]" if args else name
    if t is type(None):
        return "None"
    return getattr(t, "__name__", str(t).replace("typing.", ""))

def default(f):
    if f.is_required():
        return "(required)"
    if f.default_factory is not None:
        if f.default_factory in (list, dict, set, tuple):
            return repr(f.default_factory())
        return "(generated per request)"
    return "None" if f.default is PydanticUndefined else repr(f.default)

out = {}
for cls in (ChatCompletionRequest, CompletionRequest):
    out[cls.__name__] = {"module": cls.__module__, "extra": cls.model_config.get("extra"), "fields": [
        {"name": n, "alias": f.alias, "type": fmt(f.annotation), "default": default(f)}
        for n, f in cls.model_fields.items()]}
print(json.dumps(out))
'''

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}]
CHAT = [{"role": "user", "content": "Give me a JSON object describing a cat."}]


def request_fields(python: Path) -> dict[str, Any]:
    r = subprocess.run([str(python), "-c", FIELDS_SNIPPET], capture_output=True, text=True, timeout=300,
                       env=vh.server_env(vh.ServerOptions()))
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    fields: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return fields


def post_raw(url: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
        return True
    except ValueError:
        return False


def probe_api(url: str) -> dict[str, Any]:
    """The answers docs/vllm.md describes, keyed by what was asked."""
    chat, comp, m = url + "/v1/chat/completions", url + "/v1/completions", vh.SERVED_NAME
    out: dict[str, Any] = {}
    for path in ("/v1/models", "/version", "/load", "/kv_event_sources"):
        out[path] = vh.get_json(url + path)
    out["/tokenize text"] = vh.post_json(url + "/tokenize", {"model": m, "prompt": "Hello world"})
    out["/tokenize chat"] = vh.post_json(url + "/tokenize", {"model": m, "messages": CHAT})
    out["/detokenize"] = vh.post_json(url + "/detokenize", {"model": m, "tokens": [1, 42, 615, 2]})
    out["/v1/embeddings"] = post_raw(url + "/v1/embeddings", {"model": m, "input": "hi"})
    out["/reset_prefix_cache (no dev mode)"] = post_raw(url + "/reset_prefix_cache", {})
    base = {"model": m, "messages": CHAT, "temperature": 0}
    plain = vh.post_json(chat, {**base, "max_tokens": 40})
    out["plain (no constraint)"] = {"answer": plain, "parses": is_json(_content(plain))}
    for seed in range(4):
        r = vh.post_json(chat, {**base, "max_tokens": 100, "temperature": 1.0, "seed": seed,
                                "response_format": {"type": "json_object"}})
        out[f"json_object seed={seed} T=1"] = {"content": _content(r), "parses": is_json(_content(r)),
                                               "finish_reason": r["choices"][0]["finish_reason"]}
    r = vh.post_json(chat, {**base, "max_tokens": 100, "response_format": {"type": "json_object"}})
    out["json_object T=0"] = {"answer": r, "parses": is_json(_content(r))}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = vh.post_json(chat, {**base, "max_tokens": 100,
                            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    out["json_schema"] = {"content": _content(r), "parses": is_json(_content(r))}
    out["n=2"] = vh.post_json(chat, {**base, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 1})
    out["chat logprobs top_logprobs=2"] = vh.post_json(chat, {**base, "max_tokens": 2, "logprobs": True,
                                                              "top_logprobs": 2})
    out["chat echo"] = vh.post_json(chat, {**base, "max_tokens": 2, "echo": True})
    out["completion logprobs=2 echo"] = vh.post_json(comp, {"model": m, "prompt": "Hello world", "max_tokens": 2,
                                                            "logprobs": 2, "echo": True, "temperature": 0})
    out["completion n=2"] = vh.post_json(comp, {"model": m, "prompt": "Hello", "max_tokens": 3, "n": 2, "seed": 5})
    loose = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": False}}]  # type: ignore[dict-item]
    for tools, name in ((TOOLS, "strict"), (loose, "not strict")):
        for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
            r = vh.post_json(chat, {**base, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                                    "max_tokens": 400, "tools": tools, "tool_choice": choice})
            out[f"tools ({name}) tool_choice={json.dumps(choice)}"] = {
                "choice": r["choices"][0], "usage": r["usage"]}
    out["chat stream include_usage"] = post_raw(chat, {**base, "max_tokens": 3, "stream": True,
                                                      "stream_options": {"include_usage": True}})[1]
    out["completion stream include_usage+continuous"] = post_raw(comp, {
        "model": m, "prompt": "Hi", "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})[1]
    out["unknown field"] = post_raw(comp, {"model": m, "prompt": "Hi", "max_tokens": 1, "no_such_field": 1})
    long_prompt = " ".join(f"word{i}" for i in range(600))
    for i in range(2):
        t0 = time.monotonic()
        r = vh.post_json(comp, {"model": m, "prompt": long_prompt, "max_tokens": 1})
        out[f"long prompt #{i}"] = {"usage": r["usage"], "seconds": round(time.monotonic() - t0, 3)}
    return out


def _content(answer: dict[str, Any]) -> str | None:
    content: str | None = answer["choices"][0]["message"]["content"]
    return content


def record_events(server: vh.VllmServer) -> dict[str, Any]:
    """The scripted sequence on a server with a tiny KV pool (17 blocks of 32 tokens, one of
    them vLLM's null block): store, hit, extend, evict (three other prompts), salted store,
    chat, reset. Returns every frame, live and replayed."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = vh.subscribe(ctx, server.events_endpoint)
    time.sleep(1.0)
    comp, m = server.url + "/v1/completions", vh.SERVED_NAME
    prompt = [[100 + (i * 7 + k) % 8000 for i in range(200)] for k in range(5)]
    steps: list[tuple[str, dict[str, Any] | None]] = [
        ("A: 200 tokens (6 full blocks)", {"prompt": prompt[0]}),
        ("A again: prefix hit", {"prompt": prompt[0]}),
        ("A + 64 tokens: the chain grows", {"prompt": prompt[0] + prompt[1][:64]}),
        ("B: other 200 tokens", {"prompt": prompt[2]}),
        ("C: other 200 tokens (pool full: evictions)", {"prompt": prompt[3]}),
        ("D: other 200 tokens (evictions)", {"prompt": prompt[4]}),
        ("A with cache_salt 's1'", {"prompt": prompt[0], "cache_salt": "s1"}),
        ("a chat request (ChatML, 4 full blocks)", None),
    ]
    recorded: list[dict[str, Any]] = []
    for label, body in steps:
        if body is None:
            vh.post_json(server.url + "/v1/chat/completions", {"model": m, "max_tokens": 2, "messages": [
                {"role": "system", "content": "You are terse. " * 6}, {"role": "user", "content": "Hello! " * 20}]})
        else:
            vh.post_json(comp, {"model": m, "max_tokens": 2, "temperature": 0, **body})
        recorded.append({"step": label, "frames": vh.drain(sub)})
    reset = post_raw(server.url + "/reset_prefix_cache", {})
    recorded.append({"step": f"POST /reset_prefix_cache -> {reset[0]}", "frames": vh.drain(sub)})
    # vLLM hands events to the publisher only when the scheduler steps: the reset's
    # AllBlocksCleared goes out with the next request's events.
    vh.post_json(comp, {"model": m, "max_tokens": 2, "temperature": 0, "prompt": prompt[0]})
    recorded.append({"step": "A after the reset", "frames": vh.drain(sub)})
    replays = {"from 0": vh.replay(ctx, server.replay_endpoint, 0),
               "from 3": vh.replay(ctx, server.replay_endpoint, 3),
               "from 10**6": vh.replay(ctx, server.replay_endpoint, 10**6)}
    sub.close()
    ctx.term()
    return {"steps": recorded, "replay": replays}


def decode_summary(rec: dict[str, Any]) -> list[str]:
    """One line per event, through the project's own decoder (what the index will see)."""
    from kvindex.events import BlockStored, EventDecoder

    dec, lines = EventDecoder(), []
    for step in rec["steps"]:
        lines.append(f"# {step['step']}")
        for topic, seq, payload in step["frames"]:
            batch = dec.decode(payload)
            for ev in batch.events:
                name = type(ev).__name__
                hashes = getattr(ev, "block_hashes", [])
                detail = ""
                if isinstance(ev, BlockStored):
                    detail = (f" parent={ev.parent_block_hash!r} tokens={len(ev.token_ids)}"
                              f" extra_keys={ev.extra_keys} medium={ev.medium}")
                lines.append(f"seq={int.from_bytes(seq, 'big')} topic={topic!r} {name} n={len(hashes)}{detail}"
                             + (f" errors={batch.errors}" if batch.errors else ""))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", type=Path, default=Path(tempfile.gettempdir()) / "kvroute-vllm-probe.json")
    args = ap.parse_args()
    python = vh.ensure_vllm_venv()
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, env=vh.server_env(vh.ServerOptions())).stdout.strip().splitlines()[-1]
    DATA.mkdir(parents=True, exist_ok=True)
    fields = request_fields(python)
    (DATA / f"request-fields-{version}.json").write_text(json.dumps(fields, indent=1) + "\n")
    report: dict[str, Any] = {"vllm_version": version}
    with tempfile.TemporaryDirectory(prefix="vllm-probe-") as tmp:
        model = vh.tiny_model_folder(Path(tmp) / "model")
        full = vh.ServerOptions()
        small = vh.ServerOptions(num_blocks=17, max_model_len=512, prompt_tokens_details=False, dev_mode=True,
                                 tool_parser=None)
        t0 = time.monotonic()
        a = vh.start_server(python, model, Path(tmp) / "logs", "full", full)
        b = vh.start_server(python, model, Path(tmp) / "logs", "small", small)
        try:
            vh.wait_healthy([a], 400)
            report["startup_s_full"] = round(time.monotonic() - t0, 1)
            vh.wait_healthy([b], 400)
            report["startup_s_both"] = round(time.monotonic() - t0, 1)
            report["command_full"] = vh.server_command(python, model, a.port, a.events_port, a.replay_port, full)
            report["command_small"] = vh.server_command(python, model, b.port, b.events_port, b.replay_port, small)
            report["api"] = probe_api(a.url)
            rec = record_events(b)
            long_prompt = " ".join(f"word{i}" for i in range(120))
            report["small: cached_tokens without --enable-prompt-tokens-details"] = [
                vh.post_json(b.url + "/v1/completions", {"model": vh.SERVED_NAME, "prompt": long_prompt,
                                                         "max_tokens": 1})["usage"] for _ in range(2)]
            for choice in ("auto", "required"):
                report[f"small (no tool parser): tools, tool_choice={choice}"] = post_raw(
                    b.url + "/v1/chat/completions", {"model": vh.SERVED_NAME, "max_tokens": 2, "tools": TOOLS,
                                                     "tool_choice": choice, "messages": CHAT})
            report["log_tail_small"] = b.log_tail(60)
        finally:
            vh.stop_server(a)
            vh.stop_server(b)
    # the recording is committed: no paths of the machine that made it
    command = ["python" if i == 0 else "MODEL_DIR" if c == str(model) else c
               for i, c in enumerate(report["command_small"])]
    payload = {"vllm_version": version, "command": command, **rec}
    (DATA / f"events-{version}.msgpack").write_bytes(msgspec.msgpack.encode(payload))
    report["events_decoded"] = decode_summary(rec)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1, default=repr) + "\n")
    print("\n".join(report["events_decoded"]))
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
