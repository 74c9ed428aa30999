"""The attention + Mamba KV-cache config the Mamba hybrid tests share (needs vLLM importable)."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from integrations.vllm import compat


def mamba_hybrid_config(
    attn_block: int,
    mamba_block: int,
    num_blocks: int = 64,
    mamba_cache_mode: str = "align",
    **mamba: Any,
) -> KVCacheConfig:
    """Full attention ("attn", blocks of ``attn_block`` tokens) beside a Mamba group
    ("mixer", ``mamba_block``, vLLM's ``mamba_cache_mode``; ``mamba``: more `MambaSpec`
    fields), one layer each, no tensors (as vLLM's scheduler tests build it)."""
    full = compat.FullAttentionSpec(
        block_size=attn_block, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    state = compat.MambaSpec(
        block_size=mamba_block,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mamba_cache_mode,
        **mamba,
    )
    groups = [KVCacheGroupSpec(["attn"], full), KVCacheGroupSpec(["mixer"], state)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
