"""HF config dicts (written here, no downloads) -> ModelSpec, with exact layer ids and sizes."""

import pytest
from jenga.hf import (
    HfOptions,
    dense_parameter_count,
    mamba_state_bytes,
    model_spec_from_config,
    supported_model_types,
)
from jenga.specs import Kind, SpecError

LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip

GEMMA2_9B = {
    "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
    "sliding_window": 4096,
}  # fmt: skip


def layer_ids(model, group):
    return model.group(group).layer_ids


def test_llama_all_full_and_exact_weights():
    model = model_spec_from_config(LLAMA_8B, name="llama")
    (group,) = model.groups
    assert (group.name, group.num_layers, group.spec.kind) == ("full", 32, Kind.FULL)
    # head_dim = 4096 / 32 = 128; 16 x 2 x 8 x 128 x 2 B = 65536
    assert group.spec.page_bytes == 65_536
    assert model.max_model_len == 131_072
    # embed 2 x 525,336,576 + 32 x 218,112,000 + 4096 (see dense_parameter_count)
    assert model.weight_bytes == 8_030_261_248 * 2


@pytest.mark.parametrize(
    ("config", "params"),
    [
        (LLAMA_8B, 8_030_261_248),
        ({**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672,
          "num_hidden_layers": 80, "num_attention_heads": 64}, 70_553_706_496),
        ({**LLAMA_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
          "head_dim": 64, "tie_word_embeddings": True}, 1_235_814_400),
        (GEMMA2_9B, 9_241_705_984),
        ({**GEMMA2_9B, "hidden_size": 4608, "intermediate_size": 36864, "num_hidden_layers": 46,
          "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128},
         27_227_128_320),
        ({"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 12288,
          "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
          "head_dim": 128, "vocab_size": 131072}, 8_019_808_256),
        ({"model_type": "jamba"}, None),
    ],
)  # fmt: skip
def test_dense_parameter_count_matches_published_counts(config, params):
    assert dense_parameter_count(config) == params


def test_gemma2_even_layers_slide():
    model = model_spec_from_config(GEMMA2_9B)
    assert layer_ids(model, "sliding_window") == tuple(range(0, 42, 2))
    assert layer_ids(model, "full") == tuple(range(1, 42, 2))
    assert model.group("sliding_window").spec.window == 4096
    # 16 x 2 x 8 x 256 x 2 = 131072
    assert model.group("full").spec.page_bytes == 131_072


def test_gemma2_explicit_layer_types_win():
    types = ["full_attention", "sliding_attention"] * 21
    model = model_spec_from_config({**GEMMA2_9B, "layer_types": types})
    assert layer_ids(model, "full") == tuple(range(0, 42, 2))


def test_gemma3_every_sixth_layer_is_global():
    text = {
        "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "vocab_size": 262208, "max_position_embeddings": 131072,
        "sliding_window": 1024, "sliding_window_pattern": 6,
    }  # fmt: skip
    for config in (text, {"model_type": "gemma3", "text_config": text}):
        model = model_spec_from_config(config)
        assert layer_ids(model, "full") == (5, 11, 17, 23, 29, 35, 41, 47)
        assert model.group("sliding_window").num_layers == 40
        assert model.group("sliding_window").spec.window == 1024


MINISTRAL = {
    "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "sliding_window": [None, 32768, 32768, 32768],
}  # fmt: skip


def test_ministral_params_pattern_one_full_in_four():
    model = model_spec_from_config(MINISTRAL)
    assert layer_ids(model, "full") == tuple(range(0, 36, 4))
    assert model.group("sliding_window").num_layers == 27
    assert model.group("sliding_window").spec.window == 32768


def test_ministral_layer_types_and_plain_mistral_windows():
    types = ["full_attention"] + ["sliding_attention"] * 3
    model = model_spec_from_config(
        {**MINISTRAL, "model_type": "ministral", "sliding_window": 32768, "layer_types": types * 9}
    )
    assert layer_ids(model, "full") == tuple(range(0, 36, 4))
    # Mistral 7B v0.1: one window everywhere
    every = model_spec_from_config({**MINISTRAL, "sliding_window": 4096})
    assert [g.name for g in every.groups] == ["sliding_window"]
    # no window, or a window covering the whole context: full attention
    for window in (None, 131072):
        full = model_spec_from_config({**MINISTRAL, "sliding_window": window})
        assert [g.name for g in full.groups] == ["full"]
    # a shorter max_model_len turns the 32K windows into full attention
    short = model_spec_from_config(MINISTRAL, options=HfOptions(max_model_len=32768))
    assert [(g.name, g.num_layers) for g in short.groups] == [("full", 36)]


def test_mllama_cross_attention_layers_and_image_tokens():
    config = {
        "model_type": "mllama",
        "text_config": {
            "hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
        },
        "vision_config": {"image_size": 560, "patch_size": 14, "max_num_tiles": 4},
    }  # fmt: skip
    model = model_spec_from_config(config)
    cross = model.group("cross_attention")
    assert cross.layer_ids == (3, 8, 13, 18, 23, 28, 33, 38)
    assert cross.spec.tokens_per_image == 6404  # 4 tiles x (40 x 40 patches + 1)
    assert model.group("full").num_layers == 32
    bad = {**config, "text_config": {**config["text_config"], "cross_attention_layers": [40]}}
    with pytest.raises(SpecError, match=r"cross_attention_layers \[40\] outside 0..39"):
        model_spec_from_config(bad)


JAMBA = {
    "model_type": "jamba", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_period": 8,
    "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
    "max_position_embeddings": 262144,
}  # fmt: skip


def test_jamba_attention_one_in_eight_and_mamba_state_bytes():
    model = model_spec_from_config(JAMBA)
    assert layer_ids(model, "full") == (4, 12, 20, 28)
    mamba = model.group("mamba")
    assert mamba.num_layers == 28
    # conv 3 x 8192 x 2 = 49152, ssm 8192 x 16 x 4 = 524288 -> 573440 (560 KiB)
    assert mamba.spec.state_bytes == 573_440 == mamba_state_bytes(JAMBA)
    assert mamba.spec.checkpoint_interval == 512
    # bf16 ssm state: 49152 + 8192 x 16 x 2 = 311296
    half = model_spec_from_config(JAMBA, options=HfOptions(ssm_dtype_bytes=2))
    assert half.group("mamba").spec.state_bytes == 311_296
    listed = ["mamba"] * 31 + ["attention"]
    model = model_spec_from_config({**JAMBA, "layers_block_type": listed})
    assert layer_ids(model, "full") == (31,)


def test_llama4_chunked_on_rope_layers_full_on_nope_layers():
    text = {
        "model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 10485760, "attention_chunk_size": 8192,
    }  # fmt: skip
    model = model_spec_from_config({"model_type": "llama4", "text_config": text})
    assert layer_ids(model, "full") == tuple(range(3, 48, 4))
    chunked = model.group("chunked_local")
    assert (chunked.num_layers, chunked.spec.chunk) == (36, 8192)
    explicit = model_spec_from_config({**text, "no_rope_layers": [1, 0] * 24})
    assert layer_ids(explicit, "full") == tuple(range(1, 48, 2))
    no_chunks = {k: v for k, v in text.items() if k != "attention_chunk_size"}
    assert [g.name for g in model_spec_from_config(no_chunks).groups] == ["full"]


def test_options_block_size_and_dtype():
    model = model_spec_from_config(LLAMA_8B, options=HfOptions(block_size=32))
    assert model.groups[0].spec.page_bytes == 131_072  # 32 tokens x 4096 B
    fp32 = model_spec_from_config({**LLAMA_8B, "torch_dtype": "float32"})
    assert fp32.groups[0].spec.page_bytes == 131_072
    assert fp32.weight_bytes == 8_030_261_248 * 4


def test_unsupported_and_malformed_configs():
    # no family rule: read from the fields; GPT-2's n_layer / n_positions are not read
    with pytest.raises(SpecError, match="'max_position_embeddings' must be an int, got None"):
        model_spec_from_config({"model_type": "gpt2"})
    assert "jamba" in supported_model_types() and "mllama" in supported_model_types()
    with pytest.raises(SpecError, match="layer_types has 2 entries, num_hidden_layers is 42"):
        model_spec_from_config({**GEMMA2_9B, "layer_types": ["full_attention"] * 2})
    with pytest.raises(SpecError, match=r"unknown layer_types \['linear_attention'\]"):
        model_spec_from_config({**GEMMA2_9B, "layer_types": ["linear_attention"] * 42})
    with pytest.raises(SpecError, match="'num_hidden_layers' must be an int, got None"):
        model_spec_from_config({k: v for k, v in LLAMA_8B.items() if k != "num_hidden_layers"})
    with pytest.raises(SpecError, match="unknown dtype 'int3'"):
        model_spec_from_config({**LLAMA_8B, "torch_dtype": "int3"})
    with pytest.raises(SpecError, match=r"attn_layer_offset 9 not in \[0, attn_layer_period 8\)"):
        model_spec_from_config({**JAMBA, "attn_layer_offset": 9})
    with pytest.raises(SpecError, match="got 0 heads x 128"):
        model_spec_from_config({**LLAMA_8B, "num_key_value_heads": 0, "head_dim": 128})


QWEN2_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "max_position_embeddings": 32768, "sliding_window": 4096,
    "use_sliding_window": False, "max_window_layers": 20, "tie_word_embeddings": False,
}  # fmt: skip


