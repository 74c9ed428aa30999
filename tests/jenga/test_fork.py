"""Forked requests share their parent's blocks; the block the next token writes into is
copied on write, once per holder but the last (jenga.fork)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from jenga.allocator import NULL_BLOCK, AllocatorConfig, GroupConfig, JengaAllocator
from jenga.errors import DoubleFree, DuplicateRequest, InvalidSize, UnknownRequest
from jenga.requests import BlockCopy
from jenga.specs import Kind

FULL = (GroupConfig("full", Kind.FULL, 4, 4, 1),)
HYBRID = (
    GroupConfig("attn", Kind.FULL, 16, 4, 1),
    GroupConfig("mamba", Kind.MAMBA, 16, 1, 1),
)


def refcount(alloc: JengaAllocator, group: int, block: int) -> int:
    return int(alloc._core.block_info(group, block)[1])


def test_children_share_every_block_and_copy_the_partial_one_on_write():
    alloc = JengaAllocator(AllocatorConfig(FULL, 64))
    alloc.add_request("p", list(range(10)))
    assert alloc.allocate("p", 10) is not None
    b0, b1, b2 = alloc.block_table("p", 0)
    alloc.fork("p", ["c1", "c2", "c3"])
    assert alloc.usage().used_blocks == (3,)  # nothing new
    assert [refcount(alloc, 0, b) for b in (b0, b1, b2)] == [4, 4, 4]
    alloc.check_invariants(expensive=True)
    dsts = []
    for k, cid in enumerate(("c1", "c2", "c3")):
        got = alloc.allocate(cid, 1)
        assert got is not None and got.new_blocks == ((),) and got.num_tokens == 11
        (copy,) = got.copies
        assert (copy.group, copy.index, copy.src) == (0, 2, b2)
        assert alloc.block_table(cid, 0) == [b0, b1, copy.dst]
        assert refcount(alloc, 0, b2) == 3 - k
        dsts.append(copy.dst)
        alloc.check_invariants(expensive=True)
    assert len({b2, *dsts}) == 4
    got = alloc.allocate("p", 1)  # the last holder writes its block in place
    assert got is not None and got.copies == () and alloc.block_table("p", 0) == [b0, b1, b2]
    assert alloc.usage().used_blocks == (6,)
    got = alloc.allocate("c1", 2)  # a later block is a new block, no copy
    assert got is not None and got.copies == () and len(got.new_blocks[0]) == 1
    for rid in ("c1", "p", "c2"):
        alloc.free(rid)
        alloc.check_invariants(expensive=True)
    assert [refcount(alloc, 0, b) for b in (b0, b1)] == [1, 1]
    alloc.free("c3")
    assert alloc.usage().used_blocks == (0,)
    alloc.check_invariants(expensive=True)


def test_a_fork_at_a_block_boundary_copies_nothing():
    alloc = JengaAllocator(AllocatorConfig(FULL, 64))
    alloc.add_request("p", list(range(8)))
    assert alloc.allocate("p", 8) is not None
    alloc.fork("p", ["c"])
    for rid in ("c", "p"):
        got = alloc.allocate(rid, 3)
        assert got is not None and got.copies == () and len(got.new_blocks[0]) == 1
    assert alloc.block_table("c", 0)[:2] == alloc.block_table("p", 0)[:2]
    assert alloc.block_table("c", 0)[2] != alloc.block_table("p", 0)[2]
    alloc.check_invariants(expensive=True)


def test_mamba_state_is_copied_once_per_child_attention_its_partial_block():
    alloc = JengaAllocator(AllocatorConfig(HYBRID, 256))
    alloc.add_request("p", list(range(40)))
    assert alloc.allocate("p", 40) is not None
    state = alloc.block_table("p", "mamba")[2]  # the live state (after 32, up to 48)
    attn_tail = alloc.block_table("p", "attn")[2]  # 8 of 16 tokens
    alloc.fork("p", ["a", "b"])
    assert refcount(alloc, 1, state) == 3
    for cid in ("a", "b"):
        got = alloc.allocate(cid, 1)
        assert got is not None
        assert [(c.group, c.index, c.src) for c in got.copies] == [(0, 2, attn_tail), (1, 2, state)]
        assert alloc.block_table(cid, "mamba")[2] == got.copies[1].dst
    got = alloc.allocate("p", 1)
    assert got is not None and got.copies == ()
    assert alloc.usage().used_blocks == (2 + 3, 3)  # 2 shared blocks; one state per sequence
    alloc.check_invariants(expensive=True)


def test_at_a_checkpoint_the_state_is_only_read_and_stays_shared():
    alloc = JengaAllocator(AllocatorConfig(HYBRID, 256))
    alloc.add_request("p", list(range(48)))
    assert alloc.allocate("p", 48) is not None
    checkpoint = alloc.block_table("p", "mamba")[2]
    alloc.fork("p", ["a"])
    for rid in ("a", "p"):
        got = alloc.allocate(rid, 1)
        assert got is not None and got.copies == ()
        assert [len(b) for b in got.new_blocks] == [1, 1]
    assert refcount(alloc, 1, checkpoint) == 2  # each next step reads it, none writes it
    alloc.check_invariants(expensive=True)


def test_a_refused_allocate_keeps_the_copy_pending_and_changes_nothing():
    alloc = JengaAllocator(AllocatorConfig((GroupConfig("full", Kind.FULL, 4, 1, 1),), 3))
    alloc.add_request("p", list(range(10)))
    assert alloc.allocate("p", 10) is not None
    table = alloc.block_table("p", 0)
    alloc.fork("p", ["c"])
    before = alloc.usage()
    assert alloc.allocate("c", 1) is None  # no room for the copy
    assert alloc.usage() == before and alloc.block_table("c", 0) == table
    assert refcount(alloc, 0, table[2]) == 2
    alloc.check_invariants(expensive=True)
    alloc.free("p")  # the child is the last holder now: it writes in place
    got = alloc.allocate("c", 1)
    assert got is not None and got.copies == () and alloc.block_table("c", 0) == table
    alloc.check_invariants(expensive=True)


def test_children_hash_their_own_tokens_and_share_the_cached_prompt():
    alloc = JengaAllocator(AllocatorConfig(FULL, 64))
    prompt = list(range(100, 110))
    alloc.add_request("p", prompt)
    assert alloc.allocate("p", 10) is not None
    alloc.append_tokens("p", [])
    assert alloc.cache("p", 10) == 2
    alloc.fork("p", ["c1", "c2"])
    for cid, tok in (("c1", 7), ("c2", 8)):
        assert alloc.allocate(cid, 6) is not None
        alloc.append_tokens(cid, [tok] * 6)
        assert alloc.cache(cid, 16) == 2  # its two own blocks; the shared two stay
    for rid in ("p", "c1", "c2"):
        alloc.free(rid)
    assert alloc.prefix_match([*prompt, *[7] * 6, 0]).hit == 16
    assert alloc.prefix_match([*prompt, *[8] * 6, 0]).hit == 16
    assert alloc.prefix_match([*prompt, *[9] * 6, 0]).hit == 8
    alloc.check_invariants(expensive=True)


def test_bad_forks_are_refused_with_nothing_changed():
    alloc = JengaAllocator(AllocatorConfig(FULL, 64))
    alloc.add_request("p", list(range(10)))
    assert alloc.allocate("p", 10) is not None
    alloc.add_request("q", list(range(5)))
    before = (alloc.usage(), alloc.stats()["requests.live"])
    with pytest.raises(InvalidSize, match="needs k > 0 child ids, got 0"):
        alloc.fork("p", [])
    with pytest.raises(UnknownRequest, match="unknown request 'x'"):
        alloc.fork("x", ["c"])
    with pytest.raises(DuplicateRequest, match="child id 'c' \\(#1 of 2\\) is repeated"):
        alloc.fork("p", ["c", "c"])
    with pytest.raises(DuplicateRequest, match="child id 'q' \\(#1 of 2\\) is already live"):
        alloc.fork("p", ["c", "q"])
    with pytest.raises(DuplicateRequest, match="child id 'p' \\(#0 of 1\\) is already live"):
        alloc.fork("p", ["p"])
    assert (alloc.usage(), alloc.stats()["requests.live"]) == before
    assert alloc.allocate("p", 1) is not None and alloc.allocate("p", 1).copies == ()
    alloc.free("q")
    with pytest.raises(DoubleFree):
        alloc.fork("q", ["c"])
    alloc.check_invariants(expensive=True)


WINDOWED = (
    GroupConfig("full", Kind.FULL, 4, 4, 1),
    GroupConfig("swa", Kind.SLIDING_WINDOW, 4, 4, 1, window=8),
    GroupConfig("mamba", Kind.MAMBA, 8, 2, 1),
)


def test_random_forks_keep_every_sequence_reading_its_own_tokens():
    """Simulated block contents: every allocate performs its copies, then writes the
    sequence's new tokens through its table; each live sequence must read back its own
    tokens in every attention group's live blocks, and its own last token in its Mamba
    state, and the refcounts must match the tables after every call."""
    rng = random.Random(7)
    alloc = JengaAllocator(AllocatorConfig(WINDOWED, 400))
    memory: dict[tuple[int, int], np.ndarray] = {}
    seqs: dict[str, list[int]] = {}
    names = iter(f"r{i}" for i in range(10_000))
    for _ in range(400):
        op = rng.random()
        if not seqs or (op < 0.1 and len(seqs) < 12):
            rid = next(names)
            alloc.add_request(rid, [1], use_cache=False)
            seqs[rid] = []
        elif op < 0.25 and len(seqs) < 12:
            parent = rng.choice(sorted(seqs))
            kids = [next(names) for _ in range(rng.randint(1, 3))]
            alloc.fork(parent, kids)
            for kid in kids:
                seqs[kid] = list(seqs[parent])
        elif op < 0.35:
            rid = rng.choice(sorted(seqs))
            alloc.free(rid)
            del seqs[rid]
        else:
            rid = rng.choice(sorted(seqs))
            _grow(alloc, memory, rid, seqs[rid], rng.randint(1, 6), rng)
        alloc.check_invariants(expensive=True)
        for rid, toks in seqs.items():
            _check_reads(alloc, memory, rid, toks)


def _grow(alloc, memory, rid, toks, n, rng) -> None:
    got = alloc.allocate(rid, n)
    if got is None:
        return
    for g, blocks in enumerate(got.new_blocks):
        for b in blocks:
            memory[(g, b)] = np.full(8, -1)  # a fresh block holds garbage
    for c in got.copies:
        assert c.src != c.dst and isinstance(c, BlockCopy)
        memory[(c.group, c.dst)] = memory[(c.group, c.src)].copy()
    start = len(toks)
    for pos in range(start, start + n):
        toks.append(rng.randint(0, 9))
        for g in (0, 1):
            b = alloc.block_table(rid, g)[pos // 4]
            memory[(g, b)][pos % 4] = toks[pos]
        state = alloc.block_table(rid, 2)[pos // 8]
        memory[(2, state)][0] = toks[pos]  # the state after `pos`: its last token


def _check_reads(alloc, memory, rid, toks) -> None:
    n = len(toks)
    for g in (0, 1):
        table = alloc.block_table(rid, g)
        for pos in range(n):
            b = table[pos // 4]
            if b != NULL_BLOCK:
                assert memory[(g, b)][pos % 4] == toks[pos], (rid, g, pos)
    if n:
        state = alloc.block_table(rid, 2)[(n - 1) // 8]
        assert memory[(2, state)][0] == toks[-1], (rid, "state")
