"""MiniEngine beam search (``beams=k``): the k sequences equal transformers'
``generate(num_beams=k, num_return_sequences=k)``, with and without preemption; beams
share the prompt's blocks (forks); bad widths and options are refused at `add_request`."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from integrations.engine import EngineConfig, MiniEngine  # noqa: E402
from tests.integrations.engine.test_engine import CHUNK, tiny  # noqa: E402
from tests.integrations.hf.families import tiny_model  # noqa: E402

PROMPT = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(8)).tolist()
NEW = 6


def reference(model, prompt: list[int], beams: int) -> list[list[int]]:
    ids = torch.tensor([prompt])
    seq = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
        num_beams=beams, num_return_sequences=beams, pad_token_id=0,
    )  # fmt: skip
    return seq[:, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llama():
    model = tiny("llama")
    return model, reference(model, PROMPT, 4)


def engine(model, **config) -> MiniEngine:
    return MiniEngine(model, EngineConfig(chunk_bytes=CHUNK, block_size=4, **config))


def test_four_beams_equal_transformers_beam_search(llama):
    model, ref = llama
    eng = engine(model, token_budget=64, budget_bytes=64 * CHUNK)
    eng.add_request("a", PROMPT, NEW, beams=4)
    eng.add_request("g", PROMPT[:9], NEW)  # a greedy request beside the beams
    out = eng.run()
    assert [out[("a", i)] for i in range(4)] == ref
    assert len({tuple(r) for r in ref}) == 4
    assert (
        out["g"]
        == model.generate(
            torch.tensor([PROMPT[:9]]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )[0, 9:].tolist()
    )
    # forks: the prompt's 7 full blocks are never copied, only each beam's last block
    assert 0 < eng.kv.stats()["kv.cow.blocks"] <= 4 * (NEW - 1)
    eng.kv.check_invariants(expensive=True)
    assert eng.kv.allocator.usage().used_blocks[0] == 0  # every beam freed
    eng.close()


def test_beams_under_preemption_equal_the_reference(llama):
    model, ref = llama
    eng = engine(model, token_budget=16, budget_bytes=10 * CHUNK)
    eng.add_request("a", PROMPT, NEW, beams=4)
    eng.add_request("b", PROMPT[::-1], NEW, beams=4, arrival_step=1)
    out = eng.run(max_steps=400)
    assert [out[("a", i)] for i in range(4)] == ref
    assert [out[("b", i)] for i in range(4)] == reference(model, PROMPT[::-1], 4)
    assert eng.stats["preemptions"] > 0
    eng.kv.check_invariants(expensive=True)
    eng.close()


def test_beams_on_the_packed_forward_under_preemption_equal_the_reference(llama):
    """attention='flash': the packed Llama forward over the block tables (torch's SDPA on
    CPU) reads the forked beams' shared blocks the same way."""
    model, ref = llama
    eng = engine(model, token_budget=16, budget_bytes=10 * CHUNK, attention="flash")
    eng.add_request("a", PROMPT, NEW, beams=4)
    eng.add_request("s", PROMPT, NEW, n=3, seed=5)  # samples competing for the chunks
    out = eng.run(max_steps=400)
    assert [out[("a", i)] for i in range(4)] == ref
    assert eng.stats["preemptions"] > 0
    eng.kv.check_invariants(expensive=True)
    eng.close()


@pytest.mark.parametrize("beams", [2, 3])
def test_narrower_beams_and_a_window_model_equal_the_reference(beams: int):
    model = tiny("mistral")
    eng = engine(model, token_budget=16, budget_bytes=64 * CHUNK)
    eng.add_request("m", PROMPT, NEW, beams=beams)
    out = eng.run()
    assert [out[("m", i)] for i in range(beams)] == reference(model, PROMPT, beams)
    eng.kv.check_invariants(expensive=True)
    eng.close()


def test_bad_beam_widths_and_options_are_refused_at_add_request(llama):
    model, _ = llama
    eng = engine(model, budget_bytes=64 * CHUNK, max_running=3)
    for beams in (0, -2, 2.0):
        with pytest.raises(ValueError, match=f"beams must be an int > 0, got {beams!r}"):
            eng.add_request("a", PROMPT, NEW, beams=beams)  # type: ignore[arg-type]
    for kwargs, why in (
        ({"beams": 4}, r"beams=4 are not served with max_running=3 \(every beam"),
        ({"beams": 2, "n": 2, "seed": 1}, "beams=2 are not served with n=2 samples"),
        ({"beams": 3, "seed": 7}, r"beams=3 are not served with seed=7 \(beam sampling"),
    ):
        with pytest.raises(ValueError, match=why):
            eng.add_request("a", PROMPT, NEW, **kwargs)
    assert not eng.pending
    eng.close()
    eng = engine(model, budget_bytes=64 * CHUNK, overlap=True)
    with pytest.raises(ValueError, match="beams=2 are not served with overlap=True"):
        eng.add_request("a", PROMPT, NEW, beams=2)
    assert not eng.pending
    eng.close()


@pytest.mark.parametrize("budget_chunks", [64, 24])
def test_mamba_hybrid_beams_and_samples_equal_the_reference(budget_chunks: int):
    """Jamba (a state checkpoint every 8 tokens): a fork copies each beam's or sample's
    live state on its first step; with 24 chunks samples and beams are preempted and
    recompute their states, and every sequence still equals transformers'."""
    model = tiny_model("jamba")
    model.generation_config.eos_token_id = None
    prompt = PROMPT[:13]
    ids = torch.tensor([prompt])
    ref_beams = reference(model, prompt, 2)
    ref_samples = []
    for i in range(2):
        torch.manual_seed(100 + i)
        seq = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=True,
            top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0,
        )  # fmt: skip
        ref_samples.append(seq[0, 13:].tolist())
    eng = engine(model, token_budget=12, budget_bytes=budget_chunks * CHUNK, checkpoint_interval=8)
    eng.add_request("b", prompt, NEW, beams=2)
    eng.add_request("s", prompt, NEW, n=2, seed=100)
    out = eng.run(max_steps=400)
    assert [out[("b", i)] for i in range(2)] == ref_beams
    assert [out[("s", i)] for i in range(2)] == ref_samples
    assert (eng.stats["preemptions"] > 0) == (budget_chunks == 24)
    eng.kv.check_invariants(expensive=True)
    eng.close()
