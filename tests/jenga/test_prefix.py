"""Prefix cache: chained hashes, extra keys, per-kind hits through the allocator."""

from __future__ import annotations

import numpy as np
from jenga.allocator import AllocatorConfig, GroupConfig, ImageSpan, JengaAllocator
from jenga.prefix import (
    HashChain,
    TokenBuffer,
    effective_tokens,
    image_block_hashes,
    root_hash,
)
from jenga.specs import Kind

from jenga import _core as J


def test_chained_hashes_name_the_whole_prefix():
    a = J.hash_blocks([1, 2, 3, 4, 5, 6], 2, 0).tolist()
    b = J.hash_blocks([9, 9, 3, 4, 5, 6], 2, 0).tolist()
    assert len(a) == 3 and len(set(a)) == 3
    assert a[0] != b[0] and a[1] != b[1]  # equal blocks after a different prefix differ
    assert J.hash_blocks([1, 2, 3, 4, 5, 6, 7], 2, 0).tolist() == a  # incomplete block not hashed
    assert J.hash_blocks([5, 6], 2, a[1]).tolist() == [a[2]]  # continuing a chain


def test_incremental_chain_equals_one_shot_and_salt_separates():
    tokens = list(range(1000, 1100))
    buf = TokenBuffer(tokens[:5])
    chain = HashChain(salt=0, tokens_per_block=8)
    for n in (3, 17, 17, 64, 99, 100):
        buf.extend(tokens[len(buf) : n])
        chain.extend(buf, n, ())
    oneshot = J.hash_blocks(np.asarray(tokens, dtype=np.int64), 8, root_hash(0, 8))
    assert chain.hashes.tolist() == oneshot.tolist() and len(oneshot) == 12
    salted = HashChain(salt=7, tokens_per_block=8)
    salted.extend(buf, 100, ())
    assert not set(salted.hashes.tolist()) & set(oneshot.tolist())


def test_image_tokens_hash_by_image_content():
    tokens = [5] * 10
    a = effective_tokens(tokens, 0, [ImageSpan(2, 4, 111)])
    b = effective_tokens(tokens, 0, [ImageSpan(2, 4, 222)])
    assert a.tolist()[:2] == [5, 5] and a.tolist()[6:] == [5] * 4
    assert a.tolist()[2:6] == [111, 112, 113, 114]
    assert b.tolist()[2:6] == [222, 223, 224, 225]
    assert effective_tokens(tokens[4:], 4, [ImageSpan(2, 4, 111)]).tolist()[:2] == [113, 114]
    assert image_block_hashes(111, 3, 2, 0) != image_block_hashes(222, 3, 2, 0)
    assert image_block_hashes(111, 3, 2, 0) != image_block_hashes(111, 3, 2, 1)


def _run(alloc: JengaAllocator, rid: str, prompt: list[int], **kw) -> None:
    alloc.add_request(rid, prompt, **kw)
    assert alloc.allocate(rid, len(prompt) - alloc.num_tokens(rid)) is not None
    alloc.cache(rid, len(prompt))
    alloc.free(rid)


def test_mamba_hits_only_at_checkpoints():
    groups = (
        GroupConfig("attn", Kind.FULL, 1, 8, 1),
        GroupConfig("mamba", Kind.MAMBA, 4, 2, 1),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, 16))
    prompt = list(range(10))
    alloc.add_request("a", prompt)
    got = alloc.allocate("a", 10)
    assert got is not None and got.new_blocks[1] == (0, 1, 2)  # states after 4, 8, live
    assert alloc.cache("a", 10) == 10 + 2  # checkpoints at 4 and 8
    got = alloc.allocate("a", 1)
    assert got is not None and got.released == ((), (0, 1))  # one live state stays
    assert alloc.block_table("a", "mamba") == [-1, -1, 2]
    alloc.free("a")
    assert alloc.match_prefix([*prompt, 99]) == 8
    assert alloc.match_prefix(prompt[:9]) == 8
    assert alloc.match_prefix(prompt[:8]) == 4  # 8 would leave nothing to compute
    assert alloc.match_prefix([0, 1, 2, 3, 7, 7, 7, 7, 7]) == 4
    assert alloc.add_request("b", [*prompt, 99]) == 8
    assert alloc.block_table("b", "mamba") == [-1, 1]  # the checkpoint after 8 tokens
    got = alloc.allocate("b", 3)
    assert got is not None and got.new_blocks[1] == (2,)  # the new live state, page 1 again
    alloc.check_invariants(expensive=True)


