"""Block identity: a collision of the core's short (64-bit) index key is detected, never served.

The core keys its hash index by the low bits of a 128-bit identity and keeps the whole
identity in the block. Two identities equal in their short key are forced here, in the
core directly (crafted words) and through the allocator (`BlockIdentity.short_key_bits`
below 64, so most blocks collide); every hit must still be a block with the whole
identity of the prompt's block, i.e. the same prefix.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from jenga.allocator import AllocatorConfig, GroupConfig, JengaAllocator
from jenga.prefix import BlockIdentity
from jenga.specs import Kind

from jenga import _core as J


def _ids(*pairs: tuple[int, int]) -> np.ndarray:
    return np.array(pairs, dtype=np.uint64).reshape(-1, 2)


def test_core_refuses_a_hit_whose_short_key_collides():
    core = J.Core([4], [1], 2)
    got = core.allocate(0, [3], 1)
    assert got is not None
    a, b, c = (int(x) for x in got[0])
    assert core.commit(0, [a], _ids((5, 1)), [1]) == 1
    # same low word (the short key), another high word: left out of the index, counted
    assert core.commit_run(0, np.array([b], dtype=np.int32), _ids((5, 2)), 2, 1) == 0
    assert core.commit(0, [c], _ids((5, 1)), [3]) == 0  # a duplicate, not a collision
    assert core.counters()["prefix.identity_collisions"] == 1
    assert core.lookup(0, _ids((5, 1), (5, 2), (6, 1))).tolist() == [a, -1, -1]
    assert core.counters()["prefix.identity_mismatches"] == 1
    core.release(0, [a, b, c], 2)  # a is cached, b and c free
    assert core.lookup(0, _ids((5, 2))).tolist() == [-1]
    assert core.lookup(0, _ids((5, 1))).tolist() == [a]
    core.check_invariants(True)
    # once a leaves the index (its page is evicted), the other identity may enter
    assert core.evict_cached_pages(1) == 1
    core.drain_plan()
    got = core.allocate(1, [1], 3)
    assert got is not None
    assert core.commit(0, [int(got[0][0])], _ids((5, 2)), [1]) == 1
    assert core.lookup(0, _ids((5, 1), (5, 2))).tolist() == [-1, int(got[0][0])]
    core.check_invariants(True)


def test_core_short_key_bits_hook_and_shapes():
    core = J.Core([4], [1], 1, short_key_bits=0)  # every identity has short key 0
    got = core.allocate(0, [2], 1)
    assert got is not None
    a, b = (int(x) for x in got[0])
    assert core.commit(0, [a, b], _ids((1, 0), (2, 0)), [1, 2]) == 1
    assert core.lookup(0, _ids((1, 0), (2, 0))).tolist() == [a, -1]
    counters = core.counters()
    assert counters["prefix.identity_collisions"] == 1
    assert counters["prefix.identity_mismatches"] == 1
    with pytest.raises(ValueError, match=r"shape \(n, 2\).*got \(4, 3\)"):
        core.lookup(0, np.zeros((4, 3), dtype=np.uint64))
    assert core.lookup(0, [1, 2]).tolist() == [a, -1]  # 1-D: the identities (v, 0)
    with pytest.raises(ValueError, match=r"short_key_bits must be in \[0, 64\], got 65"):
        J.Core([4], [1], 1, short_key_bits=65)


def _allocator(bits: int, algorithm: str = "blake2b") -> JengaAllocator:
    groups = (
        GroupConfig("full", Kind.FULL, 2, 4, 1),
        GroupConfig("swa", Kind.SLIDING_WINDOW, 2, 4, 1, window=4),
    )
    identity = BlockIdentity(algorithm=algorithm, short_key_bits=bits)
    return JengaAllocator(AllocatorConfig(groups, 64, identity=identity))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("bits", [0, 1, 3])
def test_allocator_never_serves_a_short_key_collision(bits: int):
    """With 0-3 short-key bits nearly every committed block collides with another prompt's
    in the index; a hit is still never longer than a prefix some cached prompt shares."""
    rng = random.Random(bits)
    alloc = _allocator(bits)
    cached: list[list[int]] = []
    stems = [[rng.randrange(4) for _ in range(6)] for _ in range(3)]
    for i in range(60):
        prompt = rng.choice(stems)[: rng.randrange(7)] + [rng.randrange(4) for _ in range(8)]
        hit = alloc.prefix_match(prompt).hit
        true = max((_common_prefix(prompt, c) for c in cached), default=0)
        assert hit <= true, (i, prompt, hit, true)
        rid = f"r{i}"
        assert alloc.add_request(rid, prompt) == hit
        if alloc.allocate(rid, len(prompt) - hit) is None:
            alloc.free(rid)
            continue
        alloc.cache(rid, len(prompt))
        alloc.free(rid)
        cached.append(prompt)
        alloc.check_invariants(expensive=True)
    stats = alloc.stats()
    assert stats["prefix.identity_collisions"] > 0
    assert stats["prefix.identity_mismatches"] > 0


@pytest.mark.parametrize("algorithm", ["blake2b", "sha256"])
def test_allocator_with_full_short_keys_hits_as_before(algorithm: str):
    alloc = _allocator(64, algorithm)
    prompt = list(range(9))
    alloc.add_request("a", prompt)
    assert alloc.allocate("a", 9) is not None
    alloc.cache("a", 9)
    alloc.free("a")
    assert alloc.prefix_match(prompt).hit == 8
    assert alloc.prefix_match([*prompt[:4], 99, 99, 99]).hit == 4
    stats = alloc.stats()
    assert stats["prefix.identity_collisions"] == stats["prefix.identity_mismatches"] == 0


# -- blocks named by the caller's digests (BlockIdentity.digest_block_size) ---------------
def _digest_chain(tokens: list[int], size: int, salt: bytes = b"") -> list[bytes]:
    """A caller's chained 32-byte digests, one per ``size`` tokens (as vLLM's)."""
    import hashlib

    out: list[bytes] = []
    parent = salt
    for i in range(len(tokens) // size):
        parent = hashlib.sha256(parent + repr(tokens[i * size : (i + 1) * size]).encode()).digest()
        out.append(parent)
    return out


def _digest_allocator(bits: int = 64) -> JengaAllocator:
    groups = (  # 2-token blocks: one digest each; 4-token blocks: the second of two
        GroupConfig("full", Kind.FULL, 2, 4, 1),
        GroupConfig("wide", Kind.FULL, 4, 4, 1),
    )
    identity = BlockIdentity(short_key_bits=bits, digest_block_size=2)
    return JengaAllocator(AllocatorConfig(groups, 64, identity=identity))


def test_caller_digests_name_blocks_and_hits_stop_where_they_end() -> None:
    alloc = _digest_allocator()
    prompt = list(range(17))
    digests = _digest_chain(prompt, 2)
    assert alloc.add_request("a", prompt, digests=digests) == 0
    assert alloc.allocate("a", 17) is not None
    assert alloc.cache("a", 17) == 8 + 4
    assert alloc.prefix_match(prompt, digests=digests).hit == 16
    assert alloc.prefix_match(prompt, digests=digests[:5]).hit == 8  # wide: 2 blocks named
    assert alloc.prefix_match(prompt, digests=digests[:3]).hit == 4
    forged = list(digests)
    forged[5] = bytes(32)  # never committed: the hit stops before it
    assert alloc.prefix_match(prompt, digests=forged).hit == 8
    salted = _digest_chain(prompt, 2, salt=b"lora-1")  # same tokens, another identity
    assert alloc.prefix_match(prompt, digests=salted).hit == 0
    assert alloc.prefix_match(prompt).hit == 0  # no digests: nothing named
    alloc.check_invariants(True)


def test_caller_digests_colliding_in_the_short_key_are_never_served() -> None:
    alloc = _digest_allocator(bits=0)  # every identity has short key 0
    prompt = list(range(9))
    alloc.add_request("a", prompt, digests=_digest_chain(prompt, 2))
    assert alloc.allocate("a", 9) is not None
    assert alloc.cache("a", 8) == 2  # one block per group: the rest collide in the index
    before = alloc.stats()["prefix.identity_mismatches"]
    assert alloc.prefix_match(prompt, digests=_digest_chain(prompt, 2, salt=b"x")).hit == 0
    assert alloc.stats()["prefix.identity_mismatches"] >= before + 2  # found, refused


def test_caller_digests_commit_only_blocks_whose_digest_exists() -> None:
    alloc = _digest_allocator()
    prompt = list(range(12))
    digests: list[bytes] = []  # the caller's list, filled later (vLLM appends in place)
    alloc.add_request("a", prompt, digests=digests)
    assert alloc.allocate("a", 12) is not None
    assert alloc.cache("a", 12) == 0
    digests.extend(_digest_chain(prompt, 2)[:3])
    assert alloc.cache("a", 12) == 3 + 1  # 3 small blocks, 1 wide one
    assert alloc.cache("a", 12, digests=_digest_chain(prompt, 2)) == 3 + 2
    assert alloc.prefix_match([*prompt, 0], digests=_digest_chain(prompt, 2)).hit == 12
    alloc.check_invariants(True)


def test_caller_digests_are_checked() -> None:
    from jenga.errors import InvalidInput

    with pytest.raises(InvalidInput, match="digests given, but this allocator hashes"):
        _allocator(64).add_request("a", [1, 2, 3], digests=[bytes(32)])
    with pytest.raises(InvalidInput, match="at least 16 bytes, got one of 8"):
        _digest_allocator().prefix_match([1, 2, 3], digests=[bytes(8)])
    with pytest.raises(InvalidInput, match="digest_block_size must be a positive int"):
        BlockIdentity(digest_block_size=0)
