"""Cross attention (encoder-decoder, Whisper-style) under vLLM 0.32's real Scheduler.

vLLM 0.32 ships no Llama 3.2 Vision; its cross-attention layers are scheduled for
encoder-decoder models, whose encoder input sits before the first decoder token and is
held by the cross-attention layers for the whole request, like mllama's image tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import encdec, replay
from integrations.vllm.manager import JengaKVCacheManager

BLOCK = 16


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return encdec.write_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


def _scheduler(model_dir: Path, memory_mb: int, *, jenga: bool) -> Any:
    return encdec.make_scheduler(model_dir, memory_mb, jenga=jenga)


def _wave(n: int, prefix: str, suffix: int = 0) -> list[Any]:
    return encdec.make_wave(n, prefix, suffix=suffix)  # four distinct audio clips


def test_encoder_decoder_requests_finish_and_reuse_encoder_blocks(whisper_dir: Path) -> None:
    scheduler = _scheduler(whisper_dir, 64, jenga=True)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, JengaKVCacheManager)
    assert [g.kind.value for g in manager.layout.groups] == ["full", "cross_attention"]
    seen: list[int] = []

    def check(sched: Any, _out: Any) -> None:
        manager.check_invariants(expensive=True)
        for req in sched.running:
            cross = manager.get_block_ids(req.request_id)[1]
            seen.append(len(cross))

    first = replay.replay(scheduler, _wave(8, "a"), after_step=check)
    assert first.output_tokens == {f"a{i}": 32 for i in range(8)}
    assert set(seen) == {math.ceil(encdec.ENCODER_POSITIONS / BLOCK)}  # all of it, at once
    # the same clips and decoder prompts again: the decoder prefix and the encoder K/V hit
    second = replay.replay(scheduler, _wave(8, "b", suffix=20), after_step=check)
    assert second.output_tokens == {f"b{i}": 32 for i in range(8)}
    assert second.prefix_hit_tokens == 8 * 64
    assert manager.allocator.usage().used_blocks == (0, 0)


def test_side_by_side_with_vllms_manager(whisper_dir: Path) -> None:
    """Same requests, same memory. vLLM cannot cache with cross attention (its manager
    raises), so it recomputes the shared decoder prefixes and holds every request's
    encoder K/V separately; ours shares both."""
    rows = {}
    for jenga in (False, True):
        scheduler = _scheduler(whisper_dir, 32, jenga=jenga)
        waves = (_wave(16, "a"), _wave(16, "b", suffix=20))
        reports = [replay.replay(scheduler, wave) for wave in waves]
        running = [n for r in reports for n in r.running_per_step]
        rows[jenga] = (sum(running) / len(running), sum(r.prefix_hit_tokens for r in reports))
    (their_avg, their_hits), (our_avg, our_hits) = rows[False], rows[True]
    assert our_avg >= their_avg and our_hits >= their_hits
    assert (our_avg, our_hits) != (their_avg, their_hits)
