"""Encoder-side images (Llama 3.2 Vision / mllama): self attention stores only the text,
cross attention stores exactly the encoder tokens, all or nothing per image."""

import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, ImageSpan, InvalidSize, JengaAllocator
from jenga.specs import Kind


def mllama_like(total_units: int = 64) -> JengaAllocator:
    groups = (
        GroupConfig("self", Kind.FULL, 4, 4, 1),
        GroupConfig("cross", Kind.CROSS_ATTENTION, 4, 4, 1),
    )
    return JengaAllocator(AllocatorConfig(groups, total_units=total_units))


def test_encoder_span_occupies_one_prompt_position():
    image = ImageSpan(3, 100, 7, in_text=False)
    assert (image.end, ImageSpan(3, 100, 7).end) == (4, 103)


def test_self_attention_holds_text_and_cross_attention_the_whole_image_at_once():
    alloc = mllama_like()
    prompt = [9, 1, 2, 3, 4, 5, 6]  # placeholder at 0, then 6 text tokens
    image = ImageSpan(0, 10, 4242, in_text=False)  # 10 encoder tokens: 3 blocks of 4
    assert alloc.add_request("a", prompt, images=[image]) == 0
    got = alloc.allocate("a", 1)  # the placeholder: the whole image is needed now
    assert got is not None and got.new_blocks == ((0,), (0, 1, 2))
    got = alloc.allocate("a", 6)  # the text: only self attention grows
    assert got is not None and got.new_blocks == ((1,), ())
    assert alloc.usage().used_blocks == (2, 3)  # 7 text slots, not 17; 10 image tokens
    alloc.check_invariants(expensive=True)


def test_image_committed_and_hit_as_a_unit_keyed_by_its_hash():
    alloc = mllama_like()
    prompt = [9, *range(100, 111)]  # placeholder + 11 text tokens
    image = ImageSpan(0, 10, 4242, in_text=False)
    alloc.add_request("a", prompt, images=[image])
    alloc.allocate("a", len(prompt))
    assert alloc.cache("a", len(prompt)) == 3 + 3  # 3 self blocks (12 > 12 tokens: 3) + 3 image
    alloc.free("a")
    assert alloc.prefix_match(prompt, images=[image]).hit == 8  # capped below 12: 2 blocks
    other = ImageSpan(0, 10, 4343, in_text=False)
    assert alloc.prefix_match(prompt, images=[other]).hit == 0  # another image: nothing
    assert alloc.add_request("b", prompt, images=[image]) == 8
    assert (alloc.block_table("b", "self"), alloc.block_table("b", "cross")) == ([0, 1], [0, 1, 2])
    alloc.check_invariants(expensive=True)


def test_image_not_cached_before_its_placeholder_is_computed():
    alloc = mllama_like()
    prompt = [1, 2, 3, 4, 9, 5, 6, 7, 8]
    image = ImageSpan(4, 6, 11, in_text=False)  # after 4 text tokens
    alloc.add_request("a", prompt, images=[image])
    got = alloc.allocate("a", 4)
    assert got is not None and got.new_blocks == ((0,), ())  # before the image: text only
    got = alloc.allocate("a", 5)
    assert got is not None and got.new_blocks == ((1, 2), (0, 1))
    assert alloc.cache("a", 4) == 1  # self block 0; the placeholder (position 4) is not done
    assert alloc.cache("a", 5) == 2  # now the whole image, both blocks
    assert alloc.cache("a", 8) == 1  # self block 1
    assert alloc.usage().cached_blocks == (0, 0)  # committed, still owned by "a"
    assert alloc.stats()["prefix.queries"] == 1


def test_encoder_span_must_fit_its_placeholder_in_the_prompt():
    alloc = mllama_like()
    with pytest.raises(InvalidSize, match=r"\[5, 6\).*5-token prompt"):
        alloc.add_request("a", [1, 2, 3, 4, 5], images=[ImageSpan(5, 100, 1, in_text=False)])
