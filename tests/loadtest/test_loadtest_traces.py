"""Trace parsers, the sharing model, token synthesis and its sharing-exactness property."""
from __future__ import annotations

import io
import itertools
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.keys import BlockHasher, Namespace
from loadtest import tracefiles
from loadtest.azure import parse_azure
from loadtest.blockkeys import TraceKeyer
from loadtest.burstgpt import parse_burstgpt
from loadtest.mooncake import dump_mooncake, parse_mooncake
from loadtest.sharing import SharingModel
from loadtest.tokens import TokenSynth
from loadtest.trace import Trace, TraceError, TraceRequest
from loadtest.tracefiles import ENV, find_trace, require_trace
from loadtest.traces import detect_format, load_trace

# The slices shipped in tests/data/traces/ (first 339 Mooncake requests, first 200 Azure ones);
# the full files come from $LOADTEST_TRACES, for the slow tests only.
MOONCAKE = tracefiles.MOONCAKE_SLICE
AZURE = tracefiles.AZURE_SLICE


def _full(name: str) -> Path:
    """The full public trace from $LOADTEST_TRACES, or a skip that says so."""
    p = find_trace(name)
    if p is None:
        pytest.skip(f"needs the full trace {name}: set {ENV} to the folder holding it "
                    "(see README.md, Replaying traces)")
    return p


def test_a_missing_full_trace_is_one_line_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as e:
        require_trace(tracefiles.MOONCAKE, environ={})
    assert f"${ENV} is not set" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TraceError, match=f"{ENV}.*has no {tracefiles.AZURE}"):
        require_trace(tracefiles.AZURE, environ={ENV: str(tmp_path)})
    (tmp_path / tracefiles.AZURE).write_text("x")
    assert require_trace(tracefiles.AZURE, environ={ENV: str(tmp_path)}) == tmp_path / tracefiles.AZURE


# --------------------------------------------------------------------------- Mooncake


def test_mooncake_parse_and_roundtrip() -> None:
    lines = [
        '{"timestamp": 1000, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}',
        '{"timestamp": 4000, "input_length": 600, "output_length": 0, "hash_ids": [0, 2], "extra": "ignored"}',
    ]
    t = parse_mooncake(lines)
    assert [r.arrival_s for r in t.requests] == [0.0, 3.0]
    assert t.requests[1].output_length == 1  # 0-token outputs become 1
    assert t.requests[0].hash_ids == (0, 1)
    buf = io.BytesIO()
    dump_mooncake(t, buf)
    t2 = parse_mooncake(buf.getvalue().splitlines())
    assert [(r.arrival_s, r.input_length, r.hash_ids) for r in t2.requests] == [
        (r.arrival_s, r.input_length, r.hash_ids) for r in t.requests
    ]


@pytest.mark.parametrize(
    "line, msg",
    [
        ('{"timestamp": 0, "input_length": 1000, "output_length": 5}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0]}', "expected 2"),
        ("not json", "not JSON"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}', "input_length"),
    ],
)
def test_mooncake_bad_lines_name_the_line(line: str, msg: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}'
    with pytest.raises(TraceError) as e:
        parse_mooncake([good, line], source="x.jsonl")
    assert "x.jsonl:2" in str(e.value) and msg in str(e.value)


def test_mooncake_lines_out_of_order_are_sorted() -> None:
    a = '{"timestamp": 5000, "input_length": 10, "output_length": 5, "hash_ids": [0]}'
    b = '{"timestamp": 4000, "input_length": 10, "output_length": 5, "hash_ids": [1]}'
    t = parse_mooncake([a, b])
    assert [r.hash_ids for r in t.requests] == [(1,), (0,)] and [r.arrival_s for r in t.requests] == [0.0, 1.0]
    assert any("sorted" in n for n in t.notes)


