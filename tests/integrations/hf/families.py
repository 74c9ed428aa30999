"""Tiny random configs of the decoder families the HF cache and the mini engine serve.

Each entry builds a transformers model with random weights (``initializer_range=0.2`` so
logits are sharp, hidden 64, 2-4 layers; a family's fields override `SMALL`'s), small
enough that a 23-token generation runs in well under a second on a shared CPU core.
Windows and chunks are 8 tokens, Mamba checkpoints (`CHECKPOINT`) 8 tokens, so an
11-token prompt plus 12 new tokens slides, crosses chunk boundaries and moves states to
new checkpoint blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers

SMALL = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 512,
    "initializer_range": 0.2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
WINDOW = 8
CHECKPOINT = 8
SW_FULL = ["sliding_attention", "full_attention"]

# name -> (config class, model class, config fields beyond SMALL)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"num_hidden_layers": 2, "sliding_window": WINDOW}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM",
                  {"num_hidden_layers": 4, "sliding_window": WINDOW, "head_dim": 16,
                   "layer_types": SW_FULL * 2}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"num_hidden_layers": 2, "sliding_window": WINDOW, "head_dim": 16,
                "attn_implementation": "eager"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"num_hidden_layers": 4, "sliding_window": WINDOW, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": WINDOW,
               "max_window_layers": 1}),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
               "expert_layer_period": 100, "num_experts": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              {"num_hidden_layers": 3, "head_dim": 16, "use_sliding_window": True,
               "sliding_window": WINDOW, "max_window_layers": 1}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_hidden_layers": 2}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"num_hidden_layers": 2}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              {"num_hidden_layers": 4, "sliding_window": WINDOW}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                {"num_hidden_layers": 4, "sliding_window": WINDOW, "head_dim": 16}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"num_hidden_layers": 2, "sliding_window": WINDOW, "head_dim": 16,
                 "num_local_experts": 2, "num_experts_per_tok": 1,
                 "attn_implementation": "eager"}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_hidden_layers": 2, "num_local_experts": 2, "num_experts_per_tok": 1}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM",
                {"num_hidden_layers": 4, "sliding_window": WINDOW, "sliding_window_pattern": 4,
                 "head_dim": 16}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                {"num_hidden_layers": 4, "no_rope_layer_interval": 2}),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
                {"num_hidden_layers": 4, "sliding_window": WINDOW, "head_dim": 16,
                 "layer_types": SW_FULL * 2, "num_kv_shared_layers": 2,
                 "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128,
                 "laurel_rank": 4, "altup_num_inputs": 2,
                 "activation_sparsity_pattern": [0.0] * 4}),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  {"num_hidden_layers": 2, "mamba_d_ssm": 64, "mamba_n_heads": 4,
                   "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1,
                   "mamba_chunk_size": 8, "head_dim": 16}),
    "bamba": ("BambaConfig", "BambaForCausalLM",
              {"num_hidden_layers": 4, "attn_layer_indices": [1, 3], "mamba_n_heads": 4,
               "mamba_d_head": 32, "mamba_d_state": 8, "mamba_n_groups": 1,
               "mamba_chunk_size": 8}),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM",
               {"num_hidden_layers": 4, "n_mamba_heads": 4,
                "layers_block_type": ["linear_attention", "hybrid"] * 2,
                "mamba_d_state": 8, "mamba_headdim": 32, "chunk_size": 8, "num_mem_blocks": 1,
                "mamba_ngroups": 1, "attention_head_dim": 32}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {"num_hidden_layers": 4, "head_dim": 16,
                    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 2,
                    "num_experts_per_tok": 1, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 32}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               {"num_hidden_layers": 4, "head_dim": 16, "attention_chunk_size": WINDOW,
                "intermediate_size_mlp": 96, "num_local_experts": 1,
                "interleave_moe_layer_step": 2}),
    # multi-head latent attention: transformers caches the latent (kv_lora_rank 24 + rope
    # 8 = a 32-wide vector per token); MoE from layer 1 on (4 routed experts, 2 groups)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": 32,
                     "kv_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16, "first_k_dense_replace": 1, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                     "moe_intermediate_size": 32, "n_shared_experts": 1}),
}  # fmt: skip


def tiny_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """The family's tiny model with random weights from `seed`, in eval mode, as `dtype`."""
    config_name, model_name, extra = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    return model.to(dtype)


def text_inputs(batch: int, length: int = 11) -> dict[str, torch.Tensor]:
    """Random prompts; with batch 2, row 0 is left-padded by 4 tokens."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if batch == 2:
        ids[0, :4] = 0
        mask[0, :4] = 0
    return {"input_ids": ids, "attention_mask": mask}


GenerateFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
