"""The real engine on the tiny Llama (CPU): a prefix reused from the pool gives the same
tokens and logits as a plain forward without any cache reuse; chunked prefill equals
unchunked; batched decode equals each sequence alone; seeded sampling, stop strings,
max_tokens and EOS; cancellation frees blocks; 429 on a full queue; preemption on a tiny
pool still gives every request its exact answer."""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from workers.api import GenRequest
from workers.engine.core import EngineCore, SeqUpdate
from workers.engine.engine import sampling_of
from workers.engine.engineconfig import EngineConfig
from workers.engine.model import LoadedModel, ModelSpec, load_model
from workers.engine.sequence import SamplingParams, Sequence
from workers.errors import QueueFull, RequestTooLarge

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is faster than two fighting
    try:
        yield load_model(ModelSpec(cache_dir=Path(tmp_path_factory.getbasetemp()) / "kvroute-cache"))
    finally:
        torch.set_num_threads(threads)


def core_of(lm: LoadedModel, **kw: object) -> EngineCore:
    args: dict[str, object] = dict(num_blocks=64, max_num_batched_tokens=512, max_waiting=16)
    args.update(kw)
    return EngineCore(lm, EngineConfig(**args))  # type: ignore[arg-type]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def reference(lm: LoadedModel, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the prompt's last logits from plain forwards (no reuse across requests)."""
    with torch.inference_mode():
        out = lm.model(torch.tensor([ids]), use_cache=True)
        first = out.logits[0, -1].clone()
        toks: list[int] = []
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            out = lm.model(torch.tensor([[toks[-1]]]), cache=out.cache, use_cache=True)
    return toks, first


def run(core: EngineCore, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[SeqUpdate]]:
    """Submit, then step until every request ended; the updates per request."""
    out: dict[str, list[SeqUpdate]] = {}
    for rid, ids, p in reqs:
        core.add(core.new_sequence(rid, ids, p))
        out[rid] = []
    while core.seqs:
        for u in core.step():
            out[u.seq.request_id].append(u)
    return out


def tokens(updates: list[SeqUpdate]) -> list[int]:
    return [t for u in updates for t in u.token_ids]


def first_logits(core: EngineCore, seq: Sequence) -> tuple[torch.Tensor, list[int]]:
    """Run a submitted sequence to the end, keeping the logits its first token was sampled from."""
    got: torch.Tensor | None = None
    toks: list[int] = []
    while core.seqs:
        plan = core.schedule()
        res = core.execute(plan)
        if got is None and seq in res.logits:
            got = res.logits[seq].clone()
        toks += [t for u in core.commit(plan, res) if u.seq is seq for t in u.token_ids]
    assert got is not None
    return got, toks


def test_gpu_prefix_hit_equals_full_recompute(lm: LoadedModel) -> None:
    core = core_of(lm, num_blocks=128)
    base = prompt(1, 520)
    run(core, [("a", base, GREEDY)])
    ids = base[:496] + prompt(2, 37)
    b = core.new_sequence("b", ids, GREEDY)
    core.add(b)
    logits, toks = first_logits(core, b)
    assert b.usage.loaded_tokens["GPU"] == 496 and b.usage.recomputed_tokens == 37
    ref_toks, ref_logits = reference(lm, ids, GREEDY.max_tokens)
    assert toks == ref_toks
    assert torch.allclose(logits, ref_logits, atol=1e-4), (logits - ref_logits).abs().max()


def test_chunked_prefill_equals_unchunked(lm: LoadedModel) -> None:
    ids = prompt(3, 150)
    whole = core_of(lm, max_num_batched_tokens=512)
    chunked = core_of(lm, max_num_batched_tokens=32)
    a, b = whole.new_sequence("x", ids, GREEDY), chunked.new_sequence("x", ids, GREEDY)
    whole.add(a)
    chunked.add(b)
    la, ta = first_logits(whole, a)
    lb, tb = first_logits(chunked, b)
    assert chunked.stats.steps >= 5 + GREEDY.max_tokens - 1  # 150 tokens in chunks of 32
    assert ta == tb
    assert torch.allclose(la, lb, atol=1e-4)


def test_batched_decode_equals_each_alone(lm: LoadedModel) -> None:
    prompts = {"p0": prompt(4, 13), "p1": prompt(5, 70), "p2": prompt(6, 33), "p3": prompt(7, 1)}
    together = run(core_of(lm), [(rid, ids, GREEDY) for rid, ids in prompts.items()])
    for rid, ids in prompts.items():
        alone = run(core_of(lm), [(rid, ids, GREEDY)])
        assert tokens(together[rid]) == tokens(alone[rid]), rid


def test_seeded_sampling_is_reproducible(lm: LoadedModel) -> None:
    ids = prompt(8, 40)
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    one = tokens(run(core_of(lm), [("s", ids, p)])["s"])
    batched = run(core_of(lm), [("s", ids, p), ("other", prompt(9, 20), dataclasses.replace(p, seed=1))])
    assert tokens(batched["s"]) == one
    others = [tokens(run(core_of(lm), [("s", ids, dataclasses.replace(p, seed=s))])["s"]) for s in (1, 2)]
    assert any(o != one for o in others)