def test_reads_the_gateways_recordings(tmp_path: Path) -> None:
    """Our own recorded traces (router/telemetry/recorder.py, salted ids, completion order) load and
    keep their sharing: two prompts sharing 1,024 tokens share their first two ids."""
    from array import array

    from router.telemetry.recorder import TraceRecorder

    ns = Namespace("m", block_size=16)
    rec = TraceRecorder(tmp_path / "rec.jsonl", salt="s", block_tokens=512)
    common = list(range(1000, 2024))
    p1 = array("I", common + list(range(5000, 5300)))
    p2 = array("I", common + list(range(7000, 7700)))
    rec.record(rec._t0 + 2.0, p2, ns, 10)  # finished first, arrived later
    rec.record(rec._t0 + 1.0, p1, ns, 20)
    rec.close()
    t = load_trace(tmp_path / "rec.jsonl")
    t.validate()
    a, b = t.requests
    assert (a.input_length, b.input_length) == (1324, 1724) and b.arrival_s == pytest.approx(1.0)
    assert a.hash_ids[:2] == b.hash_ids[:2] and a.hash_ids[2] != b.hash_ids[2]
    synth = TokenSynth.for_trace(t)
    keys = TraceKeyer(synth, ns)
    assert _shared(keys.keys(a), keys.keys(b)) == 1024 // 16


def test_mooncake_slice() -> None:
    t = load_trace(MOONCAKE)
    assert len(t) == 339 and t.block_tokens == 512
    t.validate()
    s = t.stats()
    assert s.span_s == pytest.approx(117.0)
    assert 0.05 < s.ideal_block_reuse < 0.20  # the first two minutes: the cache is still filling
    assert TokenSynth.for_trace(t).overflow_parents == 0


@pytest.mark.slow
def test_real_mooncake_trace() -> None:
    path = _full(tracefiles.MOONCAKE)
    t = load_trace(path)
    assert len(t) == 5606 and t.block_tokens == 512
    t.validate()
    s = t.stats()
    assert s.span_s == pytest.approx(1767.0)
    assert 0.30 < s.ideal_block_reuse < 0.40
    synth = TokenSynth.for_trace(t)
    assert synth.overflow_parents == 0
    cut = MOONCAKE.read_bytes()
    assert path.read_bytes()[: len(cut)] == cut  # the shipped slice is the file's first lines


def test_window_and_scale() -> None:
    t = load_trace(MOONCAKE)
    w = t.window(start_s=60, duration_s=30)
    assert w.requests[0].arrival_s == 0.0 and w.requests[-1].arrival_s < 30
    assert [r.index for r in w.requests] == list(range(len(w)))
    assert len(t.window(limit=7)) == 7
    s = w.scaled(2.0)
    assert s.requests[-1].arrival_s == pytest.approx(w.requests[-1].arrival_s / 2)
    with pytest.raises(TraceError):
        t.scaled(0)
    with pytest.raises(TraceError):
        t.window(limit=0)


# --------------------------------------------------------------------------- Azure


def test_azure_parse_with_and_without_sharing() -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
        f"2023-11-16 18:15:{10 + i:02d}.5000000,{200 + 50 * i},{10 + i}" for i in range(30)
    ]
    t = parse_azure(rows, sharing=None)
    assert len(t) == 30 and t.requests[1].arrival_s == pytest.approx(1.0)
    t.validate()
    assert len({h for r in t.requests for h in r.hash_ids}) == sum(len(r.hash_ids) for r in t.requests)
    shared = parse_azure(rows, sharing=SharingModel(seed=3, followup_prob=0.5, system_prob=1.0))
    shared.validate()
    assert shared.stats().ideal_block_reuse > 0.2
    assert "sharing model" in shared.sharing and shared.notes
    # seeded: the same model gives the same ids
    again = parse_azure(rows, sharing=SharingModel(seed=3, followup_prob=0.5, system_prob=1.0))
    assert [r.hash_ids for r in again.requests] == [r.hash_ids for r in shared.requests]


def test_azure_bad_input() -> None:
    with pytest.raises(TraceError, match="header"):
        parse_azure(["a,b,c", "1,2,3"])
    with pytest.raises(TraceError, match=":2"):
        parse_azure(["TIMESTAMP,ContextTokens,GeneratedTokens", "yesterday,1,2"])


