"""Hybrid attention + Mamba models: vLLM's GPU block size, and ours with VMM tensors.

vLLM 0.32 raises the attention block size of a hybrid model until one attention page is
as large as a Mamba state (``Platform._align_hybrid_block_size``, called by
``update_block_size_for_backend`` at engine start-up with the attention backend). With
``kv_tensors="vmm"`` the plugin keeps the backend's block size
(`integrations.vllm.plugin.keep_block_size`), since every group gets its own unpadded
pages. Jamba 1.5 Mini's published config (the model class imports on a CPU);
FlashAttention's kernel block sizes (``MultipleOf(16)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from integrations.vllm.harness import cases, replay

JAMBA_15_MINI = {  # ai21labs/AI21-Jamba-1.5-Mini config.json (the fields vLLM reads)
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 256,
    "vocab_size": 65536,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
    "use_mamba_kernels": False,
}


def _aligned(folder: Path, options: dict[str, object]) -> tuple[int, object]:
    """vLLM's ``update_block_size_for_backend`` on the Jamba config, with the plugin
    registered. Without a built model vLLM finds no attention backend, so the test hands
    it FlashAttention's (what a GPU run finds)."""
    from integrations.vllm.plugin import register
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    register()
    setup = replay.SchedulerSetup(max_model_len=4096, jenga_options=options)
    config = replay.make_vllm_config(folder, setup)
    config.cache_config.user_specified_block_size = True  # keep 16 (phase 1 needs a GPU)
    assert config.model_config.is_hybrid and config.cache_config.block_size == 16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Platform, "_find_non_ssm_backends", lambda _config: [FlashAttentionBackend])
        Platform.update_block_size_for_backend(config)
    return config.cache_config.block_size, config.cache_config.mamba_page_size_padded


@pytest.fixture(scope="module")
def jamba_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("jamba-1.5-mini")
    (folder / "config.json").write_text(json.dumps(JAMBA_15_MINI))
    return folder


def test_vllm_raises_jambas_block_size_and_our_case_table_says_the_same(jamba_dir: Path) -> None:
    block, padded = _aligned(jamba_dir, {})
    # 304 KiB Mamba state / 4 KiB per attention token -> 76 tokens, rounded up to 16
    assert block == 80 == cases.vllm_gpu_block_size("jamba-1.5-mini")
    assert padded == 80 * 4096
    specs = cases.layer_specs("jamba-1.5-mini", vllm_gpu=True)
    pages = {s.page_size_bytes for s in specs.values()}
    assert pages == {80 * 4096}  # every page padded to one size, as vLLM pads them


def test_with_vmm_tensors_attention_keeps_16_token_blocks(jamba_dir: Path) -> None:
    block, padded = _aligned(jamba_dir, {"kv_tensors": "vmm"})
    assert (block, padded) == (16, None)
    specs = cases.layer_specs("jamba-1.5-mini")
    assert {s.block_size for s in specs.values()} == {16}
    state = next(s for name, s in specs.items() if name.endswith("mixer"))
    assert state.page_size_bytes == 304 << 10  # unpadded