def test_qwen2_slides_only_when_enabled_and_counts_biases():
    model = model_spec_from_config(QWEN2_7B)
    assert [(g.name, g.num_layers) for g in model.groups] == [("full", 28)]
    # 16 x 2 x 4 x 128 x 2 = 32768
    assert model.groups[0].spec.page_bytes == 32_768
    # Qwen2-7B: 7,615,616,512 parameters (q/k/v biases included)
    assert dense_parameter_count(QWEN2_7B) == 7_615_616_512
    sliding = model_spec_from_config({**QWEN2_7B, "use_sliding_window": True})
    assert layer_ids(sliding, "sliding_window") == tuple(range(20, 28))


def test_llava_onevision_adds_a_vision_embedding_cache():
    config = {
        "model_type": "llava_onevision",
        "text_config": QWEN2_7B,
        "vision_config": {"image_size": 384, "patch_size": 14},
    }
    model = model_spec_from_config(config)
    embedding = model.group("encoder.vision_embedding")
    assert embedding.layer_ids == (0,)
    assert embedding.spec.tokens_per_image == 729  # 27 x 27 patches
    assert embedding.spec.page_bytes == 114_688  # 16 tokens x 3584 x 2 B
    assert model.models == ("target", "encoder")
    assert model.weight_bytes == 7_615_616_512 * 2  # the decoder; pass the card's total


