"""MiniEngine parallel sampling (``n``): sample i of a request equals transformers'
sampling seeded ``seed + i``, the samples share the prompt's blocks (forks), and bad
``n`` is refused at `add_request`."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from integrations.engine import EngineConfig, MiniEngine  # noqa: E402
from tests.integrations.engine.test_engine import CHUNK, tiny  # noqa: E402

PROMPT = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(8)).tolist()
NEW = 8
SEED = 100


def reference(model, prompt: list[int], seed: int) -> list[int]:
    """transformers' sampling with no logits processor (top_k=0), seeded ``seed``."""
    ids = torch.tensor([prompt])
    torch.manual_seed(seed)
    seq = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=True,
        top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0,
    )  # fmt: skip
    return seq[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llama():
    model = tiny("llama")
    return model, [reference(model, PROMPT, SEED + i) for i in range(4)]


def engine(model, **config) -> MiniEngine:
    return MiniEngine(model, EngineConfig(chunk_bytes=CHUNK, block_size=4, **config))


def test_four_samples_equal_seeded_transformers_sampling(llama):
    model, ref = llama
    eng = engine(model, token_budget=64, budget_bytes=64 * CHUNK)
    eng.add_request("a", PROMPT, NEW, n=4, seed=SEED)
    out = eng.run()
    assert [out[("a", i)] for i in range(4)] == ref
    assert len({tuple(r) for r in ref}) > 1  # the samples differ
    stats = eng.kv.stats()
    # 30 tokens: the prompt's last block holds 2 of 4; three samples copy it, the last
    # holder writes in place
    assert stats["kv.cow.blocks"] == 3
    eng.kv.check_invariants(expensive=True)
    eng.close()


def test_samples_under_preemption_equal_the_reference(llama):
    model, ref = llama
    eng = engine(model, token_budget=16, budget_bytes=6 * CHUNK)
    eng.add_request("a", PROMPT, NEW, n=4, seed=SEED)
    out = eng.run()
    assert [out[("a", i)] for i in range(4)] == ref
    assert eng.stats["preemptions"] > 0
    eng.kv.check_invariants(expensive=True)
    eng.close()


def test_one_seeded_request_samples_too(llama):
    model, ref = llama
    eng = engine(model, budget_bytes=64 * CHUNK)
    eng.add_request("a", PROMPT, NEW, seed=SEED + 2)
    assert eng.run() == {"a": ref[2]}
    eng.close()


def test_bad_sample_counts_are_refused_at_add_request(llama):
    model, _ = llama
    eng = engine(model, budget_bytes=64 * CHUNK)
    for n in (0, -1, 2.0):
        with pytest.raises(ValueError, match=f"n must be an int > 0, got {n!r}"):
            eng.add_request("a", PROMPT, NEW, n=n, seed=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n=2 samples need a seed"):
        eng.add_request("a", PROMPT, NEW, n=2)
    assert not eng.pending
    eng.close()
    eng = engine(model, budget_bytes=64 * CHUNK, overlap=True)
    with pytest.raises(ValueError, match="n=3 samples are not served with overlap=True"):
        eng.add_request("a", PROMPT, NEW, n=3, seed=1)
    eng.close()


def test_sliding_window_samples_equal_the_reference():
    model = tiny("mistral")
    ref = [reference(model, PROMPT, SEED + i) for i in range(3)]
    eng = engine(model, token_budget=16, budget_bytes=64 * CHUNK)
    eng.add_request("m", PROMPT, NEW, n=3, seed=SEED)
    out = eng.run()
    assert [out[("m", i)] for i in range(3)] == ref
    assert eng.kv.stats()["kv.cow.blocks"] == 2
    eng.kv.check_invariants(expensive=True)
    eng.close()
