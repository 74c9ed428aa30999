"""Multi-head latent attention (DeepSeek-V3 from transformers, tiny random weights).

transformers caches the compressed latent of each token, not a per-head K and V:
``kv_nope`` (kv_lora_rank wide) as the layer's keys and the roped ``k_rot``
(qk_rope_head_dim wide) as its values, one head each. `VmmCache` stores them side by side
as one jenga `Kind.MLA` vector per token. These tests pin that: the blocks hold exactly
what transformers' own cache holds, `generate` is bitwise equal at batch 1 and left-padded
batch 2 (greedy and with beams), the mini engine's tokens equal `generate`'s, and the
same on CUDA (`gpu`).
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from integrations.hf.layers import UnsupportedLayer, VmmLatentLayer  # noqa: E402
from integrations.kvcache.access import read_latent, token_slots  # noqa: E402
from jenga.specs import Kind  # noqa: E402

from integrations.hf import VmmCache, cache_kwargs  # noqa: E402
from tests.integrations.hf.families import FAMILIES, SMALL, text_inputs, tiny_model  # noqa: E402

GENERATE = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False,
            "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
EXTRA = FAMILIES["deepseek_v3"][2]
LATENT = EXTRA["kv_lora_rank"] + EXTRA["qk_rope_head_dim"]  # 24 + 8


@functools.lru_cache(maxsize=1)
def _model():
    return tiny_model("deepseek_v3")


def _generate(model, inputs, cache=None, **extra):
    given = {} if cache is None else cache_kwargs(cache)
    return model.generate(**inputs, **GENERATE, **extra, **given)


def test_the_cache_is_one_latent_per_token_not_per_head_keys_and_values():
    cache = VmmCache(_model().config, chunk_bytes=4096, block_size=4)
    assert all(isinstance(layer, VmmLatentLayer) for layer in cache.layers)
    _generate(_model(), text_inputs(1), cache)
    (group,) = cache.kv.model.groups
    assert group.spec.kind is Kind.MLA and group.layer_ids == (0, 1, 2)
    assert (group.spec.num_kv_heads, group.spec.head_dim) == (1, LATENT)
    # fp32: 32 x 4 bytes per token and layer; expanded K and V would be 4 heads x (24 + 16)
    assert group.spec.bytes_per_token == LATENT * 4
    cache.close()


def test_blocks_hold_exactly_what_transformers_own_cache_holds():
    """After a left-padded batch 2, every layer's stored latents split into the keys
    (``kv_nope``) and values (``k_rot``) of transformers' `DynamicCache`, bit for bit."""
    model, inputs = _model(), text_inputs(2)
    ref = _generate(model, inputs)
    cache = VmmCache(model.config, chunk_bytes=4096, block_size=4)
    _generate(model, inputs, cache)
    kv, split = cache.kv, EXTRA["kv_lora_rank"]
    stored = cache.get_seq_length()
    theirs_all = getattr(ref, "cache", None) or ref.past_key_values
    assert len(theirs_all.layers) == 3
    for layer, theirs in enumerate(theirs_all.layers):
        assert stored == theirs.keys.shape[2] == 22  # 11 prompt + 11 fed back
        for row in range(2):
            rid = cache.store.request(row)
            slots = token_slots(kv, rid, 0, 0, stored)
            latents = read_latent(kv, layer, slots)[:, 0]  # [tokens, 32]
            assert torch.equal(latents[:, :split], theirs.keys[row, 0])
            assert torch.equal(latents[:, split:], theirs.values[row, 0])
    cache.close()


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_generate_bitwise_equal_with_beams(batch):
    """Beam search reorders rows (forks sharing latent blocks); scores and tokens equal."""
    model, inputs = _model(), text_inputs(batch)
    beams = {"num_beams": 3, "num_return_sequences": 2, "output_scores": True}
    ref = _generate(model, inputs, **beams)
    cache = VmmCache(model.config, chunk_bytes=4096, block_size=4)
    ours = _generate(model, inputs, cache, **beams)
    assert torch.equal(ours.sequences, ref.sequences)
    assert torch.equal(ours.sequences_scores, ref.sequences_scores)
    assert torch.equal(torch.stack(ours.logits), torch.stack(ref.logits))
    cache.kv.check_invariants(expensive=True)
    cache.close()


def test_a_latent_wider_than_the_config_says_is_refused_naming_both():
    """A cache built for another latent width refuses the model's first update."""
    config = transformers.DeepseekV3Config(**{**SMALL, **EXTRA, "kv_lora_rank": 16})
    cache = VmmCache(config, chunk_bytes=4096, block_size=4)
    with pytest.raises(UnsupportedLayer, match=r"\(1, 1, 11, 24\) keys .* 1 x 24 per token"):
        _generate(_model(), text_inputs(1), cache)
    cache.close()


# ---- CUDA twins -----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_generate_on_a_cuda_pool_bitwise_equal(batch):
    """The same model on the GPU, the latents in CUDA chunks: bitwise equal to the
    library's own cache on the same device."""
    from vmm.cuda import CudaBackend

    import vmm

    model = tiny_model("deepseek_v3").to("cuda")
    inputs = {k: v.to("cuda") for k, v in text_inputs(batch).items()}
    ref = _generate(model, inputs)
    pool = vmm.ChunkPool(CudaBackend(0), 8 << 21)
    cache = VmmCache(model.config, pool=pool, block_size=16)
    ours = _generate(model, inputs, cache)
    assert torch.equal(ours.sequences, ref.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(ref.logits))
    assert cache.kv.pool.num_mapped > 0
    cache.close()
    pool.close()


@pytest.mark.cuda
@pytest.mark.gpu
def test_engine_on_cuda_tokens_equal_generate():
    from integrations.engine import EngineConfig, MiniEngine
    from tests.integrations.engine.test_engine_families import workload

    model = tiny_model("deepseek_v3").to("cuda")
    model.generation_config.eos_token_id = None
    requests = workload()
    ref = {}
    for rid, prompt, n, _ in requests:
        ids = torch.tensor([prompt], device="cuda")
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)  # fmt: skip
        ref[rid] = seq[0, len(prompt) :].tolist()
    config = EngineConfig(
        token_budget=12, budget_bytes=16 << 21, chunk_bytes=2 << 20, block_size=16,
        backend="cuda",
    )  # fmt: skip
    engine = MiniEngine(model, config)
    for rid, prompt, n, arrival in requests:
        engine.add_request(rid, prompt, n, arrival_step=arrival)
    assert engine.run() == ref
    assert engine.stats["prefix.hit_tokens"] >= 16
    engine.close()