LLAMA_LIKE = {
    "model_type": "some_new_llama", "hidden_size": 2048, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 8192,
}  # fmt: skip


def test_any_model_type_is_read_from_its_layer_types():
    types = ["sliding_attention", "sliding_attention", "chunked_attention", "full_attention"]
    model = model_spec_from_config(
        {**LLAMA_LIKE, "layer_types": types, "sliding_window": 512, "attention_chunk_size": 1024}
    )
    assert [(g.name, g.layer_ids) for g in model.groups] == [
        ("sliding_window", (0, 1)), ("chunked_local", (2,)), ("full", (3,)),
    ]  # fmt: skip
    assert (model.groups[0].spec.window, model.groups[1].spec.chunk) == (512, 1024)
    # no layer_types: transformers' inference (sliding_window set: every layer slides)
    inferred = model_spec_from_config({**LLAMA_LIKE, "sliding_window": 4096})
    assert [(g.name, g.spec.window) for g in inferred.groups] == [("sliding_window", 4096)]


def test_unstorable_layer_types_are_refused_naming_type_and_layers():
    types = ["full_attention", "indexed_attention", "moe", "indexed_attention"]
    with pytest.raises(
        SpecError,
        match=r"layer 1: layer type 'indexed_attention' has no jenga kind \(layers \[1, 3\]\)",
    ):
        model_spec_from_config({**LLAMA_LIKE, "layer_types": types})
    with pytest.raises(SpecError, match="K head dim 128 and V head dim 64 differ"):
        model_spec_from_config({**LLAMA_LIKE, "head_dim": 128, "v_head_dim": 64})


