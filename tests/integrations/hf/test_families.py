"""The family matrix: `VmmCache` against transformers' own cache, family x dtype x batch.

Every family in `families.FAMILIES` generates 12 tokens after an 11-token prompt
(windows and chunks of 8, Mamba checkpoints every 8 tokens) with `generate`'s own cache
and with a `VmmCache` built from nothing but ``model.config`` (default pool budget, dtype
from the model); logits and tokens must be `torch.equal`. fp32 runs batch 1 and a
left-padded batch 2; half precision runs the padded batch in bf16 or fp16 (alternating
by family, so both appear without doubling the matrix's time).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from integrations.hf.cache import config_dict
from integrations.hf.compat import layer_types_and_kwargs
from jenga.hf import model_spec_from_config
from jenga.specs import Kind

from integrations.hf import VmmCache, cache_kwargs
from tests.integrations.hf.families import CHECKPOINT, FAMILIES, SMALL, text_inputs, tiny_model

GENERATE = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False,
            "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
HALF = {name: (torch.bfloat16, torch.float16)[i % 2] for i, name in enumerate(FAMILIES)}
CASES = [
    pytest.param(name, dtype, batch, id=f"{name}-{str(dtype)[6:]}-b{batch}")
    for name in FAMILIES
    for dtype, batch in ((torch.float32, 1), (torch.float32, 2), (HALF[name], 2))
]


@functools.lru_cache(maxsize=2)  # the fp32 batch-1 and batch-2 cases share one model
def _model(name: str, dtype: torch.dtype):
    return tiny_model(name, dtype)


@pytest.mark.parametrize(("name", "dtype", "batch"), CASES)
def test_family_logits_bitwise_equal_to_transformers_cache(name, dtype, batch):
    model = _model(name, dtype)
    inputs = text_inputs(batch)
    ref = model.generate(**inputs, **GENERATE)
    cache = VmmCache(model.config, chunk_bytes=4096, block_size=4, checkpoint_interval=CHECKPOINT)
    ours = model.generate(**inputs, **GENERATE, **cache_kwargs(cache))
    assert torch.equal(ours.sequences, ref.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(ref.logits))
    assert len(ours.logits) == 12
    kv = cache.kv
    assert kv.dtype == dtype and kv.pool.num_mapped > 0
    kinds = {g.spec.kind for g in kv.model.groups}
    if Kind.MAMBA in kinds:  # 11 + 11 cached tokens cross the 8- and 16-token checkpoints
        assert cache.store.state_moves == 2 * batch * sum(
            g.num_layers for g in kv.model.groups if g.spec.kind is Kind.MAMBA
        )
    if (
        Kind.SLIDING_WINDOW in kinds
    ):  # position 21 reads 14..21: 4-token blocks 0..2 left the window
        group = next(i for i, g in enumerate(kv.model.groups) if g.spec.kind is Kind.SLIDING_WINDOW)
        assert kv.block_table(0, group)[:3] == [-1, -1, -1]
    kv.check_invariants(expensive=True)
    cache.close()


TYPE_TO_KINDS = {
    "full_attention": {Kind.FULL}, "sliding_attention": {Kind.SLIDING_WINDOW},
    "chunked_attention": {Kind.CHUNKED_LOCAL}, "linear_attention": {Kind.MAMBA},
    "hybrid": {Kind.FULL, Kind.MAMBA}, "dummy": set(),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILIES))
def test_jenga_kinds_match_transformers_layer_types(name):
    """The spec read from the config agrees, layer by layer, with the cache layer types
    transformers itself builds (`dummy` = a KV-sharing reader: no memory of its own;
    before transformers 5.23 the readers have no cache layer at all: the list stops at the
    first one)."""
    config_name, _, extra = FAMILIES[name]
    config = getattr(pytest.importorskip("transformers"), config_name)(**{**SMALL, **extra})
    text = config.get_text_config(decoder=True)
    types, _ = layer_types_and_kwargs(text)
    spec = model_spec_from_config(config_dict(config, text))
    kinds: dict[int, set[Kind]] = {i: set() for i in range(len(types))}
    for g in spec.groups:
        for layer in g.layer_ids:
            kinds[layer].add(g.spec.kind)
    # a latent-attention (MLA) model caches one latent per token: its full layers are MLA
    latent = {Kind.FULL: Kind.MLA} if getattr(text, "kv_lora_rank", None) else {}
    want = [{latent.get(k, k) for k in TYPE_TO_KINDS[t]} for t in types]
    assert [kinds[i] for i in range(len(types))] == want
    readers = [r for g in spec.groups for r, _ in g.readers]
    uncached = range(len(types), text.num_hidden_layers)
    assert readers == [i for i, t in enumerate(types) if t == "dummy"] + list(uncached)