def test_cross_attention_image_shared_by_content_and_evicted_together():
    groups = (
        GroupConfig("self", Kind.FULL, 1, 16, 1),
        GroupConfig("cross", Kind.CROSS_ATTENTION, 2, 4, 1),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, 8))
    prompt = list(range(10))
    image = ImageSpan(2, 5, 111)
    _run(alloc, "a", prompt, images=[image])
    assert alloc.match_prefix(prompt, images=[image]) == 9
    assert alloc.match_prefix(prompt, images=[ImageSpan(2, 5, 222)]) == 2  # other image
    assert alloc.match_prefix(prompt) == 2  # same placeholders, no image: text differs
    order = alloc.eviction_order("cross")
    assert order == [0, 1, 2]  # one image: one prefix length (7), evicted as a run
    assert alloc.add_request("b", [*prompt, 5], images=[image]) == 10
    assert alloc.block_table("b", "cross") == [0, 1, 2]
    alloc.check_invariants(expensive=True)


def test_groups_with_equal_block_size_share_one_hash_chain_per_request():
    groups = (
        GroupConfig("full", Kind.FULL, 4, 4, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 4, 1, window=8),
        GroupConfig("draft", Kind.FULL, 4, 8, 1),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, 12))
    prompt = list(range(40))
    _run(alloc, "a", prompt)
    assert alloc.match_prefix(prompt) == 36
    assert alloc.stats()["prefix.hashes_committed"] == 30
    assert alloc.add_request("b", prompt) == 36
    assert alloc.block_table("b", "swa") == [-1] * 7 + [7, 8]
    assert alloc.block_table("b", "draft") == list(range(9))
    alloc.check_invariants(expensive=True)


def test_salt_isolates_tenants():
    alloc = JengaAllocator(AllocatorConfig((GroupConfig("f", Kind.FULL, 2, 4, 1),), 4))
    prompt = list(range(9))
    _run(alloc, "a", prompt, salt=1)
    assert alloc.match_prefix(prompt, salt=1) == 8
    assert alloc.match_prefix(prompt, salt=2) == 0
    assert alloc.match_prefix(prompt) == 0


def test_junction_is_the_longest_prefix_one_group_alone_caches():
    groups = (
        GroupConfig("attn", Kind.FULL, 4, 8, 1),
        GroupConfig("mamba", Kind.MAMBA, 4, 2, 1),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, 16, mamba_step_end_only=True))
    prompt = list(range(16))
    _run(alloc, "a", prompt)  # one chunk: the only Mamba state is the one after 16 tokens
    sibling = [*prompt[:8], 50, 51, 52, 53, 54]
    assert alloc.match_prefix_junction(sibling) == (0, 8)  # attention has 8, Mamba nothing
    assert alloc.match_prefix_junction([*prompt, 7]) == (16, 16)
    assert alloc.match_prefix_junction([99] * 9) == (0, 0)
    assert alloc.match_prefix_junction([]) == (0, 0)
    # the sibling's chunk ends at the junction: its state there is cached, the next hits 8
    alloc.add_request("b", sibling)
    assert alloc.allocate("b", 8) is not None
    alloc.cache("b", 8)
    assert alloc.match_prefix_junction([*prompt[:8], 60, 61, 62]) == (8, 8)
    alloc.check_invariants(expensive=True)


def test_release_skipped_frees_out_of_window_blocks_without_allocating():
    groups = (
        GroupConfig("full", Kind.FULL, 4, 4, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 4, 1, window=8),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, 16))
    alloc.add_request("a", list(range(20)))
    assert alloc.allocate("a", 20) is not None  # window at 20 reads 13..20: blocks 3, 4
    before = alloc.usage().used_blocks
    plan = alloc.release_skipped("a")
    assert alloc.block_table("a", "swa")[:3] == [-1, -1, -1]
    assert alloc.usage().used_blocks == (before[0], before[1] - 3)
    assert alloc.num_tokens("a") == 20 and not plan  # pages still hold live blocks
    assert not alloc.release_skipped("a")  # nothing left to release
    alloc.check_invariants(expensive=True)