def test_stop_string_cuts_the_text_and_ends_the_request(lm: LoadedModel) -> None:
    ids = prompt(10, 30)
    free = run(core_of(lm), [("f", ids, SamplingParams(max_tokens=12, ignore_eos=True))])["f"]
    text = "".join(u.text for u in free)
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    got = run(core_of(lm), [("s", ids, SamplingParams(max_tokens=12, stop=(stop, "\x00never"), ignore_eos=True))])["s"]
    assert "".join(u.text for u in got) == text[:cut]
    assert got[-1].finished and got[-1].seq.finish_reason == "stop"
    assert len(tokens(got)) < 12


def test_sampling_fields_of_an_http_request() -> None:
    plain = GenRequest("r", [1, 2], 7, ignore_eos=True)
    assert sampling_of(plain) == SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True)  # OpenAI's default
    got = sampling_of(GenRequest("r", [1], 5, temperature=0, top_p=0.5, seed=3, stop="##"))
    assert got == SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5, seed=3, stop=("##",))
    assert sampling_of(GenRequest("r", [1], 5, stop=["a", "b"])).stop == ("a", "b")


def test_max_tokens_and_eos(lm: LoadedModel) -> None:
    ids = prompt(11, 20)
    out = run(core_of(lm), [("m", ids, SamplingParams(max_tokens=3, ignore_eos=True))])["m"]
    assert len(tokens(out)) == 3 and out[-1].seq.finish_reason == "length"
    u = out[-1].seq.usage
    assert u.completion_tokens == 3 and u.prompt_tokens == 20 and u.ttft_ms > 0 and u.decode_ms > 0
    first = tokens(out)[0]
    eos_lm = dataclasses.replace(lm, eos_ids=frozenset({first}))  # pretend the first token ends the answer
    stopped = run(core_of(eos_lm), [("e", ids, SamplingParams(max_tokens=3))])["e"]
    assert tokens(stopped) == [first] and stopped[-1].seq.finish_reason == "stop" and stopped[-1].text == ""
    ignored = run(core_of(eos_lm), [("i", ids, SamplingParams(max_tokens=3, ignore_eos=True))])["i"]
    assert len(tokens(ignored)) == 3


def test_cancel_frees_blocks(lm: LoadedModel) -> None:
    core = core_of(lm, max_num_batched_tokens=32)
    core.add(core.new_sequence("c", prompt(12, 100), SamplingParams(max_tokens=50, ignore_eos=True)))
    core.add(core.new_sequence("w", prompt(13, 10), GREEDY))
    core.step()
    core.step()
    assert any(b.ref for b in core.blocks.blocks)
    assert core.abort("c") and core.abort("w")
    assert not core.abort("c") and not core.abort("unknown")
    assert core.step() == []
    assert not core.seqs and not core.scheduler.running and not core.scheduler.waiting
    assert all(b.ref == 0 for b in core.blocks.blocks)
    assert core.stats.cancelled == 2


def test_refusals(lm: LoadedModel) -> None:
    core = core_of(lm, max_waiting=2, num_blocks=8)
    for i in range(2):
        core.add(core.new_sequence(f"q{i}", prompt(i, 10), GREEDY))
    with pytest.raises(QueueFull) as e:
        core.add(core.new_sequence("q2", prompt(2, 10), GREEDY))
    assert e.value.status == 429 and e.value.retry_after is not None
    with pytest.raises(RequestTooLarge):  # 8 blocks of 16 = 128 tokens of KV
        core.add(core.new_sequence("big", prompt(3, 100), SamplingParams(max_tokens=40)))
    assert core.stats.rejected_queue_full == 1 and core.stats.rejected_too_large == 1


def test_preemption_on_a_tiny_pool_keeps_every_answer_exact(lm: LoadedModel) -> None:
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = {f"r{i}": prompt(20 + i, 40 + 7 * i) for i in range(4)}
    core = core_of(lm, num_blocks=12)  # 192 tokens of KV for ~4 x 80
    out = run(core, [(rid, ids, p) for rid, ids in prompts.items()])
    assert core.stats.preemptions > 0
    for rid, ids in prompts.items():
        assert tokens(out[rid]) == reference(lm, ids, p.max_tokens)[0], rid
    assert all(b.ref == 0 for b in core.blocks.blocks)


def test_calibration_fits_a_small_pool(lm: LoadedModel) -> None:
    """A pool too small for a budget-sized chunk after as much context still gets its speeds
    measured before traffic (smaller chunks), so /load reports them from the start."""
    core = core_of(lm, num_blocks=40, max_num_batched_tokens=1024)  # 640 tokens: chunks of 16, 128, 319
    assert core.speeds().prefill_tokens_per_s is None
    core.calibrate()
    sp = core.speeds()
    assert core.prefill_fit.samples == 6 and sp.prefill_tokens_per_s is not None and sp.prefill_tokens_per_s > 0
    assert sp.decode_step_s is not None and sp.decode_step_s > 0
    assert core.blocks.used() == 0 and not core.seqs  # calibration leaves the pool as it found it
