"""Presets: every one builds and validates; exact page tables for several, by hand."""

import pytest
from jenga.hf import HfOptions
from jenga.pages import (
    GroupPages,
    static_page_table,
    uniform_paged_waste,
    vmm_page_table,
)
from jenga.policies import policy_for
from jenga.specs import Kind, SpecError

from jenga import presets

MiB = 1 << 20

REQUIRED_PRESETS = (
    "llama-3.1-8b", "llama-3.1-70b", "gemma-2-9b", "gemma-2-27b", "gemma-3-12b",
    "ministral-8b", "llama-3.2-11b-vision", "jamba-1.5-mini", "character-ai-like",
    "pyramidkv-llama-3.1-8b", "llama-4-scout", "llama-3.1-8b+llama-3.2-1b",
)  # fmt: skip


def test_names_cover_the_required_presets():
    assert set(REQUIRED_PRESETS) <= set(presets.names())


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_builds_and_has_both_page_tables(name):
    model = presets.get(name)
    assert model.name == name
    assert model.weight_bytes > 0
    for g in model.groups:
        assert g.spec.page_bytes > 0
    vmm = vmm_page_table(model)
    exact = vmm_page_table(model, epsilon=0.0)
    for table in (
        vmm,
        exact,
        *(static_page_table(model, strategy=s) for s in ("lcm", "max", "gcd")),
    ):
        assert [g.group for g in table.groups] == [g.name for g in model.groups]
        assert table.report().count("\n") == len(model.groups) + 2
    assert all(g.tail_bytes == 0 for g in exact.groups)
    assert all(g.within_epsilon and g.tail_fraction <= 0.01 for g in vmm.groups)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(SpecError, match=r"unknown preset 'gpt-5'; presets: llama-3\.1-8b, "):
        presets.get("gpt-5")
    with pytest.raises(SpecError, match="preset 'character-ai-like' has no HF config"):
        presets.config("character-ai-like")


def test_config_is_a_copy():
    cfg = presets.config("gemma-3-12b")
    cfg["text_config"]["num_hidden_layers"] = 1
    assert presets.config("gemma-3-12b")["text_config"]["num_hidden_layers"] == 48


def test_layer_counts_windows_and_context():
    def summary(name):
        m = presets.get(name)
        return [(g.name, g.num_layers, g.spec.window or g.spec.chunk) for g in m.groups]

    assert summary("gemma-2-9b") == [("sliding_window", 21, 4096), ("full", 21, None)]
    assert summary("gemma-2-27b") == [("sliding_window", 23, 4096), ("full", 23, None)]
    assert summary("gemma-3-12b") == [("sliding_window", 40, 1024), ("full", 8, None)]
    assert summary("ministral-8b") == [("full", 9, None), ("sliding_window", 27, 32768)]
    assert summary("llama-4-scout") == [("chunked_local", 36, 8192), ("full", 12, None)]
    assert summary("jamba-1.5-mini") == [("mamba", 28, None), ("full", 4, None)]
    assert summary("llama-3.2-11b-vision") == [("full", 32, None), ("cross_attention", 8, None)]
    contexts = {n: presets.get(n).max_model_len for n in REQUIRED_PRESETS}
    assert contexts["gemma-2-9b"] == 8192
    assert contexts["ministral-8b"] == contexts["llama-3.1-8b"] == 131072
    assert contexts["jamba-1.5-mini"] == 262144
    assert contexts["llama-4-scout"] == 10_485_760


def test_weight_bytes():
    # dense: exact parameter counts x 2 B; others: published totals x 2 B
    assert presets.get("llama-3.1-8b").weight_bytes == 8_030_261_248 * 2
    assert presets.get("llama-3.1-70b").weight_bytes == 70_553_706_496 * 2
    assert presets.get("gemma-2-9b").weight_bytes == 9_241_705_984 * 2
    assert presets.get("ministral-8b").weight_bytes == 8_019_808_256 * 2
    assert presets.get("jamba-1.5-mini").weight_bytes == 51_600_000_000 * 2
    pair = presets.get("llama-3.1-8b+llama-3.2-1b")
    assert pair.weight_bytes == (8_030_261_248 + 1_235_814_400) * 2


