"""`VmmCache` under beam search, num_return_sequences and batch expansion / selection:
tokens and scores bitwise equal to transformers' own cache (fp32), and rows that continue
one beam share its blocks (jenga forks), copying only the block each writes next."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from integrations.hf.layers import UnsupportedLayer  # noqa: E402
from jenga.specs import Kind  # noqa: E402

from integrations.hf import VmmCache, cache_kwargs  # noqa: E402
from tests.integrations.hf.test_vmm_cache import SMALL, inputs, tiny_model  # noqa: E402

NEW_TOKENS = 12
BLOCK = 4
MODES = {
    "beams2": {"num_beams": 2},
    "beams3-return3": {"num_beams": 3, "num_return_sequences": 3},
    "beams4-return2": {"num_beams": 4, "num_return_sequences": 2},
    "sample-return2": {"do_sample": True, "num_return_sequences": 2},
    "sample-return3": {"do_sample": True, "num_return_sequences": 3},
    "sample-return4": {"do_sample": True, "num_return_sequences": 4},
}


def run(model, batch: int, mode: dict, cache: VmmCache | None = None):
    args = {"do_sample": False, **mode}
    torch.manual_seed(5)  # the same sampling draws with either cache
    lengths = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    return model.generate(
        **inputs(batch), **cache_kwargs(cache), **lengths, output_scores=True,
        return_dict_in_generate=True, **args,
    )  # fmt: skip


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "jamba"])
def test_beams_and_samples_bitwise_equal_to_dynamic_cache(name: str, batch: int, mode: str):
    model = tiny_model(name)
    ref = run(model, batch, MODES[mode])
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    out = run(model, batch, MODES[mode], cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == NEW_TOKENS
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores, strict=True))
    rows = batch * MODES[mode].get("num_beams", MODES[mode].get("num_return_sequences", 1))
    assert cache.store.num_rows == rows
    cache.kv.check_invariants(expensive=True)
    used = cache.kv.allocator.usage().used_blocks
    length = 11 + NEW_TOKENS - 1  # the last token is not cached
    alone = rows * -(-length // BLOCK)  # every row its own blocks
    if name == "llama" and "num_beams" in MODES[mode]:
        assert used[0] < alone  # beams share their common prefix
        assert cache.kv.stats()["kv.cow.blocks"] > 0
    if "do_sample" in MODES[mode]:  # rows are expanded before the prefill: nothing shared
        assert cache.kv.stats()["kv.cow.blocks"] == 0
        if name == "llama":
            assert used[0] == alone
    cache.close()


@pytest.mark.parametrize("name", ["ministral", "gemma3"])
def test_beams_over_mixed_window_and_full_layers(name: str):
    model = tiny_model(name)
    mode = MODES["beams4-return2"]
    ref = run(model, 2, mode)
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    out = run(model, 2, mode, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores, strict=True))
    assert cache.kv.stats()["kv.cow.blocks"] > 0
    cache.kv.check_invariants(expensive=True)
    cache.close()


def test_beam_search_stores_the_prompt_once():
    """A 40-token prompt and 4 beams: after the first step every beam continues beam 0
    (the others start at -inf), so the prompt's blocks are held once, not 4 times."""
    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    ref = model.generate(ids, num_beams=4, max_new_tokens=6, do_sample=False)
    out = model.generate(ids, **cache_kwargs(cache), num_beams=4, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    prompt_blocks = 40 // BLOCK
    tables = [cache.kv.block_table(cache.store.request(r), 0) for r in range(4)]
    assert all(t[:prompt_blocks] == tables[0][:prompt_blocks] for t in tables)
    # 10 shared prompt blocks + at most 2 own blocks per beam (45 tokens: 12 blocks each)
    assert cache.kv.allocator.usage().used_blocks[0] <= prompt_blocks + 4 * 2 < 4 * 12
    cache.close()


def prefill(model, cache, ids):
    with torch.no_grad():
        return model(ids, **cache_kwargs(cache), use_cache=True).logits[:, -1]


def decode(model, cache, tokens):
    with torch.no_grad():
        return model(tokens, **cache_kwargs(cache), use_cache=True).logits[:, -1]


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_repeat_interleave_and_select_match_dynamic_cache(name: str):
    model = tiny_model(name)
    ids = torch.randint(1, 128, (2, 13), generator=torch.Generator().manual_seed(4))
    ref = transformers.DynamicCache(config=model.config)
    ours = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    assert torch.equal(prefill(model, ours, ids), prefill(model, ref, ids))
    used = ours.kv.allocator.usage().used_blocks
    ref.batch_repeat_interleave(3)
    ours.batch_repeat_interleave(3)
    assert ours.store.num_rows == 6 and ours.kv.allocator.usage().used_blocks == used
    steps = torch.randint(1, 128, (6, 10), generator=torch.Generator().manual_seed(5))
    for step in range(5):
        col = steps[:, step : step + 1]
        assert torch.equal(decode(model, ours, col), decode(model, ref, col))
    keep = torch.tensor([4, 0, 5])
    ref.batch_select_indices(keep)
    ours.batch_select_indices(keep)
    assert ours.store.num_rows == 3
    for step in range(5, 10):
        col = steps[:3, step : step + 1]
        assert torch.equal(decode(model, ours, col), decode(model, ref, col))
    ours.kv.check_invariants(expensive=True)
    mask = torch.tensor([True, False, True])  # a bool mask selects too
    ours.batch_select_indices(mask)
    ref.batch_select_indices(mask)
    col = steps[:2, :1]
    assert torch.equal(decode(model, ours, col), decode(model, ref, col))
    ours.close()


def test_bad_reorders_are_refused_with_nothing_changed():
    model = tiny_model("llama")
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    cache.reorder_cache(torch.tensor([0]))  # nothing stored yet: nothing to reorder
    prefill(model, cache, torch.ones(2, 5, dtype=torch.long))
    before = (list(cache.store.row_ids), cache.kv.allocator.usage())
    with pytest.raises(IndexError, match=r"rows \[2\] out of range \[0, 2\)"):
        cache.reorder_cache(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="repeats must be > 0, got 0"):
        cache.batch_repeat_interleave(0)
    with pytest.raises(ValueError, match="a batch of 0 rows selected from 2"):
        cache.batch_select_indices(torch.tensor([], dtype=torch.long))
    assert (cache.store.row_ids, cache.kv.allocator.usage()) == before
    cache.close()


@pytest.mark.parametrize("batch", [1, 2])
def test_mamba_beams_through_checkpoint_moves_match_dynamic_cache(batch: int):
    """Jamba, a state block every 4 tokens: beams that continue one beam share its state
    block, read gathered copies until their next step copies the block, and the states
    move to new checkpoint blocks under them; tokens and scores stay bitwise equal."""
    model = tiny_model("jamba")
    mode = MODES["beams4-return2"]
    ref = run(model, batch, mode)
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK,
                     checkpoint_interval=4)  # fmt: skip
    out = run(model, batch, mode, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores, strict=True))
    assert cache.store.state_moves > 0 and cache.kv.stats()["kv.cow.blocks"] > 0
    cache.kv.check_invariants(expensive=True)
    cache.close()


