"""Each routing policy's behaviour, the registry, shedding and explain."""
from __future__ import annotations

import collections
import random

import pytest
from tuned import tuned

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier
from router.planner import POLICY_NAMES, explain, make_policy, policy_params
from router.planner.kv_cost import KVCostPolicy
from router.planner.kv_cost_tuning import DEFAULT, REMOVED, KVCostTuning
from router.planner.types import CostParams, Decision, Link, RouteRequest, WorkerView

B = 16
BLOCK_BYTES = 2 * 1024 * 1024  # Llama-3-8B bf16: 128 KiB/token * 16


def h200(**kw) -> CostParams:
    """Roughly an H200 serving an 8B model (docs/design.md §1)."""
    base = dict(
        block_size=B,
        block_bytes=BLOCK_BYTES,
        prefill_tokens_per_s=40_000.0,
        prefill_attn_s_per_token2=1e-10,
        prefill_overhead_s=0.004,
        links={
            Tier.CPU: Link(50e9, 1e-5),
            Tier.DISK: Link(6e9, 1e-4),
            Tier.REMOTE: Link(2e9, 1e-3),
            Tier.PEER: Link(25e9, 2e-4),
        },
    )
    base.update(kw)
    return CostParams(**base)


def fleet(n: int = 4, **kw) -> list[WorkerView]:
    return [WorkerView(f"w{i}", h200(), **kw) for i in range(n)]


