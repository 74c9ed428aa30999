"""The Jamba case: a Mamba state block that fills a whole page, the default
512-token checkpoint interval. Crossing a checkpoint moves the state to a new block and
unmaps the old page; the layers' conv/SSM views must follow it (views left on the
unmapped page would fault on the next step). Logits must equal transformers' own cache's
bitwise past 512, 1,024 and 4,096 tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from jenga.specs import Kind

from integrations.hf import VmmCache, cache_kwargs
from tests.integrations.hf.families import SMALL

NEW_TOKENS = 6


def _jamba() -> transformers.PreTrainedModel:
    """Tiny Jamba whose Mamba state (conv [128, 4] + ssm [128, 4], fp32) is 4 KiB: exactly
    one 4 KiB chunk, so each checkpoint block is a whole page of its own."""
    fields = {**SMALL, "max_position_embeddings": 8192}
    config = transformers.JambaConfig(
        **fields, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=100, num_experts=1, mamba_d_state=4, mamba_d_conv=4,
        mamba_expand=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(config).eval()


@pytest.mark.parametrize("prompt_len", [509, 1021, 4093])
def test_jamba_whole_page_state_crosses_checkpoints_bitwise(prompt_len: int) -> None:
    model = _jamba()
    ids = torch.randint(3, 128, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    gen = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False,
           "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    ref = model.generate(input_ids=ids, **gen)
    cache = VmmCache(model.config, chunk_bytes=4096)
    ours = model.generate(input_ids=ids, **gen, **cache_kwargs(cache))
    assert torch.equal(ours.sequences, ref.sequences)
    assert torch.equal(torch.stack(ours.logits), torch.stack(ref.logits))
    kv = cache.kv
    mamba = next(g for g in kv.geometries if kv.model.groups[g.index].spec.kind is Kind.MAMBA)
    assert mamba.page_bytes == 4096, mamba  # the state block is one whole page
    assert cache.store.state_moves >= 1  # the run crossed a checkpoint
    kv.check_invariants(expensive=True)
    cache.close()
