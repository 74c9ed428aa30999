"""The simulator's host tier: replacement order, transfer time in TTFT, nothing lost,
bad configurations refused with their numbers."""

from __future__ import annotations

import json
import math
import random
from collections import deque

import pytest
from jenga.sim.cli import main
from jenga.sim.hardware import GiB, get_gpu
from jenga.sim.models import ComputeShape, get_model
from jenga.sim.protocol import SimError
from jenga.sim.tier_engine import GpuBlock, TierEngine, TierEngineConfig, block_keys
from jenga.sim.tier_scenarios import CONFIGS, TIER_SCENARIOS, get_tier_scenario
from jenga.sim.tiers import HostTier, Link, TierConfig, TierError
from jenga.sim.workloads import Request, Trace, make_trace, random_ids

MODEL = get_model("llama-3.2-1b")  # full attention, 32 KiB per token, 16 layers
GPU = get_gpu("h100-80gb")
BLOCK = 16 * MODEL.bytes_per_token
LINK = Link("test link", 10e9, 20e-6)


def _tier(**changes: object) -> TierConfig:
    base: dict[str, object] = {"host_bytes": 8 * GiB, "host_memory_bytes": 64 * GiB, "link": LINK}
    base.update(changes)
    return TierConfig(**base)  # type: ignore[arg-type]


# --- the host tier's replacement order ---------------------------------------------------


def test_lru_evicts_the_least_recently_used_first():
    host = HostTier(3, "lru", lambda key: 0)
    for key in "abc":
        assert host.insert(key, 1, 0.0) == []
    host.touch("a")
    assert list(host.eviction_order()) == ["b", "c", "a"]
    assert host.insert("d", 1, 0.0) == ["b"]
    assert host.insert("e", 2, 0.0) == ["c", "a"]
    assert sorted(host.entries) == ["d", "e"]
    host.check_invariants()


def test_score_policy_evicts_the_smallest_score_then_the_oldest():
    scores = {"a": 2, "b": 0, "c": 1, "d": 0}
    host = HostTier(4, "score", lambda key: scores.get(key, 0))
    for key in "abcd":
        host.insert(key, 1, 0.0)
    assert list(host.eviction_order()) == ["b", "d", "c", "a"]
    scores["b"] = 3  # a request that reads b entered the window and was admitted
    host.rescore("b")
    assert list(host.eviction_order()) == ["d", "c", "a", "b"]
    assert host.insert("e", 2, 0.0) == ["d", "c"]
    host.check_invariants()


def test_a_score_changed_without_rescore_is_caught_by_the_invariants():
    scores = {"a": 0}
    host = HostTier(2, "score", lambda key: scores[key])
    host.insert("a", 1, 0.0)
    scores["a"] = 1
    with pytest.raises(AssertionError, match="bucket 0 is not its score's"):
        host.check_invariants()


def test_pinned_entries_stay_and_a_full_pinned_tier_refuses_without_change():
    host = HostTier(2, "lru", lambda key: 0)
    host.insert("a", 1, 0.0)
    host.insert("b", 1, 0.0)
    host.entries["a"].pins = 1
    assert host.insert("c", 1, 0.0) == ["b"]
    host.entries["c"].pins = 1
    assert host.insert("d", 1, 0.0) is None
    assert sorted(host.entries) == ["a", "c"] and host.used_bytes == 2
    assert host.insert("big", 3, 0.0) is None
    host.check_invariants()


def test_link_time_is_latency_plus_bytes_over_bandwidth():
    assert LINK.transfer_s(0) == 0.0
    assert LINK.transfer_s(10**9) == pytest.approx(20e-6 + 0.1, rel=1e-12)


