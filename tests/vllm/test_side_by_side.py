"""vLLM's manager and ours under the same Scheduler, requests and memory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm import replay
from integrations.vllm.side_by_side import Row, Workload, compare

SETUP = replay.SchedulerSetup(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048)
WORKLOAD = Workload(requests=32)


def _rows(
    model_dir: Path, case: str, workload: Workload = WORKLOAD, setup: replay.SchedulerSetup = SETUP
) -> dict[str, Row]:
    rows = compare(model_dir, [case], 256, workload, setup)
    return {r.manager: r for r in rows}


def test_full_attention_matches_vllm_exactly(model_dir: Path) -> None:
    rows = _rows(model_dir, "llama")
    ours, theirs = rows["jenga"], rows["vllm"]
    assert (ours.steps, ours.max_running, ours.prefix_hit_tokens) == (
        theirs.steps,
        theirs.max_running,
        theirs.prefix_hit_tokens,
    )


def test_jamba_fits_more_concurrent_requests(model_dir: Path) -> None:
    rows = _rows(model_dir, "jamba")
    assert rows["jenga"].max_running > rows["vllm"].max_running
    assert rows["jenga"].avg_running > rows["vllm"].avg_running


@pytest.mark.parametrize("case", ["gemma2", "ministral"])
def test_sliding_window_models_hit_more_and_fit_as_many(model_dir: Path, case: str) -> None:
    rows = _rows(model_dir, case)
    ours, theirs = rows["jenga"], rows["vllm"]
    assert ours.prefix_hit_tokens > theirs.prefix_hit_tokens
    assert ours.avg_running >= theirs.avg_running


@pytest.mark.xfail(
    strict=True,
    reason="known shortfall of the default (compact) order: sliding-window pages full of "
    "cached blocks pin memory the full-attention group needs (jenga moves memory between "
    "groups only as whole evictable pages); the pinned order meets this bar (test below) "
    "but misses it at 256 requests in 1 GiB; see docs/vllm.md",
)
def test_ministral_under_memory_pressure_fits_or_hits_as_much(model_dir: Path) -> None:
    rows = _rows(model_dir, "ministral", Workload(requests=64))
    ours, theirs = rows["jenga"], rows["vllm"]
    assert (
        ours.avg_running >= theirs.avg_running or ours.prefix_hit_tokens >= theirs.prefix_hit_tokens
    )


PINNED = replace(SETUP, jenga_options={"order": "pinned"})


def test_pinned_order_under_memory_pressure_meets_the_bar(model_dir: Path) -> None:
    """64 requests in 256 MiB: with the pinned order both sliding-window models hit more
    prefix tokens than vLLM, gemma2 also runs more requests per step."""
    gemma2 = _rows(model_dir, "gemma2", Workload(requests=64), PINNED)
    assert gemma2["jenga"].prefix_hit_tokens > gemma2["vllm"].prefix_hit_tokens
    assert gemma2["jenga"].avg_running > gemma2["vllm"].avg_running
    ministral = _rows(model_dir, "ministral", Workload(requests=64), PINNED)
    assert ministral["jenga"].prefix_hit_tokens > ministral["vllm"].prefix_hit_tokens
    assert ministral["jenga"].preemptions < 15  # the compact order preempts 15 times here
