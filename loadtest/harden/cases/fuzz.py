"""Bodies nobody should send: JSON nested 1,000 (and 100,000) deep, schemathesis against
the gateway's own /openapi.json, and a mutation fuzzer over valid chat and completion
bodies (bit flips, truncation, deep nesting, huge numbers, wrong types, bad bytes).
None may get a 5xx, hang, or a malformed 2xx.
"""
from __future__ import annotations

import asyncio
import json
import random
import urllib.parse
from typing import Any

import msgspec

from ..config import SERVED
from ..outcome import ANY, CHAT, COMPLETION, Spec
from ..procs import GatewayProc
from ..runner import Ctx, Skip, case
from .common import CHAT_PATH, COMP_PATH, chat_body, comp_body, fleet, gather_limited


def _nest_array(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _nest_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def deep_bodies(depth: int) -> list[tuple[str, bytes]]:
    arr, obj = _nest_array(depth), _nest_object(depth)
    return [
        ("array", arr.encode()),
        ("object", obj.encode()),
        ("chat content", (f'{{"model": "{SERVED}", "messages": [{{"role": "user", "content": {arr}}}], '
                          '"max_tokens": 4}').encode()),
        ("completion prompt", f'{{"model": "{SERVED}", "prompt": {arr}, "max_tokens": 4}}'.encode()),
        ("stop", f'{{"model": "{SERVED}", "prompt": "hi", "stop": {obj}, "max_tokens": 4}}'.encode()),
    ]


GATEWAY_PATHS = (CHAT_PATH, COMP_PATH, "/tokenize", "/detokenize", "/v1/embeddings", "/admin/route/explain",
                 "/admin/workers")
WORKER_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/kv/prefetch", "/kv/purge",
                "/kv/blocks")


@case("deep_json", "JSON nested 1,000 and 100,000 deep to every gateway route with a body, and to a worker",
      small_s=60, full_s=120)
async def deep_json(ctx: Ctx) -> None:
    gw, sc, _ = await fleet(ctx, 1)
    assert sc is not None
    worker = sc.workers[0].url
    for depth in (1000, 100_000):
        for what, body in deep_bodies(depth):
            for path in GATEWAY_PATHS:
                await ctx.call(gw, "POST", path, body, timeout=15.0, label=f"gateway {path} {what} x{depth}",
                               spec=Spec(must_refuse=True, tenant_facing=path.startswith("/v1")))
            for path in WORKER_PATHS:
                await ctx.call(worker, "POST", path, body, timeout=15.0, label=f"worker {path} {what} x{depth}",
                               spec=Spec(must_refuse=True, tenant_facing=False))


# ---------------------------------------------------------------------- mutation fuzzer

_HUGE = ["1e999", "-1e999", "1e308", "123456789012345678901234567890", "-9223372036854775809",
         "18446744073709551616", "9223372036854775807", "4294967296", "-1", "0", "0.0000000001", "NaN", "Infinity"]
_WRONG: list[Any] = [None, [], {}, "", "x" * 10, 7, -3, 2.5, True, False, [None], {"a": [1]}, [[1, 2], [3]], "NaN"]
_FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
           "temperature", "top_p", "seed", "stop", "n", "cache_salt", "ignore_eos", "logprobs", "user", "tools")


def _bases() -> list[tuple[bool, dict[str, Any]]]:
    return [
        (True, chat_body("hello fuzz", max_tokens=4)),
        (True, chat_body("stream me", max_tokens=4, stream=True, usage=True)),
        (True, {"model": SERVED, "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": [{"type": "text", "text": "parts"}]}],
                "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 1, "stop": ["\n"]}),
        (False, comp_body("complete this", max_tokens=4)),
        (False, comp_body([1, 2, 3, 4, 5, 6, 7, 8] * 4, max_tokens=4, stream=True)),
        (False, comp_body("batch", max_tokens=2, n=1, cache_salt="s1", ignore_eos=True)),
    ]


def _pick_path(obj: Any, rng: random.Random) -> list[Any]:
    """A random path to a value inside obj (possibly the root)."""
    path: list[Any] = []
    cur = obj
    while isinstance(cur, (dict, list)) and cur and rng.random() < 0.75:
        k = rng.choice(list(cur)) if isinstance(cur, dict) else rng.randrange(len(cur))
        path.append(k)
        cur = cur[k]
    return path


def _set(obj: Any, path: list[Any], value: Any) -> Any:
    if not path:
        return value
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return obj


