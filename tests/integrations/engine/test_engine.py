"""MiniEngine outputs equal per-request `model.generate` while requests join, are chunked,
preempted and hit the prefix cache."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import vmm  # noqa: E402
from integrations.engine import EngineConfig, MiniEngine  # noqa: E402

SMALL = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 512,
    "initializer_range": 0.2, "num_hidden_layers": 2,
}  # fmt: skip
CHUNK = 4096  # 4-token fp32 blocks of 2 x 16 KV heads x dims: 1 KiB, 4 per chunk


def tiny(kind: str = "llama"):
    if kind == "llama":
        config = transformers.LlamaConfig(**SMALL)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.MistralConfig(**SMALL, sliding_window=8)
        cls = transformers.MistralForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    model.generation_config.eos_token_id = None  # the engine does not stop at eos
    return model


def workload(num: int = 6, new_tokens: int = 10):
    """Even requests share a 24-token prefix; request i arrives at step i."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 128, (24,), generator=gen).tolist()
    out = []
    for i in range(num):
        tail = torch.randint(0, 128, (5 + 3 * i,), generator=gen).tolist()
        out.append((f"r{i}", (prefix if i % 2 == 0 else []) + tail, new_tokens, i))
    return out


def reference(model, requests) -> dict[str, list[int]]:
    out = {}
    for rid, prompt, n, _ in requests:
        ids = torch.tensor([prompt], device=model.device)
        seq = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        out[rid] = seq[0, len(prompt) :].tolist()
    return out


def run_engine(model, requests, **config) -> MiniEngine:
    config.setdefault("chunk_bytes", CHUNK)
    config.setdefault("block_size", 4)
    engine = MiniEngine(model, EngineConfig(**config))
    for rid, prompt, n, arrival in requests:
        engine.add_request(rid, prompt, n, arrival_step=arrival)
    engine.outputs = engine.run()  # type: ignore[attr-defined]
    engine.kv.check_invariants(expensive=True)
    return engine


@pytest.fixture(scope="module")
def llama():
    model = tiny("llama")
    requests = workload()
    return model, requests, reference(model, requests)


def test_joins_chunked_prefill_and_prefix_hits_match_reference(llama):
    model, requests, ref = llama
    engine = run_engine(model, requests, token_budget=16, budget_bytes=64 * CHUNK)
    assert engine.outputs == ref
    stats = engine.stats
    assert stats["prefix.hit_tokens"] == 48  # r2 and r4 each reuse the 24-token prefix
    assert (stats["preemptions"], stats["steps"], stats["running.max"]) == (0, 17, 6)
    assert stats["tokens.computed"] == 153
    assert engine.kv.stats()["requests.live"] == 0
    engine.close()


def test_preemption_under_memory_pressure_matches_reference(llama):
    model, requests, ref = llama
    engine = run_engine(model, requests, token_budget=16, budget_bytes=12 * CHUNK)
    assert engine.outputs == ref
    stats = engine.stats
    assert (stats["preemptions"], stats["steps"], stats["running.max"]) == (1, 24, 5)
    assert [r.request_id for r in engine.done.values() if r.num_preemptions] == ["r4"]
    # r4 recomputes from the prefix cache: 24 more hit tokens than without pressure
    assert stats["prefix.hit_tokens"] == 72
    # under pressure, evicted cached pages' chunks were remapped to new pages
    assert engine.kv.stats()["kv.remapped_units"] == 10
    engine.close()


def test_without_prefix_cache_matches_reference_and_hits_nothing(llama):
    model, requests, ref = llama
    engine = run_engine(
        model, requests, token_budget=64, budget_bytes=64 * CHUNK, use_prefix_cache=False
    )
    assert engine.outputs == ref
    assert engine.stats["prefix.hit_tokens"] == 0
    engine.close()


def test_sliding_window_model_matches_reference_and_unmaps_window_pages():
    model = tiny("mistral")
    requests = workload(num=4, new_tokens=12)
    engine = run_engine(model, requests, token_budget=16, budget_bytes=64 * CHUNK)
    assert engine.outputs == reference(model, requests)
    assert engine.kv.stats()["kv.pages.unmapped"] > 0
    engine.close()


