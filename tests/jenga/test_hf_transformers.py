"""Cross-check jenga.hf against `transformers`' own config classes (skipped without it).

The config classes are built with small sizes (no downloads); their ``to_dict()`` is fed
to our parser and each layer's kind is compared with what transformers says the layer
is. Parameter counts are compared with tiny models instantiated on CPU.
"""

import pytest
from jenga.hf import dense_parameter_count, mamba_state_bytes, model_spec_from_config
from jenga.specs import Kind

transformers = pytest.importorskip("transformers")

SMALL = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 4096,
}  # fmt: skip
TYPE_TO_KIND = {
    "full_attention": Kind.FULL,
    "sliding_attention": Kind.SLIDING_WINDOW,
    "chunked_attention": Kind.CHUNKED_LOCAL,
}


def kinds_by_layer(model):
    out = {}
    for g in model.groups:
        for layer in g.layer_ids:
            out[layer] = g.spec.kind
    return [out[i] for i in sorted(out)]


def config_dict_without_layer_types(config):
    """Our family rules (not transformers' precomputed list) must give the same kinds."""
    d = config.to_dict()
    d.pop("layer_types", None)
    return d


@pytest.mark.parametrize(
    ("class_name", "extra"),
    [
        ("Gemma2Config", {"num_hidden_layers": 7, "sliding_window": 512, "head_dim": 16}),
        ("Gemma3TextConfig", {"num_hidden_layers": 13, "sliding_window": 512, "head_dim": 16}),
    ],
)
def test_sliding_patterns_match_transformers_layer_types(class_name, extra):
    config = getattr(transformers, class_name)(**SMALL, **extra)
    expected = [TYPE_TO_KIND[t] for t in config.layer_types]
    for d in (config.to_dict(), config_dict_without_layer_types(config)):
        model = model_spec_from_config(d)
        assert kinds_by_layer(model) == expected
    assert model.group("sliding_window").spec.window == 512


def test_llama4_chunked_layers_match_transformers():
    config = transformers.Llama4TextConfig(
        **SMALL, num_hidden_layers=9, head_dim=16, attention_chunk_size=256
    )
    expected = [TYPE_TO_KIND[t] for t in config.layer_types]
    for d in (config.to_dict(), config_dict_without_layer_types(config)):
        assert kinds_by_layer(model_spec_from_config(d)) == expected
    assert expected.count(Kind.FULL) == 2  # layers 3 and 7


def test_mllama_defaults_match():
    config = transformers.MllamaConfig()
    model = model_spec_from_config(config.to_dict())
    cross = model.group("cross_attention")
    assert list(cross.layer_ids) == config.text_config.cross_attention_layers
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2 + 1
    assert cross.spec.tokens_per_image == vision.max_num_tiles * patches


def test_jamba_layers_and_state_match_transformers():
    config = transformers.JambaConfig(**SMALL, num_hidden_layers=16)
    model = model_spec_from_config(config.to_dict())
    expected = [Kind.FULL if t == "attention" else Kind.MAMBA for t in config.layers_block_type]
    assert kinds_by_layer(model) == expected
    d_inner = config.mamba_expand * config.hidden_size
    state = (config.mamba_d_conv - 1) * d_inner * 2 + d_inner * config.mamba_d_state * 4
    assert model.group("mamba").spec.state_bytes == state == mamba_state_bytes(config.to_dict())


@pytest.mark.parametrize(
    ("config_name", "model_name", "extra"),
    [
        ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
        ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "head_dim": 32}),
        ("MistralConfig", "MistralForCausalLM", {}),
        ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}),
        ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
        ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    ],
)
def test_dense_parameter_count_matches_a_real_tiny_model(config_name, model_name, extra):
    config = getattr(transformers, config_name)(**SMALL, num_hidden_layers=3, **extra)
    model = getattr(transformers, model_name)(config)
    unique = {id(p): p.numel() for p in model.parameters()}  # tied weights counted once
    assert dense_parameter_count(config.to_dict()) == sum(unique.values())


def test_qwen2_sliding_layers_match_transformers():
    config = transformers.Qwen2Config(
        **SMALL, num_hidden_layers=6, use_sliding_window=True, sliding_window=512,
        max_window_layers=4,
    )  # fmt: skip
    expected = [TYPE_TO_KIND[t] for t in config.layer_types]
    for d in (config.to_dict(), config_dict_without_layer_types(config)):
        assert kinds_by_layer(model_spec_from_config(d)) == expected
    assert expected.count(Kind.SLIDING_WINDOW) == 2  # layers 4 and 5