def test_speculative_pair_keeps_models_apart():
    pair = presets.get("llama-3.1-8b+llama-3.2-1b")
    assert [(g.name, g.spec.model, g.num_layers) for g in pair.groups] == [
        ("full", "target", 32),
        ("draft.full", "draft", 16),
    ]
    # draft: 16 x 2 x 8 KV heads x 64 dim x 2 B = 32768; target 65536
    assert [g.spec.page_bytes for g in pair.groups] == [65_536, 32_768]
    assert pair.models == ("target", "draft")


def test_pyramidkv_fractions_and_tokens_kept():
    model = presets.get("pyramidkv-llama-3.1-8b")
    assert [(g.name, g.layer_ids[0], g.num_layers) for g in model.groups] == [
        ("full", 0, 8), ("full@3/4", 8, 8), ("full@1/2", 16, 8), ("full@1/4", 24, 8),
    ]  # fmt: skip
    assert [policy_for(g.spec).kept_tokens(1000) for g in model.groups] == [1000, 750, 500, 250]


def test_character_ai_like_sharing():
    model = presets.get("character-ai-like")
    local, full = model.group("sliding_window"), model.group("full")
    assert local.layer_ids == (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33)
    assert full.layer_ids == (5, 17, 29)
    assert full.readers == ((11, 5), (23, 17), (35, 29))
    assert (model.num_layers, model.num_model_layers) == (15, 36)


def test_options_reach_hf_presets():
    model = presets.get("llama-3.1-8b", options=HfOptions(block_size=32))
    assert model.groups[0].spec.page_bytes == 131_072


# ------------------------------------------------------------ exact page tables


def test_llama_3_1_8b_tables():
    # 16 x 2 x 8 x 128 x 2 = 64 KiB per layer block; 32 per 2 MiB chunk; 32 layers
    vmm = vmm_page_table(presets.get("llama-3.1-8b"))
    assert vmm.groups == (GroupPages("full", 65_536, 32, 1, 32, 32, 0, "full", 1, 1, True),)
    static = static_page_table(presets.get("llama-3.1-8b"))
    assert static.unit_bytes == 2 * MiB  # 32 layers x 64 KiB
    assert static.groups[0].blocks_per_large_page == 1


def test_ministral_tables():
    model = presets.get("ministral-8b")
    vmm = vmm_page_table(model)
    rows = [(g.group, g.num_ranges, g.blocks_per_large_page, g.units_per_large_page)
            for g in vmm.groups]  # fmt: skip
    assert rows == [("full", 9, 32, 9), ("sliding_window", 27, 32, 27)]
    # page-layer small pages: 9 x 64 KiB = 589824, 27 x 64 KiB = 1769472 = 3 x 589824
    static = static_page_table(model)
    assert static.unit_bytes == 1_769_472
    assert [g.blocks_per_large_page for g in static.groups] == [3, 1]
    padded = static_page_table(model, strategy="max")
    assert padded.group("full").tail_bytes == 1_179_648  # 1769472 - 589824
    assert padded.waste_fraction("full") == pytest.approx(2 / 3)
    gcd = static_page_table(model, strategy="gcd")
    assert (gcd.unit_bytes, [g.units_per_large_page for g in gcd.groups]) == (589_824, [1, 3])


def test_jamba_tables():
    model = presets.get("jamba-1.5-mini")
    vmm = vmm_page_table(model)  # epsilon 1 %
    assert vmm.group("mamba") == GroupPages(
        "mamba", 573_440, 28, 8, 29, 224, 147_456, "mamba", 1, 35, True
    )
    assert vmm.group("full") == GroupPages("full", 65_536, 4, 1, 32, 4, 0, "full", 1, 1, True)
    # static: mamba 28 x 573440 = 16056320 = 245 x 2**16; attention 4 x 64 KiB = 2**18
    # lcm = 245 x 2**18 = 64225280 -> 4 mamba pages or 245 attention pages
    static = static_page_table(model)
    assert static.unit_bytes == 64_225_280
    assert [g.blocks_per_large_page for g in static.groups] == [4, 245]
    padded = static_page_table(model, strategy="max")
    assert padded.group("full").tail_bytes == 16_056_320 - 262_144
    gcd = static_page_table(model, strategy="gcd")
    assert (gcd.unit_bytes, [g.units_per_large_page for g in gcd.groups]) == (65_536, [245, 4])