DEEPSEEK_V3_LIKE = {
    **LLAMA_LIKE, "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 128,
    "num_key_value_heads": 128, "head_dim": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_latent_attention_configs_cache_one_latent_per_token():
    """kv_lora_rank set: full layers are MLA of 1 x (kv_lora_rank + rope), DeepSeek-V3's
    576 bf16 values per token (not 128 heads x (192 + 128) of expanded K and V)."""
    (group,) = model_spec_from_config(DEEPSEEK_V3_LIKE).groups
    assert (group.name, group.spec.kind, group.layer_ids) == ("mla", Kind.MLA, (0, 1, 2))
    assert (group.spec.num_kv_heads, group.spec.head_dim) == (1, 576)
    assert group.spec.bytes_per_token == 576 * 2
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    windowed = model_spec_from_config({**DEEPSEEK_V3_LIKE, "layer_types": types,
                                       "sliding_window": 128})  # fmt: skip
    kinds = [(g.spec.kind, g.spec.window, g.layer_ids) for g in windowed.groups]
    assert kinds == [(Kind.SLIDING_WINDOW_MLA, 128, (0, 2)), (Kind.MLA, None, (1,))]
    chunked = {**DEEPSEEK_V3_LIKE, "layer_types": ["chunked_attention"] * 3,
               "attention_chunk_size": 64}  # fmt: skip
    with pytest.raises(SpecError, match="a chunked_local layer of a latent-attention model"):
        model_spec_from_config(chunked)


def test_kv_sharing_layers_read_the_last_earlier_layer_of_their_type():
    types = ["sliding_attention", "full_attention"] * 3
    config = {**LLAMA_LIKE, "num_hidden_layers": 6, "layer_types": types, "sliding_window": 512,
              "num_kv_shared_layers": 2}  # fmt: skip
    model = model_spec_from_config(config)
    sliding, full = model.group("sliding_window"), model.group("full")
    assert (sliding.layer_ids, sliding.readers) == ((0, 2), ((4, 2),))
    assert (full.layer_ids, full.readers) == ((1, 3), ((5, 3),))
    assert model.num_layers == 4 and model.num_model_layers == 6  # readers cost nothing


MAMBA2 = {
    **LLAMA_LIKE, "num_hidden_layers": 4, "hidden_size": 64, "mamba_n_heads": 4,
    "mamba_d_head": 32, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_d_conv": 4,
    "mamba_expand": 2,
}  # fmt: skip


def test_linear_and_hybrid_layers_get_state_groups():
    # Bamba style: attention at attn_layer_indices, Mamba2 elsewhere
    model = model_spec_from_config({**MAMBA2, "attn_layer_indices": [1, 3]})
    assert [(g.name, g.layer_ids) for g in model.groups] == [("mamba", (0, 2)), ("full", (1, 3))]
    # conv: (128 + 2*8) channels x 3 columns x 2 B = 864; ssm: 4*32*8 x 4 B = 4096
    assert model.group("mamba").spec.state_bytes == 864 + 4096
    # hybrid layers: one layer id in the attention group and in the state group
    hybrid = model_spec_from_config({**MAMBA2, "layer_types": ["hybrid"] * 4})
    assert [(g.name, g.layer_ids) for g in hybrid.groups] == [
        ("full", (0, 1, 2, 3)), ("mamba", (0, 1, 2, 3)),
    ]  # fmt: skip
    gdn = {**LLAMA_LIKE, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}  # fmt: skip
    # gated delta-net: conv (2*2*8 + 4*8) x 3 x 2 B = 384; recurrent 4*8*8 x 4 B = 1024
    assert model_spec_from_config(gdn).group("mamba").spec.state_bytes == 384 + 1024
    with pytest.raises(SpecError, match="no known state fields"):
        model_spec_from_config({**LLAMA_LIKE, "layer_types": ["linear_attention"] * 4})
