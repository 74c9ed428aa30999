"""The mini engine on every family the HF cache stores: tokens equal per-request `generate`.

Four requests (two share a 16-token prefix) join one step apart and run with chunked
prefill (token budget 12), first with room to spare (prefix hits), then in half the
chunks the first run peaked at (preemption: a request is freed and recomputed, often
from the prefix cache). Windows and chunks are 8 tokens, 4-token blocks, state
checkpoints every 8 tokens, so windows slide, chunks roll over and states move.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from integrations.engine import EngineConfig, MiniEngine
from tests.integrations.hf.families import FAMILIES, tiny_model

CHUNK = 4096


def workload() -> list[tuple[str, list[int], int, int]]:
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 128, (16,), generator=gen).tolist()
    out = []
    for i in range(4):
        tail = torch.randint(3, 128, (3 + 2 * i,), generator=gen).tolist()
        out.append((f"r{i}", (prefix if i % 2 == 0 else []) + tail, 8, i))
    return out


def reference(model, requests) -> dict[str, list[int]]:
    out = {}
    for rid, prompt, n, _ in requests:
        ids = torch.tensor([prompt])
        seq = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False,
        )  # fmt: skip
        out[rid] = seq[0, len(prompt) :].tolist()
    return out


def run(model, requests, budget_chunks: int) -> MiniEngine:
    config = EngineConfig(
        token_budget=12, budget_bytes=budget_chunks * CHUNK, chunk_bytes=CHUNK, block_size=4,
        checkpoint_interval=8,
    )  # fmt: skip
    engine = MiniEngine(model, config)
    for rid, prompt, n, arrival in requests:
        engine.add_request(rid, prompt, n, arrival_step=arrival)
    engine.outputs = engine.run()  # type: ignore[attr-defined]
    engine.kv.check_invariants(expensive=True)
    return engine


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_tokens_equal_generate_with_hits_and_preemption(name: str):
    model = tiny_model(name)
    model.generation_config.eos_token_id = None
    requests = workload()
    ref = reference(model, requests)
    roomy = run(model, requests, budget_chunks=256)
    assert roomy.outputs == ref
    assert roomy.stats["prefix.hit_tokens"] >= 16  # r2 reuses r0's 16-token prefix
    peak = roomy.kv.stats()["chunks.created.current"]  # chunks are reused, never released
    roomy.close()
    tight = run(model, requests, budget_chunks=max(peak // 2, 1))
    assert tight.outputs == ref
    assert tight.stats["preemptions"] > 0
    tight.close()
