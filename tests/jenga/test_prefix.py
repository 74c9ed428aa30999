"""Prefix cache: chained hashes, extra keys, per-kind hits through the allocator."""

from __future__ import annotations

import hashlib
import hmac
import os

import numpy as np
import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, ImageSpan, InvalidInput, JengaAllocator
from jenga.prefix import (
    BlockIdentity,
    HashChain,
    TokenBuffer,
    image_block_hashes,
    root_hash,
)
from jenga.specs import Kind

from jenga import _core as J

ZERO = np.zeros(2, dtype=np.uint64)


def _ids(a: np.ndarray) -> list[tuple[int, int]]:
    return [tuple(int(w) for w in row) for row in a]


def test_chained_identities_name_the_whole_prefix():
    h = BlockIdentity().hasher()
    a = h.chain(np.array([1, 2, 3, 4, 5, 6]), 2, ZERO)
    b = h.chain(np.array([9, 9, 3, 4, 5, 6]), 2, ZERO)
    assert a.shape == (3, 2) and a.dtype == np.uint64 and len(set(_ids(a))) == 3
    assert _ids(a)[1] != _ids(b)[1] and _ids(a)[2] != _ids(b)[2]  # after another prefix
    assert _ids(h.chain(np.array([1, 2, 3, 4, 5, 6, 7]), 2, ZERO)) == _ids(a)  # incomplete
    assert _ids(h.chain(np.array([5, 6]), 2, a[1])) == [_ids(a)[2]]  # continuing a chain
    # the same tokens as 32-bit or 64-bit values give different messages, not a collision
    wide = h.chain(np.array([1, 2, 3, 4, 5, 2**32 + 6]), 2, ZERO)
    assert _ids(wide)[:2] == _ids(a)[:2] and _ids(wide)[2] != _ids(a)[2]


def test_identity_is_keyed_and_configurable():
    tokens = np.arange(64)
    keyed = [BlockIdentity().hasher().chain(tokens, 16, ZERO) for _ in range(2)]
    assert _ids(keyed[0]) != _ids(keyed[1])  # a random key per hasher (per allocator)
    fixed = [BlockIdentity(key=b"k" * 16).hasher().chain(tokens, 16, ZERO) for _ in range(2)]
    assert _ids(fixed[0]) == _ids(fixed[1])
    sha = BlockIdentity(algorithm="sha256", key=b"").hasher().chain(tokens, 16, ZERO)
    plain = BlockIdentity(key=b"").hasher().chain(tokens, 16, ZERO)
    assert _ids(sha) != _ids(plain) and len({*_ids(sha), *_ids(plain)}) == 8
    for bad in (
        {"algorithm": "md5"},
        {"key": "text"},
        {"key": b"x" * 65},
        {"short_key_bits": 65},
        {"short_key_bits": -1},
        {"short_key_bits": 8.0},
    ):
        with pytest.raises(InvalidInput):
            BlockIdentity(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [0, 1, 55, 56, 63, 64, 65, 111, 112, 127, 128, 129, 1000])
def test_digests_equal_hashlib_and_hmac(length: int):
    data = os.urandom(length)
    for key in (b"", b"k", os.urandom(32), os.urandom(64)):
        for size in (16, 32, 64):
            want = hashlib.blake2b(data, key=key, digest_size=size).digest()
            assert J.blake2b(data, key, size) == want
    assert J.sha256(data) == hashlib.sha256(data).digest()
    for key in (b"k", os.urandom(64), os.urandom(100)):
        assert J.sha256(data, key) == hmac.new(key, data, hashlib.sha256).digest()


def test_block_identity_is_the_documented_message():
    """Identity = the first 16 bytes of the digest of 0x01 | parent | width | tokens | extra."""
    key = os.urandom(32)
    parent = np.array([3, 4], dtype=np.uint64)
    head = b"\x01" + parent.astype("<u8").tobytes()
    for algo, ref in (
        ("blake2b", lambda m: hashlib.blake2b(m, key=key, digest_size=16).digest()),
        ("sha256", lambda m: hmac.new(key, m, hashlib.sha256).digest()[:16]),
    ):
        h = J.BlockHasher(algo, key)
        narrow = h.block(parent, np.array([7, 8]), b"xy")
        assert narrow.tobytes() == ref(head + b"\x04" + np.array([7, 8], "<u4").tobytes() + b"xy")
        wide = h.chain(np.array([7, 2**40]), 2, parent)[0]
        assert wide.tobytes() == ref(head + b"\x08" + np.array([7, 2**40], "<u8").tobytes())
        assert h.digest(b"abc").tobytes() == ref(b"\x00abc")


