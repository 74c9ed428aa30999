"""`integrations.hf.compat`: the one place transformers releases differ (5.16 to 5.24)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from integrations.hf import compat  # noqa: E402
from tests.integrations.hf.families import FAMILIES, SMALL  # noqa: E402


@pytest.mark.parametrize("name", ["ministral", "jamba", "llama4", "qwen3_next"])
def test_layer_kwargs_are_one_dict_per_layer_with_only_its_keys(name):
    config_name, _, extra = FAMILIES[name]
    text = getattr(transformers, config_name)(**SMALL, **extra).get_text_config(decoder=True)
    types, kwargs = compat.layer_types_and_kwargs(text)
    assert len(kwargs) == len(types) > 0
    for kind, kw in zip(types, kwargs, strict=True):
        windowed = kind in ("sliding_attention", "chunked_attention", "hybrid_sliding")
        assert ("sliding_window" in kw) == windowed, (kind, kw)
        stateful = kind in ("linear_attention", "hybrid", "hybrid_sliding")
        assert ("number_of_states" in kw) == stateful, (kind, kw)


def test_shared_kwargs_dict_of_older_releases_is_split_per_layer():
    shared = {"sliding_window": 8, "number_of_states": 1}
    types = ["sliding_attention", "full_attention", "linear_attention", "chunked_attention"]
    assert [compat._kwargs_for(t, shared) for t in types] == [
        {"sliding_window": 8}, {}, {"number_of_states": 1}, {"sliding_window": 8}
    ]  # fmt: skip


def test_cache_keyword_follows_the_signature():
    def takes_cache(input_ids, cache=None): ...
    def takes_past(input_ids, past_key_values=None): ...

    assert compat.cache_kwargs("c", takes_cache) == {"cache": "c"}
    assert compat.cache_kwargs("c", takes_past) == {"past_key_values": "c"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_hidden_layers=1))
    renamed = compat.version() >= (5, 24)  # the release that deprecates past_key_values=
    assert compat.cache_kwargs("c") == ({"cache": "c"} if renamed else {"past_key_values": "c"})
    assert compat.cache_kwargs("c", model.forward) == compat.cache_kwargs("c")


def test_dummy_layer_stores_nothing_on_every_release():
    for cls in {compat.DummyLayer, compat._LocalDummyLayer}:
        layer = cls()
        assert layer.is_initialized and layer.keys is None
        assert layer.update(None, None) == (None, None)
        with pytest.raises(NotImplementedError):
            layer.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
