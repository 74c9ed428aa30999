"""The family matrix: `VmmCache` against transformers' own cache, family x dtype x batch.

Every family in `families.FAMILIES` generates 12 tokens after an 11-token prompt
(windows and chunks of 8, Mamba checkpoints every 8 tokens) with `generate`'s own cache
and with a `VmmCache` built from nothing but ``model.config`` (default pool budget, dtype
from the model); logits and tokens must be `torch.equal`. fp32 runs batch 1 and a
left-padded batch 2; half precision runs the padded batch in bf16 or fp16 (alternating
by family, so both appear without doubling the matrix's time).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from jenga.specs import Kind

from integrations.hf import VmmCache
from tests.integrations.hf.families import CHECKPOINT, FAMILIES, text_inputs, tiny_model

GENERATE = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False,
            "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
HALF = {name: (torch.bfloat16, torch.float16)[i % 2] for i, name in enumerate(FAMILIES)}
CASES = [
    pytest.param(name, dtype, batch, id=f"{name}-{str(dtype)[6:]}-b{batch}")
    for name in FAMILIES
    for dtype, batch in ((torch.float32, 1), (torch.float32, 2), (HALF[name], 2))
]


@pytest.mark.parametrize(("name", "dtype", "batch"), CASES)
def test_family_logits_bitwise_equal_to_transformers_cache(name, dtype, batch):
    model = tiny_model(name, dtype)
    inputs = text_inputs(batch)
    ref = model.generate(**inputs, **GENERATE)
    cache = VmmCache(model.config, chunk_bytes=4096, block_size=4, checkpoint_interval=CHECKPOINT)
    ours = model.generate(**inputs, **GENERATE, past_key_values=cache)
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
