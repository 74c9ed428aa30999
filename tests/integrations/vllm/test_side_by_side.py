"""vLLM's manager and ours under the same Scheduler, requests and memory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import replay, side_by_side
from integrations.vllm.harness.side_by_side import MANAGERS, Row, Workload, compare

SETUP = replay.SchedulerSetup(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048)
WORKLOAD = Workload(requests=32)
HYBRID = ("gemma2", "ministral", "jamba")


def _rows(
    model_dir: Path,
    case: str,
    workload: Workload = WORKLOAD,
    setup: replay.SchedulerSetup = SETUP,
    managers: tuple[str, ...] = ("vllm", "jenga"),
) -> dict[str, Row]:
    rows = compare(model_dir, [case], 256, workload, setup, managers)
    return {r.manager: r for r in rows}


def test_full_attention_matches_vllm_exactly(model_dir: Path) -> None:
    rows = _rows(model_dir, "llama", managers=MANAGERS)
    for ours in (rows["jenga"], rows["jenga-vmm"]):
        theirs = rows["vllm"]
        assert (ours.steps, ours.max_running, ours.hit_tokens) == (
            theirs.steps,
            theirs.max_running,
            theirs.hit_tokens,
        )


@pytest.mark.parametrize("requests", [32, 64])
@pytest.mark.parametrize("case", HYBRID)
def test_hybrid_models_never_fit_or_hit_fewer(model_dir: Path, case: str, requests: int) -> None:
    """On vLLM's own KV tensors (the default): at least as many running
    requests per step and prefix-hit tokens as vLLM's manager, more of one of them.
    64 requests in 256 MiB is memory pressure (vLLM preempts on gemma2 and jamba)."""
    rows = _rows(model_dir, case, Workload(requests=requests))
    ours, theirs = rows["jenga"], rows["vllm"]
    assert ours.avg_running >= theirs.avg_running
    assert ours.hit_tokens >= theirs.hit_tokens
    assert (ours.avg_running, ours.hit_tokens) != (
        theirs.avg_running,
        theirs.hit_tokens,
    )


def test_jamba_on_vmm_ranges_fits_more_concurrent_requests(model_dir: Path) -> None:
    """Unpadded Mamba and attention pages (VMM geometry) beat vLLM's padded slots."""
    rows = _rows(model_dir, "jamba", managers=("vllm", "jenga-vmm"))
    assert rows["jenga-vmm"].max_running > rows["vllm"].max_running
    assert rows["jenga-vmm"].avg_running > rows["vllm"].avg_running
    assert rows["jenga-vmm"].hit_tokens > rows["vllm"].hit_tokens


def test_the_shared_prefix_junction_makes_mamba_siblings_hit(model_dir: Path) -> None:
    """Without the boundary from `get_computed_blocks` no chunk ends where the shared
    system prompt ends, so no Mamba state exists there and siblings hit less."""
    with_junction = _rows(model_dir, "jamba", managers=("jenga",))["jenga"]
    no_junctions = replace(SETUP, jenga_options={"junctions": False})
    plain = _rows(model_dir, "jamba", setup=no_junctions, managers=("jenga",))["jenga"]
    assert with_junction.hit_tokens > plain.hit_tokens


def test_lockstep_finds_no_divergence_on_full_attention_and_one_on_gemma2(
    model_dir: Path,
) -> None:
    from argparse import Namespace

    from integrations.vllm.harness.lockstep import first_divergence

    args = Namespace(
        case="llama", window=64, question_tokens=200, memory_mb=256, requests=16, max_steps=2000
    )
    assert first_divergence(args, model_dir)[0].startswith("no divergence")
    args.case, args.window, args.question_tokens, args.memory_mb = "gemma2", 1024, 3000, 1024
    lines = first_divergence(args, model_dir)
    assert lines[0].startswith("step ") and "vllm scheduled" in lines[0]


def test_reps_alternate_managers_and_report_thread_cpu(model_dir: Path) -> None:
    """`--reps N`: every manager runs N times; the deterministic columns are one run's,
    the CPU columns median / p90 over runs and the median ratio to vLLM's."""
    rows = compare(
        model_dir, ["llama"], 256, Workload(requests=8), SETUP, ("vllm", "jenga"), reps=3
    )
    by = {r.manager: r for r in rows}
    assert len(rows) == 2
    assert by["vllm"].cpu_vs_vllm == 1.0
    for row in rows:
        assert 0 < row.sched_cpu_ms <= row.sched_cpu_p90_ms
    assert by["jenga"].cpu_vs_vllm > 0
    assert by["jenga"].steps == by["vllm"].steps
    with pytest.raises(ValueError, match="reps must be >= 1"):
        compare(model_dir, ["llama"], 256, Workload(requests=8), SETUP, ("vllm",), reps=0)