# --- bad configurations ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"host_bytes": 65 * GiB}, r"host tier of 69793218560 bytes \(65.0 GiB\) exceeds the "
         r"host memory of 68719476736 bytes \(64.0 GiB\)"),
        ({"host_bytes": 0}, r"host tier size must be > 0 bytes, got 0"),
        ({"host_bytes": -5}, r"host tier size must be > 0 bytes, got -5"),
        ({"high_water": 0.0}, r"high-water mark must be in \(0, 1\], got 0.0"),
        ({"high_water": 1.5}, r"high-water mark must be in \(0, 1\], got 1.5"),
        ({"high_water": -0.1}, r"high-water mark must be in \(0, 1\], got -0.1"),
        ({"high_water": math.nan}, r"high-water mark must be in \(0, 1\], got nan"),
        ({"policy": "lfu"}, r"policy must be one of \('lru', 'score'\), got 'lfu'"),
        ({"window": 0}, r"scheduler window must hold >= 1 request, got 0"),
    ],
)  # fmt: skip
def test_bad_tier_configurations_are_refused_naming_the_numbers(changes, message):
    with pytest.raises(TierError, match=message):
        _tier(**changes)


def test_a_full_high_water_mark_is_accepted():
    assert _tier(high_water=1.0).high_water == 1.0


@pytest.mark.parametrize(
    ("bandwidth", "latency", "message"),
    [(0.0, 0.0, r"bandwidth must be > 0 B/s, got 0.0"), (1e9, -1.0, r"latency must be >= 0 s")],
)
def test_bad_links_are_refused(bandwidth, latency, message):
    with pytest.raises(TierError, match=message):
        Link("bad", bandwidth, latency)


def test_the_tier_engine_refuses_models_that_are_not_full_attention():
    with pytest.raises(SimError, match="full-attention models only; gemma-2-9b"):
        TierEngine(get_model("gemma-2-9b"), GPU, GiB, TierEngineConfig())


# --- the engine: a reload instead of a recompute, timed ----------------------------------


def _evicted_then_revisited(prompt_len: int = 160) -> tuple[Trace, int]:
    """A (``prompt_len`` tokens) runs, three 400-token fillers push its blocks out of a
    30-block GPU, B = A's prompt + 32 tokens arrives when all is done."""
    rng = random.Random(7)
    prompt_a = random_ids(rng, prompt_len)
    reqs = [Request("a", prompt_a, random_ids(rng, 1), 0.0)]
    reqs += [Request(f"f{i}", random_ids(rng, 400), random_ids(rng, 1), 0.0) for i in range(3)]
    reqs.append(Request("b", prompt_a + random_ids(rng, 32), random_ids(rng, 1), 1000.0))
    return Trace("revisit", tuple(reqs)), prompt_len + 32


def _run(trace: Trace, kv_blocks: int, **tier: object) -> TierEngine:
    config = TierEngineConfig(tier=_tier(high_water=1.0, **tier), check_invariants_every=1)
    engine = TierEngine(MODEL, GPU, kv_blocks * BLOCK, config)
    engine.run(trace)
    return engine


def _prefill_s(first: int, end: int, kv_read: bool) -> float:
    attention = ComputeShape.of(MODEL).attention_flops(MODEL, first, end, 0)
    read = end * MODEL.bytes_per_token if kv_read else 0
    return GPU.step_time_s(MODEL.weight_bytes, read, end - first, attention)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_host_hit_is_reloaded_and_its_transfer_counted_in_ttft(pipelined):
    trace, b_len = _evicted_then_revisited()
    engine = _run(trace, 30, pipelined=pipelined)
    stats = engine.stats
    assert stats.host_hit_tokens == 160  # A's ten full blocks, none recomputed
    assert stats.reload_bytes == 10 * BLOCK
    assert stats.lost_blocks == 0
    load = LINK.transfer_s(10 * BLOCK)
    if pipelined:
        layers = MODEL.num_model_layers
        compute = _prefill_s(160, b_len, kv_read=False)
        load = max(load / layers, load - (layers - 1) / layers * compute)
    assert stats.ttft_s[-1] == pytest.approx(load + _prefill_s(160, b_len, True), rel=1e-9)


def test_without_a_host_tier_the_evicted_prefix_is_recomputed():
    trace, b_len = _evicted_then_revisited()
    config = TierEngineConfig(check_invariants_every=1)
    engine = TierEngine(MODEL, GPU, 30 * BLOCK, config)
    stats = engine.run(trace)
    assert stats.host_hit_tokens == 0 and stats.gpu_hit_tokens == 0
    assert stats.lost_blocks > 0
    assert stats.ttft_s[-1] == pytest.approx(_prefill_s(0, b_len, True), rel=1e-9)