def test_azure_slice() -> None:
    t = load_trace(AZURE)
    assert len(t) == 200 and t.span_s == pytest.approx(61.2635, abs=1e-3)
    t.validate()
    assert detect_format(AZURE) == "azure"


@pytest.mark.slow
def test_real_azure_trace() -> None:
    path = _full(tracefiles.AZURE)
    t = load_trace(path)
    assert len(t) == 19366 and t.span_s == pytest.approx(3501.72, abs=0.01)
    t.validate()
    assert detect_format(path) == "azure"
    cut = AZURE.read_bytes()
    assert path.read_bytes()[: len(cut)] == cut  # the shipped slice is the file's first lines


def test_followups_extend_the_previous_prompt() -> None:
    model = SharingModel(seed=1, followup_prob=1.0, system_prob=0.0, block_tokens=16)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
        f"2023-11-16 18:00:{i:02d}.0,{100 * (i + 1)},5" for i in range(10)
    ]
    t = parse_azure(rows, sharing=model)
    for prev, cur in itertools.pairwise(t.requests):
        assert cur.hash_ids[: len(prev.hash_ids)] == prev.hash_ids


# --------------------------------------------------------------------------- BurstGPT

BURST_V3 = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Session ID,Elapsed time
5,ChatGPT,300,40,340,Conversation log,s1,1.2
7,GPT-4,500,0,500,Conversation log,s2,0.3
9,ChatGPT,0,10,10,API log,,0.1
12,ChatGPT,700,60,760,Conversation log,s1,2.0
15,GPT-4,200,20,220,API log,,0.4
18,ChatGPT,900,30,930,Conversation log,s1,1.0
"""


def test_burstgpt_fixture_sessions_and_filters(tmp_path: Path) -> None:
    p = tmp_path / "burst.csv"
    p.write_text(BURST_V3)
    assert detect_format(p) == "burstgpt"
    t = load_trace(p, sharing=SharingModel(system_prob=0.0, followup_prob=0.0))
    assert len(t) == 4  # the failed rows (0 response / 0 request tokens) are skipped
    assert t.requests[0].arrival_s == 0.0 and t.requests[-1].arrival_s == 13.0
    assert any("skipped 2 failed" in n for n in t.notes)
    s1 = [r for r in t.requests if r.session == "s1"]
    assert len(s1) == 3
    for prev, cur in itertools.pairwise(s1):  # session turns extend each other
        assert cur.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
    only = parse_burstgpt(io.StringIO(BURST_V3), model="ChatGPT", log_type="Conversation log")
    assert [r.input_length for r in only.requests] == [300, 700, 900]
    assert all(r.model == "ChatGPT" for r in only.requests)


def test_burstgpt_without_sessions_and_bad_rows() -> None:
    v1 = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,100,10,110,API log\n"
    t = parse_burstgpt(io.StringIO(v1))
    assert len(t) == 1 and t.requests[0].session is None
    with pytest.raises(TraceError, match="header lacks"):
        parse_burstgpt(io.StringIO("Timestamp,Model\n1,x\n"))
    with pytest.raises(TraceError, match=":2"):
        parse_burstgpt(io.StringIO(v1.replace("100", "lots")))


def test_unknown_format(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(p)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- tokens


def test_token_synthesis_basics() -> None:
    synth = TokenSynth(512, vocab_size=8192, seed=5)
    a = synth.block(42)
    assert a.shape == (512,) and a.min() >= 16 and a.max() < 8192
    assert (synth.block(42) == a).all()
    assert not (synth.block(43) == a).all()
    req = TraceRequest(0, 0.0, 700, 5, (42, 7))
    toks = synth.tokens(req)
    assert len(toks) == 700 and (toks[:512] == a).all() and (toks[512:] == synth.block(7)[:188]).all()
    assert synth.token_bytes(req) == toks.astype("<u4").tobytes()
    with pytest.raises(TraceError):
        synth.tokens(TraceRequest(0, 0.0, 1100, 5, (1, 2)))
    with pytest.raises(TraceError):
        TokenSynth(16, vocab_size=17)


def test_overflow_parents_counted() -> None:
    reqs = [TraceRequest(i, 0.0, 16, 1, (0, 100 + i)) for i in range(30)]
    t = Trace("t", 8, reqs)
    synth = TokenSynth.for_trace(t, vocab_size=36, reserved=16)  # 20 ids per position
    assert synth.overflow_parents == 1


def _trace_lcp(a: TraceRequest, b: TraceRequest, bt: int) -> int:
    j = 0
    for x, y in zip(a.hash_ids, b.hash_ids, strict=False):
        if x != y:
            break
        j += 1
    if j < min(len(a.hash_ids), len(b.hash_ids)):
        return j * bt
    return min(a.input_length, b.input_length)


def _shared(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _check_exact(trace: Trace, synth: TokenSynth, block_sizes: tuple[int, ...]) -> None:
    for B in block_sizes:
        keyer = TraceKeyer(synth, Namespace("m", block_size=B))
        keys = [keyer.keys(r) for r in trace.requests]
        for a, b in itertools.combinations(trace.requests, 2):
            want = _trace_lcp(a, b, trace.block_tokens) // B
            assert _shared(keys[a.index], keys[b.index]) == want, (B, a, b)


@st.composite
def prefix_tree_traces(draw: st.DrawFn) -> Trace:
    bt = draw(st.sampled_from([8, 16, 512]))
    n = draw(st.integers(2, 10))
    rng = random.Random(draw(st.integers(0, 2**31)))
    next_id = 0
    reqs: list[TraceRequest] = []
    for i in range(n):
        if reqs and rng.random() < 0.7:
            base = rng.choice(reqs)
            keep = rng.randint(0, len(base.hash_ids))
            ids = list(base.hash_ids[:keep])
            # reusing a parent's partial last block keeps it a prefix: only full blocks are kept
            if keep and keep == len(base.hash_ids) and base.input_length % bt:
                ids = ids[:-1]
        else:
            ids = []
        extra = rng.randint(0 if ids else 1, 5)
        ids += list(range(next_id, next_id + extra))
        next_id += extra
        if not ids:
            ids = [next_id]
            next_id += 1
        length = (len(ids) - 1) * bt + rng.randint(1, bt)
        reqs.append(TraceRequest(i, float(i), length, 1, tuple(ids)))
    return Trace("prop", bt, reqs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix_tree_traces(), st.integers(0, 1000))
def test_sharing_is_exact_at_any_fleet_block_size(trace: Trace, seed: int) -> None:
    # A tiny vocabulary makes accidental equal tokens likely: only the sibling
    # discriminator can keep the sharing exact.
    synth = TokenSynth.for_trace(trace, vocab_size=40, reserved=16, seed=seed)
    assert synth.overflow_parents == 0
    _check_exact(trace, synth, (1, 3, 8, 16, 48, 64, 512, 1024))


def test_sharing_is_exact_on_the_real_trace() -> None:
    t = load_trace(MOONCAKE).window(limit=120)
    _check_exact(t, TokenSynth.for_trace(load_trace(MOONCAKE)), (16, 48, 64))


def test_keyer_matches_the_gateways_keys_with_salt_and_lora() -> None:
    t = load_trace(MOONCAKE).window(limit=20)
    synth = TokenSynth.for_trace(t)
    for B in (16, 48, 1024):
        ns = Namespace("m", block_size=B)
        keyer = TraceKeyer(synth, ns)
        h = BlockHasher.for_namespace(ns)
        for r in t.requests[:6]:
            for salt, lora in ((None, None), ("t:abc", None), (None, "ad1"), ("s", "ad2")):
                rr = TraceRequest(r.index, r.arrival_s, r.input_length, 1, r.hash_ids, cache_salt=salt, lora=lora)
                want = h.keys_for(synth.token_list(rr), ns.scoped(lora=lora, cache_salt=salt or ""))
                assert keyer.keys(rr) == want