def test_timed_rounds_run_the_scheduler_alone(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--reps 2`: a checked round, then two timed rounds without the per-step checks
    (they would evict the scheduler's working set between the timed calls)."""
    checks = []
    check = replay.check_no_shared_live_blocks
    monkeypatch.setattr(
        replay, "check_no_shared_live_blocks", lambda s: checks.append(1) or check(s)
    )
    rows = compare(
        model_dir, ["llama"], 256, Workload(requests=8), SETUP, ("vllm", "jenga-vmm"), reps=2
    )
    assert len(checks) == sum(r.steps for r in rows)  # the first round's steps only
    by = {r.manager: r for r in rows}
    assert by["jenga-vmm"].committed_bytes > 0  # measured in the checked round


@pytest.mark.parametrize(
    ("case", "system_tokens"), [("qwen3-next-80b", 512), ("jamba-1.5-mini", 64)]
)
def test_mamba_hybrids_hit_a_prefix_shorter_than_vllms_gpu_block(
    model_dir: Path, case: str, system_tokens: int
) -> None:
    """vLLM at the block size its own config code picks on a GPU
    (544 tokens for Qwen3-Next, 80 for Jamba; `cases.vllm_gpu_block_size`) cannot hit a
    shared system prompt shorter than one block; ours, at 16-token blocks beside unpadded
    states, hits it in every sibling and runs more requests per step."""
    workload = Workload(
        requests=16, system_tokens=system_tokens, topics=16, question_tokens=600, output_tokens=16
    )
    setup = replace(SETUP, max_model_len=4096)
    rows = compare(model_dir, [case], 4096, workload, setup, ("vllm", "jenga-vmm"))
    by = {r.manager: r for r in rows}
    ours, theirs = by["jenga-vmm"], by["vllm"]
    assert theirs.block_size > system_tokens and ours.block_size == 16
    assert theirs.hit_tokens == 0
    assert ours.hit_tokens >= (workload.requests - 2) * (system_tokens // 16 * 16)
    assert ours.avg_running > theirs.avg_running


def test_chunk_pinning_is_measured_and_the_default_order_packs_tighter(model_dir: Path) -> None:
    """The pinning columns (`harness/pinning.py`): fractions of mapped chunk-steps, only
    for ours on VMM pages. Jamba at 64 requests in 256 MiB: with the per_group default
    (pinned order, LRU-fair: cached blocks on pages live blocks pin anyway are reused
    before older whole pages are evicted) fewer chunks are pinned beyond what the live
    blocks need than with compact order, and no fewer requests run or tokens hit."""
    workload = Workload(requests=64)
    compact = replace(SETUP, jenga_options={"order": "compact"})
    rows = _rows(model_dir, "jamba", workload, managers=("vllm", "jenga-vmm"))
    loose = _rows(model_dir, "jamba", workload, compact, managers=("jenga-vmm",))["jenga-vmm"]
    assert (rows["vllm"].single_pinned, rows["vllm"].packable) == (0.0, 0.0)
    tight = rows["jenga-vmm"]
    for row in (loose, tight):
        assert 0.0 < row.single_pinned < 1.0 and 0.0 < row.packable < 1.0
    assert tight.packable < loose.packable
    assert tight.avg_running >= loose.avg_running and tight.hit_tokens >= loose.hit_tokens


def test_trace_writes_one_record_per_step(tmp_path: Path) -> None:
    """`--trace FILE`: per case and manager, one record per scheduler step (queues,
    preemptions, free memory; pinning for ours on per_group VMM pages, mapped chunks on
    the slots geometry) — the diagnosis tool."""
    from integrations.vllm.harness.side_by_side import main

    out, trace = tmp_path / "rows.json", tmp_path / "trace.json"
    managers = ["vllm", "jenga-vmm", "jenga-vmm-group"]
    args = ["--cases", "gemma2", "--requests", "8", "--managers", *managers]
    assert main([*args, "--json", str(out), "--trace", str(trace)]) == 0
    rows = {r["manager"]: r for r in json.loads(out.read_text())["rows"]}
    steps = json.loads(trace.read_text())
    for manager, row in rows.items():
        records = steps[f"gemma2/{manager}"]
        assert len(records) == row["steps"]
        assert sum(r["preempted"] for r in records) == row["preemptions"]
        assert max(r["running"] for r in records) <= row["max_running"]
    assert "packable" in steps["gemma2/jenga-vmm-group"][0]  # per_group pages' pinning
    assert steps["gemma2/jenga-vmm"][0]["mapped_chunks"] > 0  # the slots geometry's chunks
    assert "packable" not in steps["gemma2/vllm"][0]


def test_gemma2_9b_at_40_gib_runs_and_hits_at_least_as_much_as_vllm(model_dir: Path) -> None:
    """Gemma 2 9B at 40 GiB: exact 21-chunk pages (least waste in a large pool) and the
    LRU-fair pinned order run and hit at least as much as vLLM, committing no more."""
    workload = Workload(requests=256, question_tokens=2000)
    setup = replace(SETUP, max_model_len=3072)
    rows = compare(model_dir, ["gemma2-9b"], 40960, workload, setup, ("vllm", "jenga-vmm"))
    by = {r.manager: r for r in rows}
    ours, theirs = by["jenga-vmm"], by["vllm"]
    assert ours.avg_running >= theirs.avg_running
    assert ours.hit_tokens >= theirs.hit_tokens
    assert ours.committed_bytes <= theirs.committed_bytes


def test_jamba_16_requests_on_vmm_pages_run_and_hit_as_much_as_vllm(model_dir: Path) -> None:
    """Jamba, 16 requests in 256 MiB: vLLM runs 7.88 requests per step and hits 7,168
    tokens. Ours on per_group VMM pages once cached every state its decode steps wrote
    (vLLM's align mode caches none); they filled the 9-chunk Mamba pages, and the
    system prompt's state, the least recently used, was evicted in some groups (3,072
    hit tokens)."""
    rows = _rows(model_dir, "jamba", Workload(requests=16), managers=("vllm", "jenga-vmm"))
    ours, theirs = rows["jenga-vmm"], rows["vllm"]
    assert ours.avg_running >= 0.98 * theirs.avg_running
    assert ours.hit_tokens >= theirs.hit_tokens
    assert ours.committed_bytes <= theirs.committed_bytes


def test_jamba_in_128_mib_runs_on_vmm_pages_and_keeps_up_with_vllm(model_dir: Path) -> None:
    """128 MiB (63 chunks): with the least-waste Mamba page (9 chunks per 2-layer group)
    one page in each of Jamba's 8 groups needed 64 chunks and the manager refused to
    start; with the default epsilon pages now shrink until one in each group fits."""
    rows = compare(model_dir, ["jamba"], 128, Workload(requests=16), SETUP, ("vllm", "jenga-vmm"))
    ours, theirs = (next(r for r in rows if r.manager == m) for m in ("jenga-vmm", "vllm"))
    assert ours.avg_running >= theirs.avg_running
    assert ours.hit_tokens >= theirs.hit_tokens
    assert ours.committed_bytes <= theirs.committed_bytes


@pytest.mark.parametrize(("memory_mb", "requests"), [(128, 32), (512, 256)])
def test_ministral_window_blocks_packed_into_pinned_pages_keep_up_with_vllm(
    model_dir: Path, memory_mb: int, requests: int
) -> None:
    """Ministral (three sliding groups per full one) on per_group VMM pages, sweep cells
    (seed 0 at 128 MiB, seed 2 at 512 MiB). A prefill's kept window blocks and each
    decode block once took free slots and new pages first, so live window blocks spread
    over many pages that no group could reclaim: 0.978x and 0.903x vLLM's average
    running. With ``pack_window_blocks`` they fill the demoted slots of the pages live
    blocks pin most."""
    workload = Workload(requests=requests, seed=0 if memory_mb == 128 else 2)
    setup = replace(
        side_by_side.scheduler_setup(workload), jenga_options={"pack_window_blocks": True}
    )
    managers = ("vllm", "jenga-vmm-group")
    rows = compare(model_dir, ["ministral"], memory_mb, workload, setup, managers)
    ours, theirs = (next(r for r in rows if r.manager == m) for m in managers[::-1])
    assert ours.avg_running >= 0.98 * theirs.avg_running
    assert ours.hit_tokens >= 0.98 * theirs.hit_tokens
    assert ours.committed_bytes <= theirs.committed_bytes


@pytest.mark.parametrize(("memory_mb", "requests", "seed"), [(128, 32, 0), (512, 256, 2)])
def test_ministral_on_the_default_vmm_geometry_keeps_up_with_vllm(
    model_dir: Path, memory_mb: int, requests: int, seed: int
) -> None:
    """Ministral's groups all have vLLM's slot size, so the default geometry ("auto") is
    "slots": memory moves between groups block by block as in vLLM, and no sliding-window
    group strands chunks in pages a few live blocks pin (per_group ran 0.978x and 0.903x
    vLLM's average running in these sweep cells). Committed: the chunks mapped slots
    touch, at most vLLM's buffer."""
    workload = Workload(requests=requests, seed=seed)
    setup = side_by_side.scheduler_setup(workload)
    managers = ("vllm", "jenga-vmm", "jenga-vmm-group")
    rows = compare(model_dir, ["ministral"], memory_mb, workload, setup, managers)
    theirs, ours, per_group = (next(r for r in rows if r.manager == m) for m in managers)
    assert ours.avg_running >= theirs.avg_running
    assert ours.hit_tokens >= theirs.hit_tokens
    assert 0 < ours.committed_bytes <= theirs.committed_bytes
    assert per_group.avg_running < ours.avg_running  # the geometry is the difference