def test_incremental_chain_equals_one_shot_and_salt_separates():
    hasher = BlockIdentity().hasher()
    tokens = list(range(1000, 1100))
    buf = TokenBuffer(tokens[:5])
    chain = HashChain(hasher, salt=0, tokens_per_block=8)
    for n in (3, 17, 17, 64, 99, 100):
        buf.extend(tokens[len(buf) : n])
        chain.extend(buf, n, ())
    oneshot = hasher.chain(np.asarray(tokens, dtype=np.int64), 8, root_hash(hasher, 0, 8))
    assert _ids(chain.hashes) == _ids(oneshot) and len(oneshot) == 12
    salted = HashChain(hasher, salt=7, tokens_per_block=8)
    salted.extend(buf, 100, ())
    assert not set(_ids(salted.hashes)) & set(_ids(oneshot))
    big = HashChain(hasher, salt=2**200 + 7, tokens_per_block=8)  # salts are not cut to 64 bits
    big.extend(buf, 100, ())
    assert not set(_ids(big.hashes)) & set(_ids(salted.hashes))


def test_image_blocks_hash_by_the_whole_image_key():
    hasher = BlockIdentity().hasher()
    tokens = TokenBuffer([5] * 12)

    def chain(*images: ImageSpan) -> list[tuple[int, int]]:
        c = HashChain(hasher, 0, 4)
        c.extend(tokens, 12, images)
        return _ids(c.hashes)

    plain = chain()
    a = chain(ImageSpan(2, 4, 111))
    assert a[0] != plain[0] and a[1] != plain[1] and a[2] != plain[2]  # chained after
    assert chain(ImageSpan(2, 4, 222))[0] != a[0]
    assert chain(ImageSpan(3, 4, 111))[0] != a[0]  # the same image one position later
    # keys equal in their low 64 bits (the old int64 image key) still differ
    assert chain(ImageSpan(2, 4, 111 + 2**64))[0] != a[0]
    # incremental, across the image: the same as one shot
    c = HashChain(hasher, 0, 4)
    for n in (4, 8, 12):
        c.extend(tokens, n, (ImageSpan(2, 4, 111),))
    assert _ids(c.hashes) == a
    assert _ids(image_block_hashes(hasher, 111, 3, 2, 0)) != _ids(
        image_block_hashes(hasher, 222, 3, 2, 0)
    )
    assert _ids(image_block_hashes(hasher, 111, 3, 2, 0)) != _ids(
        image_block_hashes(hasher, 111, 3, 2, 1)
    )
    assert image_block_hashes(hasher, 111, 0, 2, 0).shape == (0, 2)


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
    assert alloc.prefix_match([*prompt, 99]).hit == 8
    assert alloc.prefix_match(prompt[:9]).hit == 8
    assert alloc.prefix_match(prompt[:8]).hit == 4  # 8 would leave nothing to compute
    assert alloc.prefix_match([0, 1, 2, 3, 7, 7, 7, 7, 7]).hit == 4
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
    assert alloc.prefix_match(prompt, images=[image]).hit == 9
    assert alloc.prefix_match(prompt, images=[ImageSpan(2, 5, 222)]).hit == 2  # other image
    assert alloc.prefix_match(prompt).hit == 2  # same placeholders, no image: text differs
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
    assert alloc.prefix_match(prompt).hit == 36
    assert alloc.stats()["prefix.hashes_committed"] == 30
    assert alloc.add_request("b", prompt) == 36
    assert alloc.block_table("b", "swa") == [-1] * 7 + [7, 8]
    assert alloc.block_table("b", "draft") == list(range(9))
    alloc.check_invariants(expensive=True)


def test_salt_isolates_tenants():
    alloc = JengaAllocator(AllocatorConfig((GroupConfig("f", Kind.FULL, 2, 4, 1),), 4))
    prompt = list(range(9))
    _run(alloc, "a", prompt, salt=1)
    assert alloc.prefix_match(prompt, salt=1).hit == 8
    assert alloc.prefix_match(prompt, salt=2).hit == 0
    assert alloc.prefix_match(prompt).hit == 0


def test_junction_is_the_longest_prefix_one_group_alone_caches():
    groups = (
        GroupConfig("attn", Kind.FULL, 4, 8, 1),
        GroupConfig("mamba", Kind.MAMBA, 4, 2, 1),
    )
    alloc = JengaAllocator(AllocatorConfig(groups, 16, mamba_step_end_only=True))
    prompt = list(range(16))
    _run(alloc, "a", prompt)  # one chunk: the only Mamba state is the one after 16 tokens
    sibling = [*prompt[:8], 50, 51, 52, 53, 54]
    assert _hit_junction(alloc, sibling) == (0, 8)  # attention has 8, Mamba nothing
    assert _hit_junction(alloc, [*prompt, 7]) == (16, 16)
    assert _hit_junction(alloc, [99] * 9) == (0, 0)
    assert _hit_junction(alloc, []) == (0, 0)
    # the sibling's chunk ends at the junction: its state there is cached, the next hits 8
    alloc.add_request("b", sibling)
    assert alloc.allocate("b", 8) is not None
    alloc.cache("b", 8)
    assert _hit_junction(alloc, [*prompt[:8], 60, 61, 62]) == (8, 8)
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


def _hit_junction(alloc: JengaAllocator, prompt: list[int]) -> tuple[int, int]:
    match = alloc.prefix_match(prompt)
    return match.hit, match.junction