def mutate(rng: random.Random, chat: bool, base: dict[str, Any]) -> tuple[str, bytes]:
    """One mutated body: (what was done, the bytes)."""
    obj = json.loads(json.dumps(base))
    raw = json.dumps(obj).encode()
    op = rng.choice(("bitflip", "truncate", "nest", "huge", "wrongtype", "drop", "long", "bytes", "ids", "dupkey",
                     "shape"))
    if op == "bitflip":
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return op, bytes(b)
    if op == "truncate":
        return op, raw[: rng.randrange(len(raw))]
    if op == "nest":
        depth = rng.choice((64, 500, 1000, 5000, 50_000))
        marker = "__NEST__"
        path = _pick_path(obj, rng)
        text = json.dumps(_set(obj, path, marker))
        nested = _nest_array(depth) if rng.random() < 0.5 else _nest_object(depth)
        return f"{op}{depth}", text.replace(json.dumps(marker), nested, 1).encode()
    if op == "huge":
        field = rng.choice(("max_tokens", "temperature", "top_p", "seed", "n", "max_completion_tokens"))
        lit = rng.choice(_HUGE)
        obj[field] = "__HUGE__"
        return f"{op}:{field}={lit}", json.dumps(obj).replace('"__HUGE__"', lit).encode()
    if op == "wrongtype":
        field = rng.choice(_FIELDS)
        obj[field] = rng.choice(_WRONG)
        return f"{op}:{field}", json.dumps(obj).encode()
    if op == "drop":
        field = rng.choice([k for k in obj] or ["model"])
        obj.pop(field, None)
        return f"{op}:{field}", json.dumps(obj).encode()
    if op == "long":
        n = rng.choice((10_000, 200_000, 1_000_000))
        if chat:
            obj["messages"] = [{"role": "user", "content": "a " * (n // 2)}]
        elif rng.random() < 0.5:
            obj["prompt"] = "b " * (n // 2)
        else:
            obj["prompt"] = [rng.randrange(8192) for _ in range(n // 8)]
        if rng.random() < 0.3:
            obj["stop"] = ["x" * 1000] * 50
        return f"{op}{n}", json.dumps(obj).encode()
    if op == "bytes":
        b = bytearray(raw)
        junk = rng.choice((b"\xff\xfe", b"\x00", b"\xc3\x28", b"\xed\xa0\x80", b"\\ud800", b"\xef\xbb\xbf", b"\r\n"))
        i = rng.randrange(len(b))
        b[i:i] = junk
        return f"{op}:{junk!r}", bytes(b)
    if op == "ids":
        obj.pop("messages", None)
        obj["prompt"] = rng.choice(([-1], [2**32], [8192], [1.5], ["a"], [[1, 2], [3]], [None], [[]], [],
                                    [2**63, 1], list(range(9000))))
        return f"{op}", json.dumps(obj).encode()
    if op == "dupkey":
        text = json.dumps(obj)
        return op, (text[:-1] + ', "model": 12, "stream": "yes", "messages": null}').encode()
    # shape: the right fields at the wrong level
    return op, rng.choice((b"[]", b"null", b"\"text\"", b"12", b"", b" ", b"{}", b"[" + raw + b"]",
                           b'{"model": "' + SERVED.encode() + b'"}'))


def _spec_for(body: bytes, chat: bool) -> Spec:
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):  # not JSON, or nested past any sane depth
        try:  # Python's own parser takes NaN/Infinity: accepting those is lenient, not wrong
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return Spec(must_refuse=True)
    stream = isinstance(obj, dict) and obj.get("stream") is True
    return Spec(expect=CHAT if chat else COMPLETION, stream=stream)


@case("fuzz_mutation", "mutated chat/completion bodies (bit flips, truncation, nesting, huge numbers, wrong types)",
      small_s=150, full_s=900)
async def fuzz_mutation(ctx: Ctx) -> None:
    gw, _, _ = await fleet(ctx, 1)
    rng = random.Random(20261201)
    bases = _bases()
    n = ctx.pick(200, 3000)
    jobs = []
    for i in range(n):
        chat, base = bases[i % len(bases)]
        what, body = mutate(rng, chat, base)
        path = CHAT_PATH if chat else COMP_PATH
        if i % 10 == 9:  # some go to the other routes that take a completion body
            path = rng.choice(("/admin/route/explain", "/tokenize"))
        jobs.append((path, what, body, chat))

    async def one(i: int) -> None:
        path, what, body, chat = jobs[i]
        spec = _spec_for(body, chat) if path.startswith("/v1") else Spec(
            expect=ANY, tenant_facing=False, must_refuse=_spec_for(body, chat).must_refuse)
        await ctx.call(gw, "POST", path, body, spec=spec, timeout=20.0, label=f"{path} {what} #{i}")

    await gather_limited(len(jobs), 4, one)


# ---------------------------------------------------------------------- schemathesis


@case("fuzz_schemathesis", "schemathesis (positive and negative examples) against the gateway's /openapi.json",
      small_s=200, full_s=1200)
async def fuzz_schemathesis(ctx: Ctx) -> None:
    try:
        import schemathesis
        from hypothesis import HealthCheck, given, settings
        from schemathesis import GenerationMode
    except ImportError as e:
        raise Skip(f"schemathesis is not installed ({e}); `pip install schemathesis` to run this case") from None
    admin = f"adm-harden-{ctx.tag}"
    gw, _, _ = await fleet(ctx, 1, admin_token=admin)
    doc = await ctx.json(gw, "/openapi.json")
    if not isinstance(doc, dict):
        ctx.check("/openapi.json is served", False, "no JSON document")
        return
    schema = schemathesis.openapi.from_dict(doc)
    ctx.log("schema loaded")
    per_op = ctx.pick(6, 60)
    cases: list[tuple[str, str, dict[str, str], bytes | None, str]] = []
    for res in schema.get_all_operations():
        try:
            op = res.ok()  # type: ignore[union-attr]
        except Exception as e:  # an operation schemathesis cannot read is a finding of its own
            ctx.note(f"schemathesis could not load an operation: {e}")
            continue
        # negative examples exist only where there is a body or a query to get wrong
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(op.body) or len(op.query) else [])
        for mode in modes:
            got: list[Any] = []
            collect = _collector(given(op.as_strategy(generation_mode=mode)),
                                 settings(max_examples=per_op, deadline=None, database=None, derandomize=True,
                                          suppress_health_check=list(HealthCheck)), got)
            try:
                await asyncio.to_thread(collect)
            except Exception as e:  # e.g. no negative example exists for an operation without inputs
                ctx.log(f"{op.method} {op.path} {mode.value}: no examples ({type(e).__name__}: {e})")
            for c in got[:per_op]:
                cases.append(_to_request(c, gw, mode.value, admin))
    ctx.log(f"{len(cases)} examples generated")
    n_paths = len(doc.get("paths", {}))
    covered = {c[4].split(" ", 2)[2] for c in cases}
    ctx.note(f"{len(cases)} examples over {len(covered)} of {n_paths} paths")
    ctx.check("schemathesis generated examples for every path", len(covered) >= n_paths,
              f"examples for {len(covered)} of {n_paths} paths (case.log says why)")

    async def one(i: int) -> None:
        method, target, headers, body, label = cases[i]
        tenant = target.startswith("/v1")
        await ctx.call(gw, method, target, body, headers=headers, timeout=20.0, label=label,
                       spec=Spec(expect=ANY, tenant_facing=tenant))

    await gather_limited(len(cases), 4, one)
    ctx.log("examples sent")


def _collector(given_: Any, settings_: Any, got: list[Any]) -> Any:
    """A hypothesis test function that only collects the generated cases."""
    def collect(c: Any) -> None:
        got.append(c)

    return settings_(given_(collect))


def _to_request(c: Any, gw: GatewayProc, mode: str, admin: str) -> tuple[str, str, dict[str, str], bytes | None, str]:
    kw = c.as_transport_kwargs(base_url=gw.url)
    url = urllib.parse.urlsplit(kw["url"])
    target = url.path or "/"
    params = kw.get("params") or {}
    if params:
        target += "?" + urllib.parse.urlencode(params, doseq=True)
    elif url.query:
        target += "?" + url.query
    headers = {str(k): str(v) for k, v in (kw.get("headers") or {}).items()
               if k.lower() not in ("connection", "accept-encoding", "content-length", "host")}
    if target.startswith("/admin"):
        headers["Authorization"] = f"Bearer {admin}"
    body: bytes | None = None
    if "json" in kw:
        try:
            body = json.dumps(kw["json"]).encode()
        except (TypeError, ValueError):
            body = repr(kw["json"]).encode("utf-8", "surrogatepass")
        headers.setdefault("Content-Type", "application/json")
    elif kw.get("data") is not None:
        d = kw["data"]
        body = d if isinstance(d, bytes) else str(d).encode("utf-8", "surrogatepass")
    return str(kw["method"]), target, headers, body, f"{mode} {kw['method']} {url.path}"
