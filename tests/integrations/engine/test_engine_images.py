"""The mini engine on image models: tokens equal per-request `generate` with the same images.

LLaVA-OneVision (image features spliced into the prompt) and Mllama (cross attention over
image tokens) with tiny random vision towers, each fed by its own processor (real images,
word-level tokenizers built in code). Five requests join one step apart: r0 and r2 share
text and image (r2 hits r0's prefix, image included), r1 has r0's text with another image
(it may share only the text before the image: LLaVA's blocks before the ``<image>`` run;
none on Mllama, whose cross attention changes every position), r3 is text only, r4 has
two images. Chunked prefill (budget 12 tokens) splits image spans; a second run in half
the chunks preempts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
Image = pytest.importorskip("PIL.Image")

from integrations.engine import EngineConfig, MiniEngine  # noqa: E402
from tests.integrations.engine.test_engine_families import CHUNK  # noqa: E402
from tests.integrations.hf import test_multimodal as llava  # noqa: E402
from tests.integrations.hf.families import tiny_model  # noqa: E402
from tests.integrations.hf.test_vmm_cache import tiny_mllama  # noqa: E402

MLLAMA_IMAGE = 150


def mllama_processor():
    vocab = {"<unk>": 0, "<pad>": 1, "<|begin_of_text|>": 3, "<|image|>": MLLAMA_IMAGE,
             **{f"w{i}": i for i in range(4, 140)}}  # fmt: skip
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<|begin_of_text|>"
    )
    images = transformers.MllamaImageProcessorPil(
        size={"height": 28, "width": 28}, max_image_tiles=2
    )
    return transformers.MllamaProcessor(image_processor=images, tokenizer=tokenizer)


def pictures(shape: tuple[int, int]) -> list:
    rng = np.random.default_rng(5)
    return [Image.fromarray((rng.random((*shape, 3)) * 255).astype("uint8")) for _ in range(2)]


TEXT = "w5 w9 w12 w7 w33 w21 {image} w40 w41 w8 w17 w19 w23 w29 w31"
TAILS = ["", "", " w50 w52 w54 w56", " w60 w61 w62"]


def llava_case():
    model = llava.tiny_llava(torch.float32)
    proc, image = llava.processor(), pictures((28, 28))

    def inputs(text: str, shown: list) -> dict:
        return dict(proc(images=shown or None, text=[text], return_tensors="pt"))

    return model, inputs, image, "<image>"


def mllama_case():
    model = tiny_mllama()
    for layer in model.model.language_model.layers:  # gates start at 0: images would not count
        for name in ("cross_attn_attn_gate", "cross_attn_mlp_gate"):
            if hasattr(layer, name):
                getattr(layer, name).data.fill_(0.5)
    proc, image = mllama_processor(), pictures((28, 56))  # 1x2 tiles

    def inputs(text: str, shown: list) -> dict:
        return dict(proc(images=[shown] if shown else None, text=[text], return_tensors="pt"))

    return model, inputs, image, "<|image|>"


CASES = {"llava_onevision": llava_case, "mllama": mllama_case}


def workload(case) -> list[tuple[str, list[int], dict | None, int]]:
    """(request, prompt ids, image inputs or None, arrival step)."""
    _, inputs, (a, b), token = case
    texts = [TEXT.format(image=token if i < 3 else "w70") + tail for i, tail in enumerate(TAILS)]
    texts.append(f"w5 w9 {token} w12 w7 w33 {token} w21 w40")
    shown = [[a], [b], [a], [], [b, a]]  # r2 repeats r0's image, r3 none, r4 two
    out = []
    for i, (text, pictures) in enumerate(zip(texts, shown, strict=True)):
        got = inputs(text, pictures)
        ids = got.pop("input_ids")[0].tolist()
        got.pop("attention_mask")
        out.append((f"r{i}", ids, got or None, i))
    return out


def reference(model, requests) -> dict[str, list[int]]:
    out = {}
    for rid, prompt, images, _ in requests:
        ids = torch.tensor([prompt])
        seq = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **(images or {}),
            max_new_tokens=8, min_new_tokens=8, do_sample=False,
        )  # fmt: skip
        out[rid] = seq[0, len(prompt) :].tolist()
    return out


def run(model, requests, budget_chunks: int) -> MiniEngine:
    config = EngineConfig(
        token_budget=12, budget_bytes=budget_chunks * CHUNK, chunk_bytes=CHUNK, block_size=4
    )
    engine = MiniEngine(model, config)
    for rid, prompt, images, arrival in requests:
        engine.add_request(rid, prompt, 8, arrival_step=arrival, images=images)
    engine.outputs = engine.run()  # type: ignore[attr-defined]
    engine.kv.check_invariants(expensive=True)
    return engine


@pytest.mark.parametrize("name", list(CASES))
def test_engine_with_images_tokens_equal_generate_hits_and_preemption(name: str):
    case = CASES[name]()
    model = case[0]
    model.generation_config.eos_token_id = None
    requests = workload(case)
    ref = reference(model, requests)
    assert ref["r0"] != ref["r1"]  # the image matters: a shared K/V would show
    roomy = run(model, requests, budget_chunks=256)
    assert roomy.outputs == ref
    hits = {rid: r.num_hit_tokens for rid, r in roomy.done.items()}
    prompt = {rid: p for rid, p, _, _ in requests}
    image_at = prompt["r0"].index(model.config.image_token_id)
    # r1: only whole blocks before the image run (LLaVA), nothing where cross attention
    # reads the image from position 0 (Mllama); r2: r0's prefix, image included
    assert hits["r1"] == (image_at // 4 * 4 if name == "llava_onevision" else 0)
    assert hits["r2"] == len(prompt["r0"]) // 4 * 4
    peak = roomy.kv.stats()["chunks.created.current"]
    roomy.close()
    tight = run(model, requests, budget_chunks=max(peak // 2, 1))
    assert tight.outputs == ref
    assert tight.stats["preemptions"] > 0
    tight.close()


def test_images_on_a_text_model_are_refused_at_add_request():
    engine = MiniEngine(tiny_model("llama"), EngineConfig(chunk_bytes=CHUNK))
    with pytest.raises(ValueError, match=r"request 'r0' has images; .* not 'llama'"):
        engine.add_request("r0", [5, 6, 7], 2, images={"pixel_values": torch.zeros(1, 3, 4, 4)})
    engine.close()


@pytest.mark.parametrize("name", list(CASES))
def test_image_spans_key_the_image_runs_or_position_zero(name: str):
    case = CASES[name]()
    requests = workload(case)
    engine = MiniEngine(case[0], EngineConfig(chunk_bytes=CHUNK, block_size=4))
    for rid, prompt, images, _ in requests:
        engine.add_request(rid, prompt, 2, images=images)
    spans = {r.request_id: r.images.spans for r in engine.pending if r.images is not None}
    placed = {rid: [(s.start, s.length, s.in_text) for s in got] for rid, got in spans.items()}
    if name == "llava_onevision":  # 10 feature tokens per image, in the text
        assert placed == {"r0": [(6, 10, True)], "r1": [(6, 10, True)], "r2": [(6, 10, True)],
                          "r4": [(2, 10, True), (15, 10, True)]}  # fmt: skip
    else:  # 2 tiles x (4 patches + 1) cross tokens per image, keyed from position 0
        assert placed == {"r0": [(0, 10, False)], "r1": [(0, 10, False)],
                          "r2": [(0, 10, False)], "r4": [(0, 20, False)]}  # fmt: skip
    hashes = {rid: [s.content_hash for s in got] for rid, got in spans.items()}
    assert hashes["r0"] == hashes["r2"] != hashes["r1"]
    assert len({*hashes["r0"], *hashes["r1"], *hashes["r4"]}) == len(hashes["r4"]) + 2
    engine.close()


def test_mllama_cross_attention_mask_must_be_the_processors():
    case = mllama_case()
    _, prompt, images, _ = workload(case)[0]
    images["cross_attention_mask"][0, 0] = 1  # a row before <|image|> sees the image
    engine = MiniEngine(case[0], EngineConfig(chunk_bytes=CHUNK))
    with pytest.raises(ValueError, match=r"request 'r0': cross_attention_mask is not Mllama"):
        engine.add_request("r0", prompt, 2, images=images)
    engine.close()
