"""The paper's waste figures, exactly: analytic (`needs`) and measured by the engine."""

from fractions import Fraction

import pytest
from jenga.sim.engine import Engine, EngineConfig
from jenga.sim.hardware import get_gpu
from jenga.sim.metrics import summarize
from jenga.sim.models import get_model
from jenga.sim.needs import needed_bytes, step_needed_bytes, uniform_bytes, uniform_waste
from jenga.sim.workloads import Request, Trace, image_ids, random_ids

from jenga.sim import baselines

GIB = 1 << 30


def test_llama_vision_mmmu_uniform_waste_is_79_6_percent():
    model = get_model("llama-3.2-11b-vision")
    waste = uniform_waste(model, 6236, image_tokens=6193)
    exact = 1 - Fraction(32 * 43 + 8 * 6193, 40 * 6236)
    assert waste == pytest.approx(float(exact), abs=1e-12)
    assert round(100 * waste, 1) == 79.6


def test_gemma2_at_8k_max_waste_is_25_percent():
    assert uniform_waste(get_model("gemma-2-9b"), 8192) == 0.25


def test_ministral_at_128k_max_waste_is_56_25_percent():
    assert uniform_waste(get_model("ministral-8b"), 131072) == 0.5625


def test_needed_bytes_by_kind():
    gemma = get_model("gemma-2-9b")
    per_token_layer = 2 * 8 * 256 * 2
    assert needed_bytes(gemma, 100) == 42 * 100 * per_token_layer
    assert needed_bytes(gemma, 5000) == (21 * 5000 + 21 * 4096) * per_token_layer
    vision = get_model("llama-3.2-11b-vision")
    assert needed_bytes(vision, 6000, image_tokens=6193) == 8 * 6000 * 4096
    assert uniform_bytes(vision, 10) == 40 * 10 * 4096


def _one_request_run(model_name: str, allocator: str, prompt: tuple[int, ...], image: int):
    model = get_model(model_name)
    alloc = getattr(baselines, allocator)(model, 60 * GIB)
    request = Request("r0", prompt, output=(1, 2, 3), image_tokens=image)
    engine = Engine(
        model,
        get_gpu("h100-80gb"),
        alloc,
        EngineConfig(max_num_batched_tokens=1 << 20, check_invariants_every=1),
    )
    return engine.run(Trace("one", (request,)))


def test_engine_measures_uniform_waste_on_mmmu_shape():
    prompt = image_ids(7, 6193) + random_ids(__import__("random").Random(0), 43)
    result = _one_request_run("llama-3.2-11b-vision", "uniform", prompt, 6193)
    live, needed = result.timeline["live_bytes"][0], result.timeline["needed_bytes"][0]
    assert live == 6240 * 40 * 4096  # 390 blocks of 16 tokens, every layer
    assert needed == (32 * 43 + 8 * 6193) * 4096
    assert round(100 * (1 - needed / live), 1) == 79.6


@pytest.mark.parametrize(
    ("allocator", "held_tokens"),
    [("uniform", 42 * 8192), ("vllm_hybrid", 21 * 8192 + 21 * 4112)],
)
def test_engine_measures_gemma_8k_decode_waste(allocator, held_tokens):
    """At the first decode step after an 8,190-token prompt (8K context), uniform holds
    8,192 slots in all 42 layers; the step needs 8,191 tokens in the 21 full layers and
    4,097 in the 21 sliding. The hybrid baseline released the sliding blocks wholly before
    token 4,094 (255 blocks)."""
    result = _one_request_run("gemma-2-9b", allocator, tuple(range(8190)), 0)
    tl = result.timeline
    per_token_layer = 2 * 8 * 256 * 2
    assert tl["needed_bytes"][1] == (21 * 8191 + 21 * 4097) * per_token_layer
    assert tl["live_bytes"][1] == held_tokens * per_token_layer
    assert summarize(result).steps == 3


def test_chunked_local_keeps_the_current_chunk():
    scout = get_model("llama-4-scout")  # 36 chunked layers (8192) + 12 full
    per = scout.groups[0].spec.bytes_per_token
    assert needed_bytes(scout, 10_000) == (36 * (10_000 - 8192) + 12 * 10_000) * per
    assert needed_bytes(scout, 8192) == (36 * 8192 + 12 * 8192) * per


def test_vision_embedding_until_the_prompt_is_done():
    llava = get_model("llava-onevision-7b")
    full, vision = llava.groups
    during = needed_bytes(llava, 1000, image_tokens=700, prompt_done=False)
    after = needed_bytes(llava, 1000, image_tokens=700, prompt_done=True)
    assert during == 28 * 1000 * full.spec.bytes_per_token + 700 * vision.spec.bytes_per_token
    assert after == 28 * 1000 * full.spec.bytes_per_token  # text layers hold the image positions


def test_pyramidkv_layers_keep_their_share():
    pyramid = get_model("pyramidkv-llama-3.1-8b")
    per = pyramid.groups[0].spec.bytes_per_token
    assert needed_bytes(pyramid, 1000) == 8 * (1000 + 750 + 500 + 250) * per


def test_mamba_keeps_one_state():
    jamba = get_model("jamba-1.5-mini")
    mamba, full = jamba.groups
    assert (
        needed_bytes(jamba, 5000)
        == 28 * mamba.spec.state_bytes + 4 * 5000 * full.spec.bytes_per_token
    )


def test_step_need_adds_the_window_before_a_chunk():
    gemma = get_model("gemma-2-9b")
    per = gemma.groups[0].spec.bytes_per_token
    # a chunk [6000, 8000): sliding layers read from 6000 - 4096 = 1904
    assert step_needed_bytes(gemma, 6000, 8000) == (21 * (8000 - 1904) + 21 * 8000) * per