def test_request_larger_than_the_cache_raises_out_of_memory():
    model = tiny("llama")
    engine = MiniEngine(model, EngineConfig(token_budget=64, budget_bytes=2 * CHUNK))
    engine.add_request("big", list(range(40)), 4)
    with pytest.raises(vmm.OutOfMemory, match="does not fit"):
        engine.run()
    engine.close()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_overlap_maps_next_step_during_compute_with_identical_outputs(kind: str, llama):
    model, requests, ref = llama if kind == "llama" else (tiny(kind), workload(4, 12), None)
    if ref is None:
        ref = reference(model, requests)
    engine = run_engine(model, requests, token_budget=16, budget_bytes=64 * CHUNK, overlap=True)
    assert engine.outputs == ref
    stats = engine.kv.stats()
    assert stats["overlap.launched"] > 0 and stats["overlap.plans.async"] > 0
    assert stats["overlap.stalls"] <= stats["overlap.launched"]
    engine.close()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_flash_without_flash_attn_runs_torch_sdpa_and_matches_reference(kind, monkeypatch):
    """``attention='flash'`` without the flash-attn package: torch's SDPA (math backend
    on CPU) under the flash path's lower-right causal / per-query window masks; Mistral's
    window (8) is narrower than the 16-token prefill chunks."""
    from integrations.engine import forward

    monkeypatch.setattr(forward, "flash_attn_installed", lambda: False)
    model = tiny(kind)
    requests = workload(num=4, new_tokens=8)
    engine = run_engine(
        model, requests, token_budget=16, budget_bytes=64 * CHUNK, attention="flash"
    )
    assert engine.forward.flash_kernel == "sdpa_flash"
    assert engine.outputs == reference(model, requests)
    engine.close()


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_sdpa_flash_equals_masked_sdpa_on_cpu(n, window):
    from integrations.engine.forward import causal_mask, sdpa_flash

    gen = torch.Generator().manual_seed(n)
    start = 20
    key_start = 0 if window is None else max(0, start - window + 1)
    q = torch.randn(1, 4, n, 16, generator=gen)
    k = torch.randn(1, 2, start + n - key_start, 16, generator=gen)
    v = torch.randn(1, 2, start + n - key_start, 16, generator=gen)
    mask = causal_mask(start, start + n, key_start, window)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True
    )
    got = sdpa_flash(q, k, v, start, key_start, window, 0.25)
    torch.testing.assert_close(got, want)


@pytest.mark.cuda
@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_sdpa_flash_runs_torch_flash_kernel_on_cuda(n, window):
    """On CUDA `sdpa_flash` is torch's FlashAttention kernel alone (SDPA restricted to the
    flash backend raises where it cannot run) and agrees with the masked math path."""
    from integrations.engine.forward import causal_mask, sdpa_flash

    gen = torch.Generator().manual_seed(n)
    start = 20
    key_start = 0 if window is None else max(0, start - window + 1)
    shape_k = (1, 2, start + n - key_start, 64)
    q = torch.randn(1, 4, n, 64, generator=gen).cuda().half()
    k, v = (torch.randn(*shape_k, generator=gen).cuda().half() for _ in range(2))
    got = sdpa_flash(q, k, v, start, key_start, window, 0.125)
    mask = causal_mask(start, start + n, key_start, window, "cuda")
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.125, enable_gqa=True
    )
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flash_attn", "sdpa_flash"])
def test_flash_attention_on_cuda_matches_reference(kernel, monkeypatch):
    from integrations.engine import forward

    if kernel == "flash_attn":
        pytest.importorskip("flash_attn")
    else:
        monkeypatch.setattr(forward, "flash_attn_installed", lambda: False)
    model = tiny("mistral").to("cuda", torch.float16)
    requests = workload(num=4, new_tokens=8)
    ref = reference(model, requests)  # the library's own generate, same GPU and dtype
    engine = run_engine(
        model, requests, token_budget=512, budget_bytes=64 << 21, chunk_bytes=2 << 20,
        block_size=256, backend="cuda", attention="flash",
    )  # fmt: skip
    assert engine.forward.flash_kernel == kernel
    assert engine.outputs == ref
    engine.close()


def test_growing_then_shrinking_the_cache_mid_run_keeps_outputs_equal(llama):
    """The cache grows while requests run (no preemption after it) and shrinks after they
    finish (cached pages evicted): the pool and the allocator move together."""
    model, requests, ref = llama
    config = EngineConfig(
        token_budget=16, budget_bytes=12 * CHUNK, max_bytes=64 * CHUNK, chunk_bytes=CHUNK,
        block_size=4,
    )  # fmt: skip
    engine = MiniEngine(model, config)
    for rid, prompt, n, arrival in requests:
        engine.add_request(rid, prompt, n, arrival_step=arrival)
    for _ in range(4):
        engine.step()
    engine.kv.set_capacity(64 * CHUNK)
    assert (engine.pool.budget_bytes, engine.kv.allocator.total_units) == (64 * CHUNK, 64)
    assert engine.run() == ref
    assert engine.stats["preemptions"] == 0  # 12 chunks alone preempt once (test above)
    cached = engine.kv.pool.num_mapped
    assert cached > 0  # finished requests' pages stay cached
    evicted = engine.kv.set_capacity(4 * CHUNK)  # cached pages evicted until 4 chunks hold
    assert evicted > 0 and engine.kv.pool.num_mapped == cached - evicted <= 4
    assert (engine.pool.budget_bytes, engine.kv.allocator.total_units) == (4 * CHUNK, 4)
    engine.kv.check_invariants(expensive=True)
    engine.close()