def request(tokens: int, matches: dict[str, PrefixMatch] | None = None, seed: int = 0) -> RouteRequest:
    return RouteRequest(tokens, [seed * 1_000_003 + i for i in range(tokens // B)], matches or {})


def pm(wid: str, *runs: tuple[Tier, int]) -> PrefixMatch:
    return PrefixMatch(wid, sum(n for _, n in runs), tuple(runs))


# ---------------------------------------------------------------- registry


def test_registry_names_and_errors():
    assert POLICY_NAMES == (
        "round_robin", "least_loaded", "prefix_hash", "cache_aware", "dynamo", "kv_cost", "kv_cost_true_state",
        "pd_cost", "pd_round_robin", "pd_prefix",
    )
    with pytest.raises(ValueError, match="unknown routing policy 'kvcost'.*kv_cost"):
        make_policy("kvcost")
    # the renamed `oracle` (never a bound) fails with a pointer to its new name
    with pytest.raises(ValueError, match="'oracle' is now kv_cost_true_state"):
        make_policy("oracle")
    with pytest.raises(ValueError, match="unknown parameter.*'balance_esp'.*valid:.*balance_eps"):
        make_policy("kv_cost", balance_esp=0.1)
    with pytest.raises(ValueError, match="'balance_eps'"):
        make_policy("kv_cost", balance_eps=-1)
    with pytest.raises(ValueError, match="'tie_margin'"):
        tuned("kv_cost", tie_margin=-1)
    with pytest.raises(ValueError, match="'vnodes'"):
        make_policy("prefix_hash", vnodes=0)
    with pytest.raises(ValueError, match="'temperature'"):
        make_policy("dynamo", temperature="hot")
    with pytest.raises(ValueError, match="'calibrate'"):
        make_policy("round_robin", calibrate=1)
    assert policy_params("kv_cost_true_state")["balance_eps"] is None


def test_kv_cost_has_six_settings_and_no_private_one():
    """Issue "Fewer knobs": six settings, each with a case in docs/planner.md ("Settings");
    the tuning constants are never listed, for kv_cost or any other policy."""
    six = {"max_ttft_s", "balance_eps", "prefetch", "peer_pull", "saturation", "calibrate"}
    assert set(policy_params("kv_cost")) == six
    assert policy_params("kv_cost_true_state") == {**policy_params("kv_cost"), "balance_eps": None}
    assert policy_params("round_robin") == policy_params("least_loaded") == {"calibrate": True}
    assert set(policy_params("prefix_hash")) == {"prefix_blocks", "vnodes", "balance_eps", "calibrate"}
    assert set(policy_params("cache_aware")) == {
        "cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "gpu_only", "calibrate"}
    assert set(policy_params("dynamo")) == {
        "overlap_score_weight", "temperature", "offload_credit", "seed", "calibrate"}
    for name in ("pd_cost", "pd_round_robin", "pd_prefix"):
        assert policy_params(name) == {"bypass_max_tokens": 2048, "calibrate": True}
    for name in POLICY_NAMES:
        assert not any(p.startswith("_") for p in policy_params(name))


@pytest.mark.parametrize("name", ["kv_cost", "kv_cost_true_state"])
@pytest.mark.parametrize("knob", sorted(REMOVED))
def test_a_former_setting_is_refused_with_what_became_of_it(name, knob):
    with pytest.raises(ValueError, match=rf"'{knob}' is no longer a setting: .*valid: max_ttft_s"):
        make_policy(name, **{knob: getattr(DEFAULT, knob, True)})
    with pytest.raises(ValueError, match=r"'_tuning'.*valid:"):
        make_policy(name, _tuning=DEFAULT)


def test_removed_settings_name_their_constant():
    with pytest.raises(ValueError, match=r"'tie_margin' is no longer a setting: it is the fixed constant "
                                         r"TIE_MARGIN = 0\.03 \(docs/planner\.md"):
        make_policy("kv_cost", tie_margin=0.1)
    with pytest.raises(ValueError, match=r"SATURATION_BAND = 0\.3.*`saturation: false`"):
        make_policy("kv_cost", saturation_band=0.5)
    with pytest.raises(ValueError, match="_tuning must be a KVCostTuning"):
        KVCostPolicy(_tuning={"tie_margin": 0.1})  # type: ignore[arg-type]


def test_defaults_are_the_constants_and_saturation_switches_both_rules():
    """The six settings' defaults and the constants reproduce the former defaults exactly;
    `saturation` false is the former `saturation_band: null, memory_weight: 0`."""
    p = make_policy("kv_cost")
    assert p.tuning == DEFAULT == KVCostTuning(
        tie_margin=0.03, tie_abs_s=0.001, balance_slack=2.0, min_prefetch_blocks=1, interference_weight=1.0,
        interference_slack_s=0.05, coschedule_weight=0.0, coschedule_slack_s=0.02, saturation_band=0.3,
        saturation_abs_s=0.0, saturation_queue_s=2.0, saturation_local_tiers=True, memory_weight=30.0,
        memory_bound=1.0, prefill_quantile=0.2, ttft_offset=True)
    assert (p.max_ttft_s, p.balance_eps, p.prefetch, p.peer_pull, p.calibrate) == (None, 1.0, True, True, True)
    assert (p.saturation_band, p.memory_weight, p.all_estimates) == (0.3, 30.0, False)
    off = make_policy("kv_cost", saturation=False)
    assert (off.saturation_band, off.memory_weight) == (None, 0.0)
    with pytest.raises(ValueError, match="'saturation'"):
        make_policy("kv_cost", saturation="off")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_routes_and_sheds(name):
    p = make_policy(name)
    assert p.name == name
    ws = fleet(3)
    d = p.choose(request(1000), ws)
    assert isinstance(d, Decision) and d.worker_id in {w.worker_id for w in ws}
    assert d.policy == name and d.ranked[0] == d.worker_id
    assert d.predicted_ttft is not None and d.predicted_ttft > 0
    assert len(set(d.ranked)) == len(d.ranked) >= 2
    # a prompt shorter than one block, no matches
    assert p.choose(request(5), ws).worker_id is not None
    # no workers / every worker at its waiting cap: shed with a retry hint
    assert p.choose(request(1000), []).worker_id is None
    capped = fleet(2, max_waiting=4, waiting_requests=4, est_queue_s=3.0)
    d = p.choose(request(1000), capped)
    assert d.worker_id is None and d.reason == "shed_capped"
    assert d.retry_after_s == pytest.approx(3.0)
    # a capped worker is never chosen while another is open
    mixed = fleet(2, max_waiting=4)
    mixed[0].waiting_requests = 4
    for _ in range(4):
        assert p.choose(request(1000), mixed).worker_id == "w1"
    p.observe("w1", 0.1, 0.12, {"recomputed_tokens": 1000, "prefill_ms": 30.0, "loaded_tokens": {}})


# ---------------------------------------------------------------- baselines


def test_round_robin_cycles():
    p = make_policy("round_robin")
    ws = fleet(3)
    assert [p.choose(request(100), ws).worker_id for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_least_loaded_picks_fewest_outstanding_and_rotates_ties():
    p = make_policy("least_loaded")
    ws = fleet(3)
    ws[0].running_requests = 5
    ws[1].inflight_requests = 2  # router's own accounting counts even before a report
    assert p.choose(request(100), ws).worker_id == "w2"
    idle = fleet(3)
    assert {p.choose(request(100), idle).worker_id for _ in range(3)} == {"w0", "w1", "w2"}


def test_prefix_hash_is_sticky_spreads_and_bounds_load():
    p = make_policy("prefix_hash", prefix_blocks=4)
    ws = fleet(8)
    first = {s: p.choose(request(2000, seed=s), ws).worker_id for s in range(64)}
    assert all(p.choose(request(2000, seed=s), ws).worker_id == first[s] for s in range(64))
    assert len(set(first.values())) >= 6  # different prefixes spread over the ring
    # only the first prefix_blocks digests matter
    r = request(2000, seed=3)
    r2 = RouteRequest(3000, list(r.digests[:4]) + [99, 98], {})
    assert p.choose(r2, ws).worker_id == first[3]
    # the home worker overloaded: the request moves on (and always to the same next worker)
    home = first[5]
    loaded = fleet(8)
    next(w for w in loaded if w.worker_id == home).running_requests = 10
    d = p.choose(request(2000, seed=5), loaded)
    assert d.worker_id != home and d.reason == "hash_overflow"
    assert p.choose(request(2000, seed=5), loaded).worker_id == d.worker_id
    # consistent hashing: removing one worker moves only its own prefixes
    gone = "w3"
    rest = [w for w in ws if w.worker_id != gone]
    moved = [s for s in range(64) if first[s] != gone and p.choose(request(2000, seed=s), rest).worker_id != first[s]]
    assert moved == []


def test_cache_aware_match_threshold_and_imbalance():
    p = make_policy("cache_aware", cache_threshold=0.5)
    ws = fleet(3)
    ws[2].gpu_free_blocks = 100
    hit = request(1600, {"w1": pm("w1", (Tier.CPU, 90))})
    d = p.choose(hit, ws)
    assert (d.worker_id, d.reason) == ("w1", "cache_hit")
    low = request(1600, {"w1": pm("w1", (Tier.GPU, 20))})  # 20% of the prompt: below threshold
    d = p.choose(low, ws)
    assert (d.worker_id, d.reason) == ("w2", "cache_miss")  # most free cache
    assert make_policy("cache_aware", gpu_only=True).choose(hit, ws).reason == "cache_miss"
    ws[1].running_requests = 100
    d = p.choose(hit, ws)
    assert d.reason == "imbalanced" and d.worker_id != "w1"


def test_cache_aware_spreads_misses_that_arrive_between_two_polls():
    """16 cold prompts at once (Mooncake arrives in bursts): the report's free count has not
    moved, but what the router already sent somewhere counts against that worker's room."""
    p = make_policy("cache_aware")
    ws = fleet(4, gpu_free_blocks=9_500, gpu_capacity_blocks=10_000)
    ws[0].gpu_free_blocks = 10_000  # the most room at the last poll
    for w in ws:
        w.inflight_since_report_requests = 0
        w.inflight_since_report_prefill_tokens = 0
    got: collections.Counter = collections.Counter()
    for s in range(16):
        d = p.choose(request(4000, seed=s), ws)
        assert d.reason == "cache_miss"
        got[d.worker_id] += 1
        w = next(w for w in ws if w.worker_id == d.worker_id)
        w.inflight_since_report_requests += 1
        w.inflight_since_report_prefill_tokens += 4000
    assert len(got) == 4 and got["w0"] <= 5  # a report-only view sends all 16 to w0
    # Without the router's own accounting (another router's traffic): the report's queue counts.
    ws = fleet(2, gpu_free_blocks=1000)
    ws[0].waiting_prefill_tokens = 800 * B
    assert p.choose(request(4000), ws).worker_id == "w1"


def test_dynamo_overlap_vs_load():
    p = make_policy("dynamo")
    ws = fleet(3)
    r = request(1600, {"w1": pm("w1", (Tier.GPU, 80)), "w2": pm("w2", (Tier.CPU, 100))})
    d = p.choose(r, ws)
    assert (d.worker_id, d.reason) == ("w1", "min_cost")  # CPU hits earn no credit by default
    assert make_policy("dynamo", offload_credit=1.0).choose(r, ws).worker_id == "w2"
    # w1's cost: pending prefill blocks + active blocks outweigh the 80-block credit
    ws[1].waiting_prefill_tokens = 16 * 200
    ws[1].active_kv_tokens = 16 * 100
    assert p.choose(r, ws).worker_id != "w1"
    costs = {w.worker_id: p.cost(r, w) for w in ws}
    assert costs["w1"] == pytest.approx(200 + (100 - 80) + 100 + 100)
    assert costs["w0"] == pytest.approx(100 + 100)


def test_dynamo_temperature_samples_reproducibly():
    ws = fleet(4)
    r = request(1600, {"w1": pm("w1", (Tier.GPU, 50))})
    picks = [make_policy("dynamo", temperature=1.0, seed=7).choose(r, ws).worker_id for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same first draw
    p = make_policy("dynamo", temperature=1.0, seed=1)
    counts = collections.Counter(p.choose(r, ws).worker_id for _ in range(400))
    assert counts["w1"] == max(counts.values()) and len(counts) == 4
    cold = make_policy("dynamo", temperature=0.001, seed=1)
    assert {cold.choose(r, ws).worker_id for _ in range(50)} == {"w1"}


# ---------------------------------------------------------------- kv_cost


def test_kv_cost_picks_the_worker_holding_the_prefix():
    p = tuned("kv_cost", all_estimates=True)
    ws = fleet(4)
    r = request(8192, {"w2": pm("w2", (Tier.GPU, 500)), "w1": pm("w1", (Tier.GPU, 100))})
    d = p.choose(r, ws)
    assert (d.worker_id, d.reason) == ("w2", "min_ttft")
    assert d.prefetch_blocks == 0  # all on GPU already
    e = {e.worker_id: e for e in d.estimates}
    assert e["w2"].load_blocks == 500 and e["w2"].t_ttft < e["w1"].t_ttft < e["w0"].t_ttft
    assert d.predicted_ttft == e["w2"].t_ttft
    assert d.ranked[:2] == ["w2", "w1"] and sorted(d.ranked) == ["w0", "w1", "w2", "w3"]
    # by default only the contenders are estimated: w0 and w3 cannot come close
    pruned = make_policy("kv_cost").choose(r, ws)
    assert [e.worker_id for e in pruned.estimates] == ["w2", "w1"]
    assert pruned.ranked[:2] == ["w2", "w1"] and pruned.predicted_ttft == d.predicted_ttft


def _random_case(rng: random.Random):
    n = rng.randrange(1, 12)
    ws = []
    for i in range(n):
        w = WorkerView(
            f"w{i}",
            h200(prefill_tokens_per_s=rng.choice([20_000.0, 40_000.0]), decode_step_s=rng.choice([0.0, 0.006, 0.03])),
            est_queue_s=rng.choice([0.0, rng.uniform(0, 0.3), rng.uniform(0, 2), rng.uniform(2, 10)]),
            gpu_capacity_blocks=rng.choice([0, 2000]),
            gpu_block_tokens=rng.choice([0, B, 4 * B]),
            active_kv_tokens=rng.choice([None, rng.randrange(0, 40_000)]),
            inflight_since_report_requests=rng.choice([None, rng.randrange(0, 4)]),
            report_age_s=rng.uniform(0, 0.1),
            running_requests=rng.randrange(0, 8),
            inflight_requests=rng.randrange(0, 8),
            inflight_prefill_tokens=rng.randrange(0, 30_000),
            max_waiting=rng.choice([None, 4]),
            waiting_requests=rng.randrange(0, 6),
            supports_prefetch=rng.random() < 0.8,
            supports_peer_pull=rng.random() < 0.5,
            inflight_loads=tuple(
                (rng.uniform(0.0, 3.0), rng.uniform(0.0, 0.2)) for _ in range(rng.choice([0, 0, 1, 3]))
            ),
        )
        ws.append(w)
    tokens = rng.randrange(1, 8192)
    matches = {}
    for w in ws:
        if rng.random() < 0.5 and tokens >= B:
            runs, left = [], rng.randrange(1, tokens // B + 1)
            while left:
                k = rng.randrange(1, left + 1)
                runs.append((rng.choice([Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE]), k))
                left -= k
            matches[w.worker_id] = pm(w.worker_id, *runs)
    params = dict(
        max_ttft_s=rng.choice([None, 0.05, 0.3, 1.0]),
        balance_eps=rng.choice([None, 0.0, 0.5, 1.0]),
        balance_slack=rng.choice([0.0, 2.0]),
        tie_margin=rng.choice([0.0, 0.03, 0.2]),
    )
    return ws, request(tokens, matches, seed=rng.randrange(99)), params


@pytest.mark.parametrize("policy", ["kv_cost", "kv_cost_true_state"])
def test_pruned_decisions_equal_full_evaluation(policy):
    from router.planner.cost import RequestContext, ttft_lower_bound

    rng = random.Random(5)
    for _ in range(400):
        ws, r, params = _random_case(rng)
        fast = tuned(policy, **params).choose(r, ws)
        full = tuned(policy, all_estimates=True, **params).choose(r, ws)
        assert (fast.worker_id, fast.reason, fast.prefetch_blocks, fast.prefetch_from_peer) == (
            full.worker_id, full.reason, full.prefetch_blocks, full.prefetch_from_peer,
        )
        assert fast.predicted_ttft == full.predicted_ttft and fast.retry_after_s == full.retry_after_s
        assert fast.ranked[:2] == full.ranked[:2] and sorted(fast.ranked) == sorted(full.ranked)
        assert [e.worker_id for e in full.estimates] == [w.worker_id for w in ws]
        ctx = RequestContext.build(r, ws)
        for w, e in zip(ws, full.estimates, strict=True):  # the bound pruning relies on
            assert ttft_lower_bound(ctx, w, exact_queue=policy == "kv_cost_true_state") <= e.t_ttft * (1 + 1e-12)


def test_idle_worker_beats_long_queue_when_recompute_is_cheaper():
    p = make_policy("kv_cost")
    ws = fleet(2)
    ws[0].est_queue_s = 2.0  # holds the whole prefix but is backed up
    r = request(8192, {"w0": pm("w0", (Tier.GPU, 511))})
    d = p.choose(r, ws)
    assert d.worker_id == "w1"
    e = {e.worker_id: e for e in d.estimates}
    # why: w0 would compute almost nothing but waits 2 s; w1 recomputes 8k tokens in ~0.2 s
    assert e["w0"].t_queue == pytest.approx(2.0) and e["w0"].recompute_tokens == 16
    assert e["w1"].t_queue == 0.0 and e["w1"].recompute_tokens == 8192
    assert e["w1"].t_prefill < 0.5 < e["w0"].t_ttft
    # a short queue flips it back
    ws[0].est_queue_s = 0.05
    assert p.choose(r, ws).worker_id == "w0"


def test_saturated_fleet_keeps_a_prompt_where_its_prefix_is_held():
    """When no worker could start within `saturation_queue_s`, a worker within the band
    of the best score that holds more of the prompt (GPU, or its own CPU/DISK) wins:
    queue estimates of many seconds are too rough to move a conversation for."""
    ws = fleet(3)
    ws[0].est_queue_s, ws[1].est_queue_s, ws[2].est_queue_s = 10.0, 9.0, 12.5
    r = request(8192, {"w0": pm("w0", (Tier.GPU, 400)), "w2": pm("w2", (Tier.GPU, 500))})
    d = make_policy("kv_cost").choose(r, ws)  # w1: 9 s + ~0.2 s of prefill is the argmin
    assert (d.worker_id, d.reason) == ("w0", "saturation_prefix")
    assert tuned("kv_cost", saturation_band=None).choose(r, ws).worker_id == "w1"
    # w2 holds more but is past the band (12.5 s > 1.3 x the best score)
    assert tuned("kv_cost", saturation_band=0.5).choose(r, ws).worker_id == "w2"
    # the same spread a hundred times shorter is no saturation: the plain argmin
    for w in ws:
        w.est_queue_s /= 100
    assert make_policy("kv_cost").choose(r, ws).reason == "min_ttft"
    # own CPU copies count only with saturation_local_tiers
    ws = fleet(2)
    ws[0].est_queue_s, ws[1].est_queue_s = 10.0, 9.0
    r = request(8192, {"w0": pm("w0", (Tier.CPU, 400))})
    assert make_policy("kv_cost").choose(r, ws).worker_id == "w0"
    assert tuned("kv_cost", saturation_local_tiers=False).choose(r, ws).worker_id == "w1"


def test_memory_bound_workers_price_the_blocks_a_prompt_would_not_share():
    """Two workers whose GPU KV is full: the one already holding the prompt's prefix on GPU
    needs few new blocks; the other would wait for decodes to free a whole copy. Without
    the memory term the idle-queue worker wins on TTFT alone."""
    ws = [WorkerView(f"w{i}", h200(decode_step_s=0.02), gpu_capacity_blocks=1000, gpu_block_tokens=B,
                     active_kv_tokens=16_000) for i in range(2)]
    ws[0].est_queue_s = 0.4  # the holder is a little behind
    r = RouteRequest(8192, [i for i in range(8192 // B)], {"w0": pm("w0", (Tier.GPU, 500))}, max_tokens=256)
    d = make_policy("kv_cost").choose(r, ws)
    e = {x.worker_id: x for x in d.estimates}
    assert d.worker_id == "w0" and e["w1"].t_memory > e["w0"].t_memory >= 0.0
    assert tuned("kv_cost", memory_weight=0.0).choose(r, ws).worker_id == "w1"
    for w in ws:  # a worker whose block size is unknown (vLLM) gets no memory pricing
        w.gpu_block_tokens = 0
    assert make_policy("kv_cost").choose(r, ws).worker_id == "w1"


def test_prefetch_planned_for_cpu_and_disk_blocks_only_where_supported():
    p = make_policy("kv_cost")
    r = request(8192, {"w0": pm("w0", (Tier.GPU, 100), (Tier.CPU, 200), (Tier.DISK, 200))})
    ws = fleet(1, est_queue_s=0.3)
    d = p.choose(r, ws)
    e = d.estimates[0]
    assert e.prefetch_blocks == {Tier.CPU: 200, Tier.DISK: 200}
    assert d.prefetch_blocks == 500 and d.prefetch_from_peer is None
    assert e.t_load == 0.0 < e.t_load_total  # entirely hidden behind the 0.3 s queue
    vllm_like = fleet(1, est_queue_s=0.3, supports_prefetch=False)
    d = p.choose(r, vllm_like)
    e = d.estimates[0]
    assert d.prefetch_blocks == 0 and e.prefetch_blocks == {}
    assert e.t_load == e.t_load_total > 0  # loads on demand, after the queue
    assert make_policy("kv_cost", prefetch=False).choose(r, ws).prefetch_blocks == 0


def test_peer_pull_chosen_when_it_wins():
    p = make_policy("kv_cost")
    ws = fleet(3, supports_peer_pull=True)
    ws[0].est_queue_s = 1.5  # the holder is busy
    r = request(8192, {"w0": pm("w0", (Tier.GPU, 511))})
    d = p.choose(r, ws)
    assert d.worker_id in ("w1", "w2")
    assert d.prefetch_from_peer == "w0" and d.prefetch_blocks == 511
    e = next(e for e in d.estimates if e.worker_id == d.worker_id)
    assert e.load_blocks_by_tier == {Tier.PEER: 511} and e.peer_source == "w0"
    assert e.t_ttft < 0.2  # 1 GiB over 25 GB/s beats recomputing 8k tokens
    # without peer pull an idle worker recomputes instead
    ws2 = fleet(3)
    ws2[0].est_queue_s = 1.5
    d2 = p.choose(r, ws2)
    assert d2.prefetch_from_peer is None and d2.predicted_ttft > d.predicted_ttft


def test_near_ties_go_to_less_load():
    p = tuned("kv_cost", tie_margin=0.05)
    ws = fleet(2)
    ws[0].running_requests = 3
    d = p.choose(request(4096), ws)
    assert d.worker_id == "w1"  # an exact tie
    # w0 is 2% faster (a short GPU hit), yet within the margin: w1 has less load
    r = request(4096, {"w0": pm("w0", (Tier.GPU, 4))})
    d = p.choose(r, ws)
    assert (d.worker_id, d.reason) == ("w1", "tie_less_load")
    assert tuned("kv_cost", tie_margin=0.0).choose(r, ws).worker_id == "w0"


def _herd(policy_name: str, **params) -> collections.Counter:
    """200 requests sharing a prefix that only w0 holds; load reports never refresh and
    the in-flight token accounting is missing (e.g. another router's traffic), only the
    request counts grow: the queue estimate cannot push back."""
    p = tuned(policy_name, **params)
    ws = fleet(4)
    r = request(8192, {"w0": pm("w0", (Tier.GPU, 511))})
    got: collections.Counter = collections.Counter()
    for _ in range(200):
        d = p.choose(r, ws)
        got[d.worker_id] += 1
        next(w for w in ws if w.worker_id == d.worker_id).inflight_requests += 1
    return got


def test_bounded_load_prevents_herding():
    assert _herd("kv_cost", balance_eps=None) == {"w0": 200}
    got = _herd("kv_cost", balance_eps=0.5, balance_slack=2.0)
    assert len(got) == 4
    # w0 stays within (1 + eps) * mean + slack
    assert got["w0"] <= 1.5 * 200 / 4 + 2 + 1
    assert got["w0"] > max(got[w] for w in ("w1", "w2", "w3"))  # it still gets the most


def test_shedding_on_slo():
    p = make_policy("kv_cost", max_ttft_s=0.5)
    ws = fleet(2, est_queue_s=3.0)
    d = p.choose(request(8192), ws)
    assert d.worker_id is None and d.reason == "shed_slo"
    assert d.retry_after_s == pytest.approx(d.predicted_ttft - 0.5)
    assert len(d.estimates) == 2 and d.ranked == []
    ws[1].est_queue_s = 0.1
    assert p.choose(request(8192), ws).worker_id == "w1"


def test_slo_beats_balance():
    p = tuned("kv_cost", max_ttft_s=0.1, balance_eps=0.0, balance_slack=0.0)
    ws = fleet(2)
    ws[0].running_requests = 10  # excluded by the guard, yet the only one fast enough
    ws[1].est_queue_s = 1.0
    r = request(8192, {"w0": pm("w0", (Tier.GPU, 511))})
    d = p.choose(r, ws)
    assert (d.worker_id, d.reason) == ("w0", "slo_over_balance")


def test_long_prompt_avoids_a_worker_whose_load_is_in_flight():
    """A long prefill sent where a request's remote load has not landed runs ahead of it
    (the engine serves prefills in start order): kv_cost charges that delay."""
    ws = fleet(2)
    ws[0].est_queue_s = 0.02  # the loading request's own 800 tokens of prefill
    ws[0].inflight_loads = ((1.0, 0.02),)  # its 119k-token REMOTE load lands in 1 s
    ws[1].est_queue_s = 0.3  # busier, but nothing loading
    long = request(64_000)
    plain = tuned("kv_cost", interference_weight=0.0).choose(long, ws)
    assert plain.worker_id == "w0"  # its own TTFT is lower there
    p = tuned("kv_cost", all_estimates=True)
    d = p.choose(long, ws)
    e0, e1 = d.estimates
    assert d.worker_id == "w1" and d.predicted_ttft == e1.t_ttft
    assert e1.t_interference == 0.0 and e1.score == e1.t_ttft
    # w0: starts at 0 (the loading request's prefill is not ahead of it), ends at
    # t_prefill, and the load that lands at 1 s waits for the rest
    assert e0.t_interference == pytest.approx(e0.t_prefill - 1.0)
    assert e0.score == pytest.approx(e0.t_ttft + e0.t_interference)
    assert e0.t_ttft < e1.t_ttft
    # a short prompt finishes before the load lands: no delay, w0 wins again
    assert p.choose(request(2048), ws).worker_id == "w0"
    # the weight scales the term: at 0.05 the 0.8 s delay no longer outweighs w1's 0.28 s
    assert tuned("kv_cost", interference_weight=0.05).choose(long, ws).worker_id == "w0"
    assert make_policy("kv_cost_true_state").choose(long, ws).worker_id == "w1"
    assert tuned("kv_cost_true_state", interference_weight=0.0).choose(long, ws).worker_id == "w0"
    with pytest.raises(ValueError, match="interference_slack_s"):
        tuned("kv_cost", interference_slack_s=-0.1)


def test_interference_does_not_hide_a_worker_meeting_the_slo():
    ws = fleet(2)
    ws[0].inflight_loads = ((0.5, 0.0),)
    ws[1].est_queue_s = 0.5
    r = request(64_000)
    own = tuned("kv_cost", all_estimates=True, interference_weight=0.0).choose(r, ws).estimates
    slo = (own[0].t_ttft + own[1].t_ttft) / 2  # only w0 meets it, though w1 scores better
    d = make_policy("kv_cost", max_ttft_s=slo).choose(r, ws)
    assert d.worker_id == "w0" and d.predicted_ttft <= slo


def test_ranked_lists_every_open_worker_best_first():
    p = make_policy("kv_cost")
    ws = fleet(4)
    for i, w in enumerate(ws):
        w.est_queue_s = 0.1 * (4 - i)
    d = p.choose(request(4096), ws)
    assert d.ranked == ["w3", "w2", "w1", "w0"]


def test_true_state_trusts_the_true_queue():
    ws = fleet(2)
    # w0's report is old: kv_cost ages it away; kv_cost_true_state is told it is exact
    ws[0].est_queue_s, ws[0].report_age_s = 1.0, 0.9
    ws[1].est_queue_s = 0.3
    r = request(8192, {"w0": pm("w0", (Tier.GPU, 511))})
    assert make_policy("kv_cost").choose(r, ws).worker_id == "w0"
    assert make_policy("kv_cost_true_state").choose(r, ws).worker_id == "w1"
    # and it ignores in-flight guesses on top of the exact queue
    ws2 = fleet(2)
    ws2[0].inflight_prefill_tokens = 400_000
    assert make_policy("kv_cost_true_state").choose(r, ws2).worker_id == "w0"
    assert make_policy("kv_cost").choose(r, ws2).worker_id == "w1"


def test_calibrated_prediction_follows_observations():
    p = make_policy("kv_cost")
    ws = fleet(1)
    r = request(8192)
    before = p.choose(r, ws).predicted_ttft
    for _ in range(60):  # the worker really prefills 2x slower than its profile
        p.observe("w0", p.choose(r, ws).predicted_ttft, 2 * before,
                  {"recomputed_tokens": 8192, "prefill_ms": 2000 * before, "loaded_tokens": {}})
    after = p.choose(r, ws).predicted_ttft
    assert after == pytest.approx(2 * before, rel=0.02)
    assert p.calibrator.error_stats().count == 60
    assert make_policy("kv_cost", calibrate=False).choose(r, ws).predicted_ttft == pytest.approx(before)


def test_explain_has_every_estimate_and_no_side_effect():
    rr = make_policy("round_robin")
    ws = fleet(3)
    r = request(4096, {"w2": pm("w2", (Tier.CPU, 100))})
    d = explain(rr, r, ws)
    assert d.worker_id == "w0" and [e.worker_id for e in d.estimates] == ["w0", "w1", "w2"]
    assert d.estimates[2].load_blocks == 100 and d.estimates[2].prefetch_blocks == {}
    assert rr.choose(r, ws).worker_id == "w0"  # the cursor did not move
    kv = make_policy("kv_cost")
    d = explain(kv, r, ws)
    assert d.worker_id == "w2" and d.prefetch_blocks == 100 and len(d.estimates) == 3
    assert d.recompute_tokens == 4096 - 100 * B
    assert len(kv.choose(r, ws).estimates) < 3  # the original still prunes
    dyn, fresh = make_policy("dynamo", temperature=1.0, seed=3), make_policy("dynamo", temperature=1.0, seed=3)
    explain(dyn, r, ws)
    assert [dyn.choose(r, ws).worker_id for _ in range(20)] == [fresh.choose(r, ws).worker_id for _ in range(20)]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_worker_with_broken_speeds_never_breaks_routing(name):
    ws = fleet(3, inflight_prefill_tokens=500)
    ws[0].cost.prefill_tokens_per_s = 0.0
    d = make_policy(name).choose(request(4096), ws)
    assert d.worker_id is not None
    if name in ("kv_cost", "kv_cost_true_state"):
        assert d.worker_id != "w0"
    capped = fleet(2, max_waiting=1, waiting_requests=1, inflight_prefill_tokens=500)
    capped[0].cost.prefill_tokens_per_s = 0.0
    d = make_policy(name).choose(request(4096), capped)
    assert d.worker_id is None and d.retry_after_s is not None and d.retry_after_s > 0
