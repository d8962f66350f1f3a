"""What one request's reply counts as, and a case's counters (docs/harden.md defines them).

Every request a case sends ends in exactly one column:

- answered: a 2xx with a complete, well-formed answer (a chat/completion body with its
  choice, or an SSE stream of well-formed chunks with content, a finish reason and
  `data: [DONE]`; other routes: a complete body, JSON where JSON is declared);
- refused: a complete 4xx in OpenAI's error shape (a 429 with `Retry-After`);
- 5xx relayed: a 502/503/504, or a stream ended by an explicit SSE error event, where the
  case says a worker's own failure could only be relayed (allowed);
- 5xx: any other 5xx, or an error event where a healthy worker could have served;
- hung: no complete answer before the case's deadline for that request;
- lost: nothing at all (the connection closed or was reset before a status line, or
  nothing listened), a body cut short (Content-Length not reached, no last chunk), or an
  SSE stream that ends without `[DONE]` and without an error event;
- wrong: a 2xx whose body is malformed or to a request that had to be refused, an error
  without OpenAI's shape or a 429 without `Retry-After`, or anything that leaks: another
  tenant's data, internal hosts and ports, worker ids, a client library's or Python's
  exception text, a retry that never happened.

Requests a case abandons on purpose (a client that leaves) are counted apart and are
not "sent"; what the case checks afterwards is.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .client import Reply, sse_events

ANSWERED = "answered"
REFUSED = "refused"
RELAYED = "5xx_relayed"
S5XX = "5xx"
HUNG = "hung"
LOST = "lost"
WRONG = "wrong"
ABANDONED = "abandoned"
COLUMNS = (ANSWERED, REFUSED, RELAYED, S5XX, HUNG, LOST, WRONG)

CHAT = "chat"
COMPLETION = "completion"
JSON = "json"
ANY = "any"

# A client library's or Python's own words in a message meant for a tenant.
_EXC_TEXT = re.compile(
    r"Traceback \(most recent call last\)|File \"/|\baiohttp\b|\bhttpx\b|\burllib3?\b|\bmsgspec\b|\bpydantic\b"
    r"|\bstarlette\b|\buvicorn\b|\[Errno -?\d+\]|\berrno\b|\b[A-Z][A-Za-z0-9]*(?:Error|Exception)\b"
    r"|\bServerDisconnected|\bClientConnector|\bClientPayload|\bCancelledError\b|<[a-z_.]+ object at 0x"
)
# The same, but only what no client input can put into a 4xx message it echoes.
_EXC_TEXT_4XX = re.compile(
    r"Traceback \(most recent call last\)|File \"/|\baiohttp\b|\bmsgspec\b|\bpydantic\b|\[Errno -?\d+\]"
    r"|\bServerDisconnected|\bClientConnector|\bClientPayload|<[a-z_.]+ object at 0x"
)
_HOST_TEXT = re.compile(r"\b127\.0\.0\.1\b|\blocalhost:\d+|https?://|\bipc://|\btcp://")
_RETRY_TEXT = re.compile(r"\bthe retry\b|\bretry (?:also )?failed\b|\bretried\b|\bretries failed\b", re.I)
_TRIED = re.compile(r"\b(\d+) workers? (?:were )?tried\b", re.I)


@dataclass
class Spec:
    """How to judge one request (set by the case that sends it)."""

    expect: str = ANY  # CHAT | COMPLETION | JSON | ANY: what a 2xx body must be
    stream: bool = False  # the client asked for a stream
    worker_fault: bool = False  # a worker's own failure may be relayed (5xx relayed, not 5xx)
    must_refuse: bool = False  # a 2xx is wrong (a request the gateway has to turn down)
    tenant_facing: bool = True  # error messages are checked for leaks
    single_worker: bool = False  # no retry was possible: a message claiming one is wrong
    secrets: tuple[str, ...] = ()  # must appear nowhere in the reply (other tenants' data, worker ids, ...)
    ok_statuses: tuple[int, ...] = ()  # 2xx/4xx statuses this request may get (empty: any)


@dataclass
class Outcome:
    category: str
    why: str
    status: int | None
    elapsed: float
    label: str = ""
    t_first: float | None = None
    data: Any = None  # the parsed JSON answer, when there is one
    text: str = ""  # the generated text of an answer
    error_message: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def error_message(obj: Any) -> str | None:
    """The `error.message` of an OpenAI-shaped error body, or None if it has not that shape."""
    if isinstance(obj, dict):
        e = obj.get("error")
        if isinstance(e, dict) and isinstance(e.get("message"), str):
            return str(e["message"])
    return None


def leak(message: str, spec: Spec, client_error: bool = False) -> str | None:
    """Why an error message a tenant reads leaks something (None: it does not).

    `client_error` (a 4xx, which may echo the client's own input): only the case's
    secrets and text no input can produce (tracebacks, library names) count."""
    for s in spec.secrets:
        if s and s in message:
            return f"names {s!r}"
    m = (_EXC_TEXT_4XX if client_error else _EXC_TEXT).search(message)
    if m:
        return f"carries exception/library text {m.group(0)!r}"
    m = None if client_error else _HOST_TEXT.search(message)
    if m:
        return f"names an internal address ({m.group(0)!r})"
    if spec.single_worker:
        m = _RETRY_TEXT.search(message)
        if m:
            return f"claims a retry that could not happen ({m.group(0)!r})"
        t = _TRIED.search(message)
        if t and int(t.group(1)) > 1:
            return f"claims {t.group(1)} workers were tried (there was one)"
    return None


def _decode(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return _BAD


_BAD = object()


def classify(rep: Reply, spec: Spec, label: str = "") -> Outcome:
    o = Outcome(LOST, "", rep.status, rep.elapsed, label, rep.t_first, headers=rep.headers)

    def done(cat: str, why: str) -> Outcome:
        o.category, o.why = cat, why
        return o

    if rep.abandoned:
        return done(ABANDONED, "the client left on purpose")
    if rep.timed_out:
        got = "nothing" if rep.status is None else f"status {rep.status}, {len(rep.body)} body bytes"
        return done(HUNG, f"no complete answer within {rep.elapsed:.1f} s (got {got})")
    if rep.status is None:
        return done(LOST, rep.error or "no response")
    if not rep.complete:
        return done(LOST, f"status {rep.status} but the body was cut short: {rep.error or 'incomplete'}")
    for s in spec.secrets:
        if s and s.encode() in rep.body:
            return done(WRONG, f"the reply carries {s!r}")
    st = rep.status
    if st >= 500:
        obj = _decode(rep.body)
        msg = error_message(obj)
        o.error_message = msg
        if msg is None:
            return done(WRONG, f"{st} without an OpenAI-shaped error body: {rep.body[:120]!r}")
        if spec.tenant_facing and (why := leak(msg, spec)):
            return done(WRONG, f"{st} message {why}: {msg[:160]!r}")
        if spec.worker_fault and st in (502, 503, 504):
            return done(RELAYED, f"{st} {msg[:100]}")
        return done(S5XX, f"{st} {msg[:160]}")
    if 400 <= st < 500:
        obj = _decode(rep.body)
        msg = error_message(obj)
        o.error_message = msg
        if msg is None:
            return done(WRONG, f"{st} without an OpenAI-shaped error body: {rep.body[:120]!r}")
        if st == 429 and not _retry_after_ok(rep.headers.get("retry-after")):
            return done(WRONG, "429 without a valid Retry-After header")
        if spec.tenant_facing and (why := leak(msg, spec, client_error=True)):
            return done(WRONG, f"{st} message {why}: {msg[:160]!r}")
        if spec.ok_statuses and st not in spec.ok_statuses:
            return done(WRONG, f"{st} where {spec.ok_statuses} was due: {msg[:120]}")
        return done(REFUSED, f"{st} {msg[:100]}")
    if not 200 <= st < 300:
        return done(WRONG, f"unexpected status {st}")
    if spec.must_refuse:
        return done(WRONG, f"{st}: accepted a request that had to be refused")
    if spec.ok_statuses and st not in spec.ok_statuses:
        return done(WRONG, f"{st} where {spec.ok_statuses} was due")
    if rep.sse:
        return _judge_stream(rep, spec, o, done)
    if spec.stream and spec.expect in (CHAT, COMPLETION):
        return done(WRONG, "asked for a stream, got a plain body")
    if spec.expect == ANY:
        return done(ANSWERED, f"{st}")
    obj = _decode(rep.body)
    if obj is _BAD:
        return done(WRONG, f"{st} body is not JSON: {rep.body[:120]!r}")
    o.data = obj
    if spec.expect == JSON:
        return done(ANSWERED, f"{st}")
    text = _choice_text(obj, spec.expect == CHAT)
    if text is None:
        return done(WRONG, f"{st} body is no {spec.expect} answer: {rep.body[:160]!r}")
    o.text = text
    return done(ANSWERED, f"{st}")


def _retry_after_ok(v: str | None) -> bool:
    if v is None:
        return False
    v = v.strip()
    if v.isdigit():
        return True
    return bool(re.match(r"^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$", v))


def _choice_text(obj: Any, chat: bool) -> str | None:
    if not isinstance(obj, dict):
        return None
    ch = obj.get("choices")
    if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
        return None
    c = ch[0]
    if chat:
        m = c.get("message")
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return None
        return str(m["content"])
    t = c.get("text")
    return t if isinstance(t, str) else None


def _judge_stream(rep: Reply, spec: Spec, o: Outcome, done: Callable[[str, str], Outcome]) -> Outcome:
    events, finished, after = sse_events(rep.body)
    text: list[str] = []
    finish = None
    for raw in events:
        obj = _decode(raw)
        msg = error_message(obj)
        if msg is not None:
            o.error_message = msg
            if spec.tenant_facing and (why := leak(msg, spec)):
                return done(WRONG, f"stream error event {why}: {msg[:160]!r}")
            if spec.worker_fault:
                return done(RELAYED, f"stream ended by an error event: {msg[:100]}")
            return done(S5XX, f"stream ended by an error event: {msg[:160]}")
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            return done(WRONG, f"a stream event is not a well-formed chunk: {raw[:120]!r}")
        for c in obj["choices"]:
            if not isinstance(c, dict):
                return done(WRONG, f"a stream choice is not an object: {raw[:120]!r}")
            piece = (c.get("delta") or {}).get("content") if spec.expect == CHAT else c.get("text")
            if isinstance(piece, str):
                text.append(piece)
            if c.get("finish_reason") is not None:
                finish = c["finish_reason"]
    if not finished:
        return done(LOST, f"the stream ended without [DONE] and without an error event ({len(events)} events)")
    if after:
        return done(WRONG, f"{after} events after [DONE]")
    if not spec.stream and spec.expect in (CHAT, COMPLETION):
        return done(WRONG, "a stream for a request that did not ask for one")
    if spec.expect in (CHAT, COMPLETION):
        if not text or finish is None:
            return done(WRONG, f"a stream without content or finish reason ({len(events)} events)")
    o.text = "".join(text)
    return done(ANSWERED, f"{rep.status} stream of {len(events)} events")


# ---------------------------------------------------------------------- a case's counters


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    timing: bool = False  # a bound on wall-clock time (scaled by the load): the report's, not a unit test's


@dataclass
class CaseResult:
    name: str
    summary: str = ""
    counts: dict[str, int] = field(default_factory=lambda: {c: 0 for c in (*COLUMNS, ABANDONED)})
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rss_mb: dict[str, float] = field(default_factory=dict)
    ready_s: list[float] = field(default_factory=list)  # each gateway's time from start to /ready 200
    seconds: float = 0.0
    error: str | None = None
    skipped: str | None = None

    @property
    def sent(self) -> int:
        return sum(self.counts[c] for c in COLUMNS)

    def add(self, o: Outcome) -> Outcome:
        self.counts[o.category] = self.counts.get(o.category, 0) + 1
        if o.category != ANSWERED:
            lst = self.samples.setdefault(o.category, [])
            if len(lst) < 6:
                lst.append({"label": o.label, "status": o.status, "why": o.why, "elapsed_s": round(o.elapsed, 3)})
        return o

    def check(self, name: str, ok: bool, detail: str = "", timing: bool = False) -> bool:
        self.checks.append(Check(name, bool(ok), detail, timing))
        return bool(ok)

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def verdict(self) -> str:
        return self.verdict_of(self.failed_checks)

    @property
    def functional_verdict(self) -> str:
        """The verdict without the timing checks (what the default test run judges: a
        loaded machine must not fail it; the report keeps the timing)."""
        return self.verdict_of([c for c in self.failed_checks if not c.timing])

    def verdict_of(self, failed: list[Check]) -> str:
        if self.skipped:
            return "SKIP"
        if self.error:
            return "ERROR"
        c = self.counts
        bad = c[S5XX] + c[HUNG] + c[LOST] + c[WRONG] + len(failed)
        return "FAIL" if bad else "PASS"

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.name, "summary": self.summary, "verdict": self.verdict, "sent": self.sent,
            "counts": dict(self.counts), "checks": [vars(c) for c in self.checks], "samples": self.samples,
            "notes": self.notes, "rss_mb": self.rss_mb, "gateway_ready_s": self.ready_s,
            "seconds": round(self.seconds, 2), "error": self.error,
            "skipped": self.skipped,
        }
