"""LLaVA-OneVision through its own processor: real images, a tiny random SigLIP tower.

The processor expands each ``<image>`` into the image's feature tokens (base grid, anyres
crop, newline), left-pads the batch and makes ``pixel_values``; `generate` with a
`VmmCache` must give the logits of transformers' own cache. The decoder's layer 0 stays
in the decoder's group (not the vision-embedding group).
The tokenizer is a word-level vocabulary built in code (no downloads); torchvision is not
installed, so the processor is built without its video processor (unused by images).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
Image = pytest.importorskip("PIL.Image")

from jenga.hf import model_spec_from_config  # noqa: E402

import vmm  # noqa: E402
from integrations.hf import VmmCache, cache_kwargs  # noqa: E402
from integrations.kvcache import KVCache  # noqa: E402

IMAGE = 127
TEXT = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 512, "num_hidden_layers": 2, "initializer_range": 0.2,
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}  # fmt: skip
VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
          "initializer_range": 0.2}  # fmt: skip


class _ImageTextProcessor(transformers.LlavaOnevisionProcessor):
    """The library's processor without its video processor (needs torchvision)."""

    @classmethod
    def get_attributes(cls):
        return ["image_processor", "tokenizer"]


def processor():
    vocab = {"<unk>": 0, "<pad>": 1, "<image>": IMAGE, **{f"w{i}": i for i in range(2, 120)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )  # fmt: skip
    images = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": 28, "width": 28}, crop_size={"height": 28, "width": 28},
        image_grid_pinpoints=[[28, 28]], do_pad=True,
    )  # fmt: skip
    return _ImageTextProcessor(
        image_processor=images, tokenizer=tokenizer, num_image_tokens=4,
        vision_feature_select_strategy="full",
    )  # fmt: skip


def tiny_llava(dtype: torch.dtype):
    config = transformers.LlavaOnevisionConfig(
        text_config=TEXT, vision_config=VISION, image_token_index=IMAGE,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
        image_grid_pinpoints=[[28, 28]], initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlavaOnevisionForConditionalGeneration(config).eval().to(dtype)


def images(n: int):
    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((28, 28, 3)) * 255).astype("uint8")) for _ in range(n)]


PROMPTS = ["w5 <image> w7 w9 w11 w3 w17", "<image> w4 w8"]


@pytest.mark.parametrize(
    ("dtype", "batch"), [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 2)]
)
def test_llava_onevision_with_images_bitwise_equal(dtype: torch.dtype, batch: int):
    model = tiny_llava(dtype)
    inputs = processor()(
        images=images(batch), text=PROMPTS[:batch], return_tensors="pt", padding=True,
        padding_side="left",
    )  # fmt: skip
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    # 10 feature tokens per image: a 2x2 base grid, a 2x2 anyres crop + 2 row newlines
    assert (inputs["input_ids"] == IMAGE).sum(dim=1).tolist() == [10] * batch
    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False,
              "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    ref = model.generate(**inputs, **kwargs)
    cache = VmmCache(model.config, chunk_bytes=4096, block_size=4)
    ours = model.generate(**inputs, **kwargs, **cache_kwargs(cache))
    assert torch.equal(ours.sequences, ref.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(ref.logits))
    # the decoder's groups only: vision embeddings are recomputed by transformers
    assert [g.name for g in cache.kv.model.groups] == ["full", "sliding_window"]
    cache.kv.check_invariants(expensive=True)
    cache.close()


def test_decoder_layer_zero_resolves_to_the_decoder_group_not_the_encoders():
    spec = model_spec_from_config(tiny_llava(torch.float32).config.to_dict())
    assert [g.name for g in spec.groups] == ["full", "sliding_window", "encoder.vision_embedding"]
    pool = vmm.ChunkPool(vmm.get_backend("host", granularity=4096), 64 * 4096)
    kv = KVCache(spec, pool)
    assert [kv.group_of(layer).name for layer in (0, 1)] == ["full", "sliding_window"]
    kv.close()
    pool.close()
