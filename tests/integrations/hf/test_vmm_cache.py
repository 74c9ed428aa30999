"""`VmmCache` against transformers' own cache: bitwise-identical logits and tokens.

Tiny random-weight models (2-4 layers, hidden 64) with ``initializer_range=0.2`` so the
logits are sharp; 11-token prompts and 12 new tokens so sliding windows of 8 slide.
Batch 1, and a left-padded batch of 2 (row 0 padded by 4).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from jenga.specs import SpecError  # noqa: E402

from integrations.hf import VmmCache, cache_kwargs  # noqa: E402

SMALL = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 512,
    "initializer_range": 0.2,
}  # fmt: skip
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 2}),
    "mistral": (
        "MistralConfig", "MistralForCausalLM", {"num_hidden_layers": 2, "sliding_window": 8}
    ),
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        {
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"num_hidden_layers": 2, "sliding_window": 8, "head_dim": 16,
         "attn_implementation": "eager"},
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        {"num_hidden_layers": 4, "sliding_window": 8, "head_dim": 16},
    ),
    "jamba": (
        "JambaConfig", "JambaForCausalLM",
        {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
         "expert_layer_period": 100, "num_experts": 1},
    ),
}  # fmt: skip
GENERATE = {"max_new_tokens": 12, "do_sample": False, "output_logits": True}


def tiny_model(name: str):
    config_name, model_name, extra = MODELS[name]
    config = getattr(transformers, config_name)(**SMALL, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


def inputs(batch: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (batch, 11), generator=gen)
    mask = torch.ones_like(ids)
    if batch == 2:
        ids[0, :4] = 0
        mask[0, :4] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def generate(model, cache=None):
    out = model.generate(
        **inputs(generate.batch), **cache_kwargs(cache), return_dict_in_generate=True, **GENERATE
    )
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_tokens_bitwise_equal_to_dynamic_cache(name: str, batch: int):
    model = tiny_model(name)
    generate.batch = batch  # type: ignore[attr-defined]
    ref_tokens, ref_logits = generate(model)
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=4 << 20)
    tokens, logits = generate(model, cache)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)
    assert logits.shape[1:] == (batch, 128) and len(logits) >= 6  # eos may stop it early
    assert cache.get_seq_length() == 11 + len(logits) - 1  # the last token is not cached
    cache.kv.check_invariants(expensive=True)
    cache.close()


@pytest.mark.parametrize(("layout", "kv_split"), [("per_group", False), ("per_layer", True)])
def test_other_layouts_are_bitwise_equal_too(layout: str, kv_split: bool):
    model = tiny_model("gemma2")
    generate.batch = 2  # type: ignore[attr-defined]
    ref_tokens, ref_logits = generate(model)
    cache = VmmCache(
        model.config, chunk_bytes=4096, budget_bytes=4 << 20, layout=layout, kv_split=kv_split
    )
    tokens, logits = generate(model, cache)
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    cache.close()


def test_sliding_layers_hold_only_the_window():
    model = tiny_model("mistral")  # 2 sliding layers, window 8, 16-token blocks
    generate.batch = 1  # type: ignore[attr-defined]
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=4 << 20, block_size=4)
    generate(model, cache)
    length = cache.get_seq_length()
    assert length == 22
    # position 21 reads 14..21: blocks 0..2 (4 tokens each) left the window and were freed
    assert cache.kv.block_table(0, 0) == [-1, -1, -1, 0, 1, 2]  # freed ids reused
    stats = cache.kv.stats()
    assert stats["blocks.used.sliding_window"] == 3
    cache.close()


def test_jamba_mamba_states_live_in_the_mamba_group_blocks():
    model = tiny_model("jamba")  # layers 0, 2 Mamba; 1, 3 attention
    generate.batch = 2  # type: ignore[attr-defined]
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=4 << 20)
    generate(model, cache)
    geo = cache.kv.geometries[0]
    assert cache.kv.model.groups[0].name == "mamba"
    # conv [128, 4] + ssm [128, 16] fp32 = 10 KiB per state: 2 per 5-chunk page, no tail
    assert (geo.small_page_bytes, geo.chunks_per_page, geo.tail_bytes) == (10240, 5, 0)
    layer = cache.layers[0]
    view = cache.kv.layer_view(0)
    state = view[0, 0, : 128 * 4].view(128, 4)  # row 0's block: conv state first
    assert torch.equal(layer.conv_states[0][0], state)
    assert layer.conv_states[0].data_ptr() == view.data_ptr()  # the cache's tensor is ours
    cache.close()


def test_unstorable_layer_types_are_refused_naming_the_layer():
    # a type every supported release accepts (5.18+ renames it "indexed_attention")
    config = transformers.LlamaConfig(
        **SMALL, num_hidden_layers=2,
        layer_types=["full_attention", "deepseek_sparse_attention"],
    )  # fmt: skip
    unknown = r"\['(indexed_attention|deepseek_sparse_attention)'\]"
    with pytest.raises(SpecError, match=rf"unknown layer_types {unknown} \(layers \[1\]\)"):
        VmmCache(config)


def test_default_pool_holds_max_length_and_dtype_comes_from_the_model():
    # SmolLM2-135M's cache shape: 30 layers x 3 KV heads x 64, bf16 = 23,040 B per token
    config = transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192,
    )  # fmt: skip
    cache = VmmCache(config)
    keys = torch.zeros(1, 3, 1, 64, dtype=torch.bfloat16)
    cache.update(keys, keys, 0)  # opens the cache: the model's dtype, one row
    assert cache.kv.dtype == torch.bfloat16
    # a 16-token block of one layer is 12 KiB: a large page is lcm(12 KiB, 64 KiB) = 3
    # chunks holding 16 blocks; 8192 tokens + 1 block = 513 blocks -> 33 pages, + 1 spare
    assert cache.kv.pool.budget_bytes == 30 * 34 * 3 * (64 << 10) >= 8192 * 23_040
    cache.close()
    with pytest.raises(TypeError, match=r"VmmCache\(dtype=torch.float16\) but the model hands"):
        VmmCache(config, dtype=torch.float16).update(keys, keys, 0)


def test_long_generation_fits_the_default_budget():
    model = tiny_model("llama")  # max_position_embeddings 512
    ids = torch.randint(1, 128, (1, 300))
    cache = VmmCache(model.config)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache),
                         max_new_tokens=200, min_new_tokens=200, do_sample=False)  # fmt: skip
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=200,
                         min_new_tokens=200, do_sample=False)  # fmt: skip
    assert torch.equal(out, ref) and cache.get_seq_length() == 499
    cache.close()


def tiny_mllama():
    text = {**SMALL, "num_hidden_layers": 4, "cross_attention_layers": [1, 3], "vocab_size": 160,
            "pad_token_id": 0}  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_global_layers": 1, "attention_heads": 2, "image_size": 28, "patch_size": 14,
        "max_num_tiles": 2, "vision_output_dim": 64, "intermediate_layers_indices": [0],
        "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]], "initializer_range": 0.2,
    }  # fmt: skip
    config = transformers.MllamaConfig(
        text_config=text, vision_config=vision, image_token_index=150
    )
    torch.manual_seed(0)
    return transformers.MllamaForConditionalGeneration(config).eval()


@pytest.mark.parametrize("batch", [1, 2])
def test_mllama_cross_attention_bitwise_equal(batch: int):
    model = tiny_mllama()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 140, (batch, 9), generator=gen)
    ids[:, 2] = 150  # the <|image|> token
    mask = torch.ones_like(ids)
    if batch == 2:
        ids[0, :2] = 0
        mask[0, :2] = 0
    cross_mask = torch.zeros(batch, 9, 1, 2, dtype=torch.long)
    cross_mask[:, 2:, 0, :] = 1
    kwargs = {
        "input_ids": ids, "attention_mask": mask, "cross_attention_mask": cross_mask,
        "pixel_values": torch.randn(batch, 1, 2, 3, 28, 28, generator=gen),
        "aspect_ratio_ids": torch.full((batch, 1), 2),
        "aspect_ratio_mask": torch.ones(batch, 1, 2, dtype=torch.long),
        "max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True,
        "output_logits": True,
    }  # fmt: skip
    ref = model.generate(**kwargs)
    # 2 tiles x (4 patches + 1) = 10 cross-attention tokens per row
    cache = VmmCache(model.config, chunk_bytes=4096, budget_bytes=4 << 20, image_tokens=10)
    ours = model.generate(**kwargs, **cache_kwargs(cache))
    assert torch.equal(ours.sequences, ref.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(ref.logits))
    assert cache.kv.stats()["blocks.used.cross_attention"] == batch  # 10 tokens: one block
    cache.close()