def test_reordered_mamba_rows_read_gathered_states_bitwise_equal():
    model = tiny_model("jamba")
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    ref = transformers.DynamicCache(config=model.config)
    ours = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    assert torch.equal(prefill(model, ours, ids), prefill(model, ref, ids))
    layer = ours.store.state_layers[0]
    assert not layer.has_gathered()  # rows allocated in order: one strided view each
    for cache in (ref, ours):
        cache.reorder_cache(torch.tensor([1, 1]))  # both rows continue row 1
    assert layer.has_gathered()  # one shared block: a copy per row
    assert torch.equal(layer.recurrent_states[0], ref.layers[0].recurrent_states[0])
    col = torch.tensor([[7], [9]])
    assert torch.equal(decode(model, ours, col), decode(model, ref, col))
    assert ours.kv.stats()["kv.cow.blocks"] > 0  # the shared block was copied
    for _ in range(3):
        col = col + 1
        assert torch.equal(decode(model, ours, col), decode(model, ref, col))
    ours.kv.check_invariants(expensive=True)
    ours.close()


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_assisted_decoding_crops_and_matches_dynamic_cache(name: str):
    """A random 1-layer draft: most candidates are rejected, so `crop` runs with a
    negative count; tokens and scores stay bitwise equal. Windows (8 tokens, 23 in all)
    are kept whole once transformers activates past recording, so a crop can go back."""
    model = tiny_model(name)
    torch.manual_seed(1)
    config = transformers.LlamaConfig(**SMALL, num_hidden_layers=1)
    draft = transformers.LlamaForCausalLM(config).eval()
    args = {"max_new_tokens": 12, "do_sample": False, "output_scores": True,
            "return_dict_in_generate": True, "assistant_model": draft}  # fmt: skip
    ref = model.generate(**inputs(1), **args)
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    out = model.generate(**inputs(1), **cache_kwargs(cache), **args)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, ref.scores, strict=True))
    assert cache.store.tokens_cropped > 0  # rejected candidates were cropped
    assert cache.kv.num_tokens(cache.store.request(0)) >= cache.get_seq_length()
    assert all(g.spec.kind is Kind.FULL for g in cache.kv.model.groups)
    cache.kv.check_invariants(expensive=True)
    cache.close()


def test_assisted_decoding_of_a_state_model_is_refused_as_by_transformers():
    """transformers refuses assisted decoding for a model with a recurrent state (it
    cannot roll one back), with its own cache and with VmmCache alike: the assisted
    matrix has no Mamba hybrid."""
    model = tiny_model("jamba")
    torch.manual_seed(1)
    draft = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SMALL, num_hidden_layers=1)
    ).eval()
    args = {"max_new_tokens": 4, "do_sample": False, "assistant_model": draft}
    message = "assisted generation is not supported with stateful models"
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs(1), **args)
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20)
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs(1), **cache_kwargs(cache), **args)
    cache.close()


def test_past_recording_after_a_window_released_blocks_is_refused():
    model = tiny_model("mistral")
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    prefill(model, cache, torch.ones(1, 13, dtype=torch.long))
    with pytest.raises(UnsupportedLayer, match=r"window groups \['sliding_window'\] already"):
        cache.activate_past_recording()
    with pytest.raises(UnsupportedLayer, match="keep a window or a state"):
        cache.crop(-1)  # still refused: nothing changed
    assert cache.get_seq_length() == 13
    cache.close()


def test_crop_refuses_windows_and_positive_counts():
    model = tiny_model("mistral")
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    prefill(model, cache, torch.ones(1, 5, dtype=torch.long))
    cache.crop(0)  # transformers calls it to trim windows: nothing to do
    with pytest.raises(UnsupportedLayer, match=r"layers \[0, 1\] keep a window or a state"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="negative count of tokens to remove, got 2"):
        cache.crop(2)
    assert cache.get_seq_length() == 5
    cache.close()


def test_rows_are_not_reordered_after_a_crop():
    model = tiny_model("llama")
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=8 << 20, block_size=BLOCK)
    prefill(model, cache, torch.ones(2, 6, dtype=torch.long))
    cache.crop(-1)
    with pytest.raises(UnsupportedLayer, match="the rows hold 6 token slots, the layers 5"):
        cache.reorder_cache(torch.tensor([0, 0]))
    cache.close()
