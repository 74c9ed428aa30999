"""A tiny Whisper-style encoder-decoder for driving vLLM's scheduler with cross attention.

Rationale
    vLLM 0.32 has no Llama 3.2 Vision (``mllama``) model; its cross-attention layers
    (`CrossAttentionSpec`) are scheduled only for encoder-decoder models, where the
    encoder input (audio for Whisper) is placed before the first decoder token and the
    cross-attention layers hold its K/V for the whole request — the same shape of cache
    as mllama's cross attention over image tokens. Whisper's multimodal processor needs
    a tokenizer and a feature extractor even to size the encoder budget, and none may be
    downloaded here, so this module writes tiny local ones.

Approach
    `write_tiny_whisper` saves a 2-layer `WhisperConfig`, a character-level tokenizer
    holding Whisper's special tokens (built with `tokenizers`), and a default
    `WhisperFeatureExtractor`. `make_encoder_requests` builds vLLM `Request` s whose
    one `MultiModalFeatureSpec` says "``encoder_tokens`` encoder positions at offset 0",
    with an ``identifier`` naming the audio clip (equal clips share it, as equal
    content hashes do in vLLM).

Limitations
    No encoder runs and no audio exists: the feature's data is None (vLLM's "already
    cached" form); the scheduler only needs positions and identifiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from integrations.vllm import compat
from integrations.vllm.harness import replay
from integrations.vllm.harness.side_by_side import summarize

WHISPER_SPECIALS = (
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|transcribe|>",
    "<|translate|>",
    "<|notimestamps|>",
    "<|nocaptions|>",
    "<|startofprev|>",
    "<|startoflm|>",
)
ENCODER_POSITIONS = 1500  # Whisper's encoder output length (30 s of audio)


def write_tiny_whisper(folder: Path, *, decoder_layers: int = 2) -> Path:
    """A local Whisper-style model folder: config, tokenizer, feature extractor."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, WhisperConfig, WhisperFeatureExtractor

    folder.mkdir(parents=True, exist_ok=True)
    WhisperConfig(
        vocab_size=51865,
        d_model=64,
        encoder_layers=2,
        decoder_layers=decoder_layers,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=ENCODER_POSITIONS,
        max_target_positions=448,
    ).save_pretrained(folder)
    chars = Tokenizer(models.WordLevel({chr(c): c - 32 for c in range(33, 127)}, unk_token="!"))
    chars.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, unk_token="!")
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": list(WHISPER_SPECIALS),
            "eos_token": "<|endoftext|>",
            "bos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
        }
    )
    tokenizer.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return folder


def make_encoder_requests(
    prompts: Sequence[Sequence[int]],
    clips: Sequence[str],
    max_tokens: Sequence[int],
    block_size: int,
    *,
    encoder_tokens: int = ENCODER_POSITIONS,
    offset: int = 0,
    prefix: str = "r",
) -> list[Any]:
    """Decoder prompts, each with one encoder input (``clips[i]`` names its audio).

    ``offset`` > 0 places the input inside the prompt instead (a decoder-only model's
    image placeholders at ``[offset, offset + encoder_tokens)``)."""
    hasher = compat.request_block_hasher(block_size, "sha256")
    out = []
    for i, (prompt, clip, n) in enumerate(zip(prompts, clips, max_tokens, strict=True)):
        feature = compat.multimodal_feature(clip, offset, encoder_tokens, "audio")
        out.append(
            compat.Request(
                request_id=f"{prefix}{i}",
                prompt_token_ids=list(prompt),
                sampling_params=compat.sampling_params(max_tokens=n, ignore_eos=True),
                pooling_params=None,
                mm_features=[feature],
                block_hasher=hasher,
            )
        )
    return out


def layer_specs(*, block_size: int = 16, decoder_layers: int = 2) -> dict[str, Any]:
    """Per-layer vLLM specs of the tiny Whisper decoder: self attention + cross attention."""
    import torch

    attn = {"block_size": block_size, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float16}
    specs: dict[str, Any] = {}
    for i in range(decoder_layers):
        specs[f"model.decoder.layers.{i}.self_attn.attn"] = compat.FullAttentionSpec(**attn)
        specs[f"model.decoder.layers.{i}.encoder_attn.attn"] = compat.CrossAttentionSpec(**attn)
    return specs


WHISPER_SETUP_LIMITS: dict[str, Any] = {
    "max_model_len": 448,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
}
"""Scheduler limits of the tiny Whisper runs (448: Whisper's decoder positions; the
batch holds one whole 1,500-position encoder input)."""


def make_scheduler(folder: Path, memory_mb: int, *, jenga: bool) -> Any:
    """vLLM's scheduler or ours on the tiny Whisper folder. vLLM's runs with prefix
    caching off: its `CrossAttentionManager` raises when caching is on; ours caches."""
    from dataclasses import replace

    setup = replay.SchedulerSetup(**WHISPER_SETUP_LIMITS)
    if not jenga:
        setup = replace(setup, enable_prefix_caching=False)
    config = replay.make_vllm_config(folder, setup)
    kv_config = replay.kv_cache_config_for(config, layer_specs(), memory_mb << 20)
    return replay.make_scheduler(config, kv_config, jenga=jenga)


def make_wave(n: int, prefix: str, *, suffix: int = 0, clips: int = 4) -> list[Any]:
    """``n`` requests: Whisper's task tokens, a private 61-token decoder prompt, ``suffix``
    shared tokens, 32 output tokens, and one of ``clips`` audio clips each."""
    head = [50258, 50259, 50359]  # <|startoftranscript|><|en|><|transcribe|>
    prompts = [head + [100 + i] * 61 + [7] * suffix for i in range(n)]
    names = [f"clip-{i % clips}" for i in range(n)]
    return make_encoder_requests(prompts, names, [32] * n, 16, prefix=prefix)


def side_by_side(memory_mb: int = 32, requests: int = 16, clips: int = 4) -> list[Any]:
    """vLLM's manager and ours on the same encoder-decoder requests and memory, two waves
    sharing prompts and audio clips; one `side_by_side.Row` per manager."""
    import tempfile
    import time

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_whisper(Path(tmp) / "whisper")
        for jenga in (False, True):
            start = time.perf_counter()
            scheduler = make_scheduler(folder, memory_mb, jenga=jenga)
            waves = [
                make_wave(requests, "a", clips=clips),
                make_wave(requests, "b", suffix=20, clips=clips),
            ]
            reports = [replay.replay(scheduler, wave) for wave in waves]
            manager = "jenga" if jenga else "vllm"
            blocks = int(scheduler.kv_cache_config.num_blocks)
            rows.append(summarize("whisper", manager, blocks, reports, start))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="cross attention side by side (Whisper-style)")
    parser.add_argument("--memory-mb", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--clips", type=int, default=4)
    args = parser.parse_args(argv)
    for row in side_by_side(args.memory_mb, args.requests, args.clips):
        print("  ".join(f"{k}={v}" for k, v in asdict(row).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