def test_vision_and_speculative_static_tables():
    # mllama: 32 x 64 KiB = 2 MiB (self) and 8 x 64 KiB = 512 KiB (cross) -> lcm 2 MiB
    vision = static_page_table(presets.get("llama-3.2-11b-vision"))
    assert vision.unit_bytes == 2 * MiB
    assert [g.blocks_per_large_page for g in vision.groups] == [1, 4]
    # 8B target 2 MiB, 1B draft 16 x 32 KiB = 512 KiB -> 4 draft pages per large page
    pair = static_page_table(presets.get("llama-3.1-8b+llama-3.2-1b"))
    assert (pair.unit_bytes, [g.blocks_per_large_page for g in pair.groups]) == (2 * MiB, [1, 4])
    pair_vmm = vmm_page_table(presets.get("llama-3.1-8b+llama-3.2-1b"))
    assert pair_vmm.group("draft.full").blocks_per_large_page == 64  # 2 MiB / 32 KiB


def test_hymba_like_vmm_table_has_tails():
    # attention: 16 x 2 x 5 x 64 x 2 = 20480 = 5 x 2**12 -> lcm k = 5; k = 1 holds 102,
    #   tail 2097152 - 2088960 = 8192 (0.39 %) <= 1 %
    # mamba: 3 x 3200 x 2 + 3200 x 16 x 4 = 224000 = 875 x 2**8 -> lcm k = 875;
    #   k=1: 9 states, tail 81152 (3.9 %); k=2: 18, 162304 (3.9 %);
    #   k=3: 28, tail 6291456 - 6272000 = 19456 (0.31 %) -> k = 3
    table = vmm_page_table(presets.get("hymba-1.5b-like"))
    rows = [(g.group, g.chunks_per_range, g.lcm_chunks_per_range, g.blocks_per_large_page,
             g.tail_bytes, g.units_per_large_page) for g in table.groups]  # fmt: skip
    assert rows == [
        ("full", 1, 5, 102, 8192, 3),
        ("sliding_window", 1, 5, 102, 8192, 15),
        ("mamba", 3, 875, 28, 19_456, 96),
    ]


def test_llava_onevision_vision_embedding_table():
    # 16 tokens x 3584 x 2 B = 114688 = 7 x 2**14 -> lcm k = 7
    # k=1: 18 held, tail 32768 (1.56 %); k=2: 36, 65536 (1.56 %); k=3: 54, 98304 (1.56 %)
    # k=4: 8388608 // 114688 = 73, tail 8388608 - 8372224 = 16384 (0.20 %) -> k = 4
    table = vmm_page_table(presets.get("llava-onevision-7b"))
    assert table.group("encoder.vision_embedding") == GroupPages(
        "encoder.vision_embedding", 114_688, 1, 4, 73, 4, 16_384, "vision_embedding", 1, 7, True
    )
    # static: 28 x 32 KiB = 896 KiB decoder page = 8 embedding pages of 112 KiB
    static = static_page_table(presets.get("llava-onevision-7b"))
    assert (static.unit_bytes, [g.blocks_per_large_page for g in static.groups]) == (
        917_504,
        [1, 8],
    )


def test_kv_split_on_a_preset():
    table = vmm_page_table(presets.get("gemma-2-9b"), kv_split=True)
    # 16 x 8 x 256 x 2 = 64 KiB per K or V block; 42 ranges per group
    assert [(g.small_page_bytes, g.num_ranges, g.blocks_per_large_page) for g in table.groups] == [
        (65_536, 42, 32), (65_536, 42, 32),
    ]  # fmt: skip


# ----------------------------------------------------------- uniform baseline


def test_uniform_paged_waste_of_windowed_and_chunked_models():
    assert uniform_paged_waste(presets.get("gemma-2-9b"), 8192) == 0.25
    assert uniform_paged_waste(presets.get("ministral-8b"), 131_072) == 0.5625
    # 36 chunked layers keep 8192 of 10485760 tokens: 0.75 x (1 - 1/1280)
    scout = presets.get("llama-4-scout")
    assert uniform_paged_waste(scout, 10_485_760) == pytest.approx(0.75 * (1 - 1 / 1280))
    # nothing is wasted before the window fills
    assert uniform_paged_waste(presets.get("gemma-2-9b"), 4096) == 0.0
    with pytest.raises(SpecError, match="not mamba"):
        uniform_paged_waste(presets.get("jamba-1.5-mini"), 100)
    assert presets.get("jamba-1.5-mini").group("mamba").spec.kind is Kind.MAMBA
