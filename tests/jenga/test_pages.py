"""Page math on hand-built specs: every expected number is computed by hand in a comment."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jenga.pages import (
    GroupPages,
    PageTable,
    chunks_for_page,
    format_bytes,
    static_page_table,
    static_unit_bytes,
    vmm_page_table,
)
from jenga.specs import Kind, KVGroup, LayerSpec, ModelSpec, SpecError

MiB = 1 << 20
CHUNK = 2 * MiB
JAMBA_STATE = 573_440  # 560 KiB = 35 * 2**14


def paper_example_model() -> ModelSpec:
    # group a: 1 layer, 16 tokens x 2 (K,V) x 1 head x 4 dim x 2 B = 256 B per block
    # group b: 3 layers of 16 x 2 x 1 x 2 x 2 = 128 B, so 384 B per page-layer small page
    a = KVGroup("a", LayerSpec(Kind.FULL, num_kv_heads=1, head_dim=4), (0,))
    b = KVGroup("b", LayerSpec(Kind.FULL, num_kv_heads=1, head_dim=2), (1, 2, 3))
    return ModelSpec("paper-example", (a, b), max_model_len=1024)


def jamba_like_model() -> ModelSpec:
    attn = LayerSpec(Kind.FULL, num_kv_heads=8, head_dim=128)  # 16*2*8*128*2 = 65536 B
    mamba = LayerSpec(Kind.MAMBA, state_bytes=JAMBA_STATE)
    return ModelSpec(
        "jamba-like",
        (
            KVGroup("attn", attn, (4, 12, 20, 28)),
            KVGroup("mamba", mamba, tuple(i for i in range(32) if i % 8 != 4)),
        ),
        max_model_len=262_144,
    )


# ----------------------------------------------------------------------- paper example


def test_paper_example_small_pages_256_and_384_give_large_page_768():
    assert static_unit_bytes([256, 384]) == 768
    assert static_unit_bytes([256, 384], "max") == 384
    assert static_unit_bytes([256, 384], "gcd") == 128


def test_paper_example_static_lcm_table():
    table = static_page_table(paper_example_model())
    assert table.mode == "static"
    assert table.unit_bytes == 768
    assert table.groups == (
        GroupPages("a", 256, 1, 1, 3, 1, 0, "full", 1),  # 768 / 256 = 3 pages
        GroupPages("b", 384, 1, 1, 2, 1, 0, "full", 3),  # 768 / 384 = 2 pages
    )
    assert table.waste_fraction() == 0.0


def test_paper_example_max_pads_and_gcd_splits():
    table_max = static_page_table(paper_example_model(), strategy="max")
    assert (table_max.mode, table_max.unit_bytes) == ("max", 384)
    a = table_max.group("a")
    assert (a.blocks_per_large_page, a.tail_bytes) == (1, 128)  # 384 - 256 padding
    assert table_max.waste_fraction("a") == pytest.approx(1 / 3)
    # one page each: (128 + 0) / (384 + 384)
    assert table_max.waste_fraction() == pytest.approx(128 / 768)
    # 3 pages of a, 1 of b: 3*128 / (4*384)
    assert table_max.waste_fraction(large_pages={"a": 3, "b": 1}) == pytest.approx(0.25)
    table_gcd = static_page_table(paper_example_model(), strategy="gcd")
    assert (table_gcd.mode, table_gcd.unit_bytes) == ("gcd", 128)
    assert table_gcd.group("a").units_per_large_page == 2  # 256 / 128
    assert table_gcd.group("b").units_per_large_page == 3  # 384 / 128
    assert table_gcd.waste_fraction() == 0.0


def test_max_pads_to_a_given_slot_and_refuses_a_slot_too_small():
    table = static_page_table(paper_example_model(), strategy="max", unit_bytes=512)
    assert (table.mode, table.unit_bytes) == ("max", 512)
    assert [(g.tail_bytes, g.units_per_large_page) for g in table.groups] == [(256, 1), (128, 1)]
    with pytest.raises(SpecError, match=r"group 'b'.*384 B, more than the 320 B slot"):
        static_page_table(paper_example_model(), strategy="max", unit_bytes=320)
    with pytest.raises(SpecError, match=r"'max' strategy only, not 'lcm'"):
        static_page_table(paper_example_model(), unit_bytes=768)


# ---------------------------------------------------------------------------- vmm mode


@pytest.mark.parametrize(
    ("epsilon", "k", "blocks", "tail"),
    [
        # k=1: 2097152 // 573440 = 3, tail 2097152 - 1720320 = 376832 (17.97 %)
        (0.18, 1, 3, 376_832),
        # k=5: 10485760 // 573440 = 18, tail 10485760 - 10321920 = 163840 (1.5625 %)
        (0.016, 5, 18, 163_840),
        # k=8: 16777216 // 573440 = 29, tail 16777216 - 16629760 = 147456 (0.879 %)
        (0.01, 8, 29, 147_456),
        # exact LCM: lcm(35 * 2**14, 2**21) = 35 * 2**21 -> 35 chunks, 128 states, no tail
        (0.0, 35, 128, 0),
    ],
)
def test_design_example_mamba_state_560_kib(epsilon, k, blocks, tail):
    table = vmm_page_table(jamba_like_model(), epsilon=epsilon)
    mamba = table.group("mamba")
    assert mamba.small_page_bytes == JAMBA_STATE
    assert mamba.num_ranges == 28
    assert (mamba.chunks_per_range, mamba.blocks_per_large_page, mamba.tail_bytes) == (
        k,
        blocks,
        tail,
    )
    assert mamba.units_per_large_page == 28 * k
    assert mamba.lcm_chunks_per_range == 35
    assert mamba.within_epsilon


def test_attention_group_of_jamba_like_model_is_one_chunk():
    attn = vmm_page_table(jamba_like_model()).group("attn")
    # 65536 B per block divides 2 MiB: k = 1, 32 blocks, 4 ranges -> 4 chunks per large page
    assert attn == GroupPages("attn", 65_536, 4, 1, 32, 4, 0, "full", 1, 1, True)


def test_kv_split_halves_pages_and_doubles_ranges_but_not_for_mamba():
    table = vmm_page_table(jamba_like_model(), kv_split=True)
    attn, mamba = table.group("attn"), table.group("mamba")
    # 32768 B per K (or V) block: 64 per chunk, 8 ranges
    assert (attn.small_page_bytes, attn.num_ranges, attn.blocks_per_large_page) == (32_768, 8, 64)
    assert attn.units_per_large_page == 8
    assert (mamba.small_page_bytes, mamba.num_ranges) == (JAMBA_STATE, 28)


def test_chunks_for_page_cap_reports_a_tail_above_epsilon():
    # cap 4 chunks, epsilon 1 %: tails 17.97 %, 4.30 %, 8.85 %, 4.30 % -> k=2 (first minimum)
    assert chunks_for_page(JAMBA_STATE, CHUNK, epsilon=0.01, max_chunks=4) == (2, False)
    table = vmm_page_table(jamba_like_model(), epsilon=0.01, max_chunks_per_range=4)
    mamba = table.group("mamba")
    assert (mamba.chunks_per_range, mamba.blocks_per_large_page, mamba.within_epsilon) == (
        2,
        7,  # 4194304 // 573440 = 7, tail 4194304 - 4014080 = 180224
        False,
    )
    assert mamba.tail_bytes == 180_224
    assert ">eps" in table.report()


def test_per_group_layout_puts_all_layers_in_one_block():
    table = vmm_page_table(jamba_like_model(), layout="per_group")
    assert table.layout == "per_group"
    # mamba: 28 x 573440 = 16056320 B; in 64 KiB units a block is 245, a chunk 32, so the
    # tail of k chunks is 32k mod 245; the first k >= 8 with tail <= 1 % of 32k is 23:
    # 23 x 2 MiB = 48234496 holds 3 blocks (48168960), tail 65536 (0.14 %); lcm k = 245
    mamba = table.group("mamba")
    assert (mamba.num_ranges, mamba.chunks_per_range, mamba.blocks_per_large_page) == (1, 23, 3)
    assert (mamba.tail_bytes, mamba.lcm_chunks_per_range, mamba.layers_per_small_page) == (
        65_536,
        245,
        28,
    )
    # attention: 4 x 64 KiB = 256 KiB per block, 8 per chunk, one range
    attn = table.group("attn")
    assert (attn.small_page_bytes, attn.blocks_per_large_page, attn.units_per_large_page) == (
        262_144,
        8,
        1,
    )
    # kv_split with per_group: a K range and a V range of 128 KiB blocks
    split = vmm_page_table(jamba_like_model(), layout="per_group", kv_split=True).group("attn")
    assert (split.small_page_bytes, split.num_ranges, split.units_per_large_page) == (
        131_072,
        2,
        2,
    )
    with pytest.raises(SpecError, match="unknown layout 'per_request'"):
        vmm_page_table(jamba_like_model(), layout="per_request")


def test_small_page_larger_than_a_chunk_takes_several():
    # 5 MiB page: lcm(5 MiB, 2 MiB) = 10 MiB -> exact k = 5 holding 2; with epsilon 0.2:
    # k=3 holds 1 with tail 1 MiB (16.7 %) -> chosen (k=3 is the first with >= 1 block)
    assert chunks_for_page(5 * MiB, CHUNK, epsilon=0.0) == (5, True)
    assert chunks_for_page(5 * MiB, CHUNK, epsilon=0.2) == (3, True)


def test_report_lists_every_group_and_the_mode():
    text = vmm_page_table(jamba_like_model()).report()
    assert "mode=vmm unit=2 MiB layout=per_layer epsilon=0.01 kv_split=False" in text
    assert "mamba" in text and "560 KiB" in text and "147456" not in text
    assert "144 KiB (0.88%)" in text  # 147456 B = 144 KiB


def test_format_bytes():
    assert format_bytes(573_440) == "560 KiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(70 * MiB) == "70 MiB"
    assert format_bytes(100) == "100 B"


# ---------------------------------------------------------------------------- bad input


def test_bad_input_raises_spec_error_with_numbers():
    with pytest.raises(SpecError, match="chunk_bytes must be > 0, got 0"):
        vmm_page_table(jamba_like_model(), chunk_bytes=0)
    with pytest.raises(SpecError, match=r"epsilon must be in \[0, 1\), got 1.5"):
        vmm_page_table(jamba_like_model(), epsilon=1.5)
    with pytest.raises(SpecError, match="small_page_bytes must be > 0, got 0"):
        static_unit_bytes([256, 0])
    with pytest.raises(SpecError, match="unknown static strategy 'median'"):
        static_page_table(paper_example_model(), strategy="median")
    with pytest.raises(SpecError, match="needs 3 chunks of 2097152 B, cap is 2"):
        chunks_for_page(5 * MiB, CHUNK, max_chunks=2)


def test_a_large_page_over_the_budget_is_rejected():
    # mamba at epsilon 1 %: 8 chunks x 28 ranges = 224 chunks = 469762048 B
    with pytest.raises(SpecError, match=r"'mamba'.* 224 units of 2097152 B = 469762048 B, budget"):
        vmm_page_table(jamba_like_model(), budget_bytes=400 * MiB)
    table = vmm_page_table(jamba_like_model(), budget_bytes=448 * MiB)  # exactly fits
    assert table.group("mamba").units_per_large_page * CHUNK == 448 * MiB
    with pytest.raises(SpecError, match="needs 1 units of 768 B = 768 B, budget is 512 B"):
        static_page_table(paper_example_model(), budget_bytes=512)


def test_inconsistent_rows_are_rejected():
    with pytest.raises(SpecError, match="units_per_large_page 5 != chunks_per_range 1"):
        GroupPages("x", 256, 4, 1, 8, 5, 0)
    row = GroupPages("x", 256, 1, 1, 8, 1, 0)  # 2048 B large page
    with pytest.raises(SpecError, match="1 units x 4096 B != large page 2048 B"):
        PageTable("vmm", 4096, (row,))
    with pytest.raises(KeyError, match="no group 'y'"):
        PageTable("vmm", 2048, (row,)).group("y")
    with pytest.raises(SpecError, match="a large page holds 0 blocks"):
        GroupPages("x", 256, 1, 1, 0, 1, 2048)
    with pytest.raises(SpecError, match=r"negative large page counts \{'x': -1\}"):
        PageTable("vmm", 2048, (row,)).waste_fraction(large_pages={"x": -1})


# ------------------------------------------------------------------- properties


def brute_force_chunks(p, c, epsilon, max_chunks):
    """Reference: scan every k from one block's worth up to the cap."""
    lcm_k = math.lcm(p, c) // c
    cap = lcm_k if max_chunks is None else min(lcm_k, max_chunks)
    ks = range(-(-p // c), cap + 1)
    within = [k for k in ks if (k * c % p) <= epsilon * k * c]
    if within:
        return within[0], True
    return min(ks, key=lambda k: ((k * c % p) / (k * c), k)), False


@settings(max_examples=300, deadline=None)
@given(
    p=st.integers(1, 5000),
    c=st.integers(1, 512),
    epsilon=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.2]),
    max_chunks=st.one_of(st.none(), st.integers(1, 60)),
)
def test_chunks_for_page_matches_brute_force(p, c, epsilon, max_chunks):
    min_k = -(-p // c)
    if max_chunks is not None and max_chunks < min_k:
        with pytest.raises(SpecError, match=f"needs {min_k} chunks"):
            chunks_for_page(p, c, epsilon=epsilon, max_chunks=max_chunks)
        return
    assert chunks_for_page(p, c, epsilon=epsilon, max_chunks=max_chunks) == brute_force_chunks(
        p, c, epsilon, max_chunks
    )