def test_synchronous_offloads_delay_the_step_that_evicts():
    trace, _ = _evicted_then_revisited()
    stats = _run(trace, 30).stats
    # every block that left the GPU went over the link: A's ten, then the fillers'
    assert stats.offload_bytes > 0 and stats.offload_wait_s > 0
    assert stats.offload_bytes % BLOCK == 0


def _chat(clients: int = 4, rounds: int = 3) -> Trace:
    return make_trace(
        "multi-turn",
        seed=3,
        rate=4.0,
        num_clients=clients,
        num_rounds=rounds,
        shared_prefix_len=0,
        request_len=96,
        output_len=48,
        closed_loop=1,
        think_s=0.5,
    )


@pytest.mark.parametrize("policy", ["lru", "score"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_nothing_is_lost_with_room_on_the_host(policy, prefetch):
    """A closed-loop chat on a GPU far too small for its history: with a host tier large
    enough, every turn hits its whole history, as on an unbounded GPU."""
    trace = _chat()
    unbounded = TierEngine(MODEL, GPU, 10_000 * BLOCK, TierEngineConfig()).run(trace)
    config = TierEngineConfig(
        tier=_tier(policy=policy, prefetch=prefetch, high_water=0.9), check_invariants_every=1
    )
    engine = TierEngine(MODEL, GPU, 40 * BLOCK, config)
    stats = engine.run(trace)
    assert unbounded.gpu_hit_tokens > 0 and unbounded.host_hit_tokens == 0
    assert stats.host_hit_tokens > 0
    assert stats.gpu_hit_tokens + stats.host_hit_tokens == unbounded.gpu_hit_tokens
    assert stats.lost_blocks == 0 and stats.host_evicted_blocks == 0
    assert len(stats.ttft_s) == len(trace.requests)
    assert engine.score == {}  # +1 window, +1 admission, -2 completion: all back to zero


def test_a_small_host_tier_loses_blocks_and_says_so():
    trace = _chat()
    config = TierEngineConfig(tier=_tier(host_bytes=8 * BLOCK), check_invariants_every=1)
    stats = TierEngine(MODEL, GPU, 40 * BLOCK, config).run(trace)
    assert stats.host_evicted_blocks > 0 and stats.lost_blocks > 0


def test_write_through_copies_every_computed_block_once():
    trace = _chat(clients=2, rounds=2)
    config = TierEngineConfig(
        tier=_tier(write_through=True, pipelined=False), check_invariants_every=1
    )
    stats = TierEngine(MODEL, GPU, 10_000 * BLOCK, config).run(trace)
    full_blocks = {
        k for r in trace.requests for k in _keys(r)[: (r.prompt_len + r.output_len - 1) // 16]
    }
    assert stats.offload_bytes == len(full_blocks) * BLOCK


def _keys(r: Request) -> tuple[object, ...]:
    return block_keys(r.prompt + r.output, 16)


# --- jenga-sim --------------------------------------------------------------------------


SMALL_CHAT = ["--scenario", "car-chat", "--param", "num_clients=4", "--param", "num_rounds=2"]


def test_each_car_scenario_prints_ttft_per_configuration(tmp_path, capsys):
    out, md = tmp_path / "car.json", tmp_path / "car.md"
    assert main([*SMALL_CHAT, "--no-progress", "--json", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    table = md.read_text().splitlines()
    assert [line.split(" | ")[0] for line in table[4:]] == [f"| {c}" for c in CONFIGS]
    assert list(doc["configs"]) == list(CONFIGS)
    for row in doc["configs"].values():
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert doc["configs"]["no-reuse"]["gpu_hit"] == 0
    text = capsys.readouterr().out
    for name in CONFIGS:
        assert name in text
    assert set(TIER_SCENARIOS) == {"car-chat", "car-longdoc", "car-reload"}
    assert get_tier_scenario("car-longdoc").model == "llama-2-7b-32k"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--high-water", "1.5"], r"high-water mark must be in (0, 1], got 1.5"),
        (["--high-water", "0"], r"high-water mark must be in (0, 1], got 0.0"),
        (["--host-gib", "0"], "host tier size must be > 0 bytes, got 0"),
        (["--host-gib", "200"], "host tier of 214748364800 bytes (200.0 GiB) exceeds"),
        (["--kv-gib", "4"], "--kv-gib do not apply to the tier scenario car-chat"),
    ],
)
def test_bad_tier_flags_exit_2_naming_the_value(args, message, capsys):
    assert main([*SMALL_CHAT, *args]) == 2
    assert message in capsys.readouterr().err


def test_tier_flags_on_other_scenarios_are_refused(capsys):
    assert main(["--scenario", "mamba-chat", "--host-gib", "8"]) == 2
    assert "--host-gib: only the tier scenarios read them" in capsys.readouterr().err


def test_reloading_a_document_beats_recomputing_it(tmp_path):
    """car-reload: second questions on documents the GPU no longer holds."""
    out = tmp_path / "reload.json"
    assert main(["--scenario", "car-reload", "--no-progress", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["configs"]
    assert rows["no-reuse"]["revisits"] == rows["tier-lru"]["revisits"] == 16
    assert rows["gpu-only"]["host_hit"] == 0 and rows["tier-lru"]["host_hit"] > 0.4
    recompute, reload = rows["no-reuse"], rows["tier-lru"]
    assert reload["revisit_ttft_mean_s"] < 0.5 * recompute["revisit_ttft_mean_s"]


def test_prefetch_hides_reloads_when_requests_wait_for_a_slot(tmp_path):
    """One request at a time, arrivals faster than service: the windowed second questions
    are reloaded while the running request finishes (CaR's TPOT x remaining rule)."""
    out = tmp_path / "slots.json"
    argv = ["--scenario", "car-reload", "--max-num-seqs", "1", "--rate", "2", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["configs"]
    for policy in ("lru", "score"):
        plain, ahead = rows[f"tier-{policy}"], rows[f"tier-{policy}-prefetch"]
        assert plain["prefetches"] == 0 < ahead["prefetches"]
        assert ahead["revisit_ttft_mean_s"] < plain["revisit_ttft_mean_s"]
        assert ahead["lost_blocks"] == plain["lost_blocks"] == 0


def test_a_lower_high_water_mark_offloads_ahead_and_waits_less():
    waits = []
    for high_water in (0.5, 0.9, 1.0):
        config = TierEngineConfig(tier=_tier(high_water=high_water), check_invariants_every=1)
        stats = TierEngine(MODEL, GPU, 40 * BLOCK, config).run(_chat())
        assert stats.lost_blocks == 0
        waits.append(stats.offload_wait_s)
    assert 0 < waits[0] < waits[1] < waits[2]


def _engine_with_cached_block(high_water: float) -> tuple[TierEngine, object]:
    """An engine whose GPU holds one cached (unreferenced) block, of 2 blocks in all."""
    config = TierEngineConfig(tier=_tier(high_water=high_water))
    engine = TierEngine(MODEL, GPU, 2 * BLOCK, config)
    engine.gpu_blocks["k"] = GpuBlock()
    engine.evictable["k"] = None
    return engine, "k"


def test_background_offload_frees_the_gpu_copy_when_the_copy_lands():
    engine, key = _engine_with_cached_block(high_water=0.4)
    engine._maybe_offload(0.0)
    end = LINK.transfer_s(BLOCK)
    assert engine.offloads == [(end, key)] and engine.host.entries[key].ready_s == end
    engine._finish_transfers(end / 2)
    assert key in engine.gpu_blocks  # still readable on the GPU while the copy runs
    engine._finish_transfers(end)
    assert key not in engine.gpu_blocks and key in engine.host and engine.num_free == 2


def test_a_hit_while_the_offload_is_in_flight_keeps_the_gpu_copy():
    engine, key = _engine_with_cached_block(high_water=0.4)
    engine._maybe_offload(0.0)
    engine._claim(key)  # a request hits the block mid-offload
    engine._finish_transfers(LINK.transfer_s(BLOCK))
    assert engine.gpu_blocks[key].ref == 1 and key in engine.host  # on both tiers
    assert engine.gpu_blocks[key].offload_end is None
    engine._unclaim([key])
    engine._maybe_offload(1.0)  # above the mark again: the copy exists, the GPU one goes
    assert key not in engine.gpu_blocks and engine.stats.offload_bytes == BLOCK


def test_seeds_report_each_configuration_against_no_reuse(tmp_path):
    out, md = tmp_path / "seeds.json", tmp_path / "seeds.md"
    argv = ["--scenario", "car-reload", "--seeds", "0-1", "--json", str(out), "--markdown", str(md)]
    assert main(argv) == 0
    per_seed = json.loads(out.read_text())["per_seed"]
    assert sorted(per_seed) == ["0", "1"]
    lines = md.read_text().splitlines()
    assert lines[4] == "| no-reuse | +0% (+0% to +0%) | +0% (+0% to +0%) | +0% (+0% to +0%) |"
    assert [line.split(" | ")[0] for line in lines[4:]] == [f"| {c}" for c in CONFIGS]
    reload = per_seed["0"]["tier-lru"]["revisit_ttft_mean_s"]
    assert reload < per_seed["0"]["no-reuse"]["revisit_ttft_mean_s"]


def test_window_priority_orders_gpu_hits_then_no_history_then_host_hits():
    config = TierEngineConfig(tier=_tier(window_priority=True))
    engine = TierEngine(MODEL, GPU, 100 * BLOCK, config)
    rng = random.Random(1)
    reqs = {n: Request(n, random_ids(rng, 40), random_ids(rng, 1)) for n in "abcde"}
    states = {n: engine._state(r) for n, r in reqs.items()}
    engine.gpu_blocks[states["a"].keys[0]] = GpuBlock()  # a: its history on the GPU
    engine.evictable[states["a"].keys[0]] = None
    for n in "ce":  # c, e: their history on the host
        engine.host.insert(states[n].keys[0], BLOCK, 0.0)
    waiting = deque(states[n] for n in "cebda")
    window = list(waiting)[:4]  # a is outside the window: it keeps its place
    engine._maybe_prioritize(waiting, window)
    assert [s.request.req_id for s in waiting] == ["b", "d", "c", "e", "a"]
    engine._maybe_prioritize(waiting, list(waiting))
    assert [s.request.req_id for s in waiting] == ["a", "b", "d", "c", "e"]


def test_scores_follow_window_admission_and_completion():
    """CaR's events: +1 entering the window, +1 at admission, -2 at completion."""
    engine = TierEngine(MODEL, GPU, 100 * BLOCK, TierEngineConfig(tier=_tier(policy="score")))
    rng = random.Random(2)
    shared = random_ids(rng, 48)  # three blocks both prompts start with
    first, second = (
        engine._state(Request(n, shared + random_ids(rng, 8), random_ids(rng, 1))) for n in "xy"
    )
    waiting = deque([first, second])
    engine._update_window(waiting, 0.0)
    engine._update_window(waiting, 0.0)  # still windowed: counted once
    keys = first.prompt_keys
    assert keys == second.prompt_keys[:3] and len(keys) == 3
    assert [engine.score[k] for k in keys] == [2, 2, 2]
    n = engine._admit(first, 8192, 0.0)
    assert n == 56 and [engine.score[k] for k in keys] == [3, 3, 3]
    waiting.popleft()
    finished = engine._execute([(first, n)], [first], 1.0)
    assert finished == [first] and [engine.score[k] for k in keys] == [1, 1, 1]


def test_a_gpu_hit_prefills_only_the_new_tokens():
    trace, b_len = _evicted_then_revisited()
    stats = TierEngine(MODEL, GPU, 1000 * BLOCK, TierEngineConfig()).run(trace)
    assert stats.gpu_hit_tokens == 160 and stats.host_hit_tokens == 0
    assert stats.ttft_s[-1] == pytest.approx(_prefill_s(160, b_len, True), rel=1e-9)
