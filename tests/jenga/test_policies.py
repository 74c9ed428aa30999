"""Per-kind policies: needed blocks, released blocks, prefix lengths, possible prefixes."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jenga.allocator import ImageSpan
from jenga.policies import (
    POLICY_BY_KIND,
    ChunkedLocalPolicy,
    CrossAttentionPolicy,
    FullAttentionPolicy,
    MambaPolicy,
    SlidingWindowPolicy,
    VisionEmbeddingPolicy,
    make_policy,
    policy_for,
)
from jenga.specs import Kind, SpecError


def test_dispatch_table_has_one_class_per_kind():
    assert set(POLICY_BY_KIND) == set(Kind)
    assert all(cls.kind is kind for kind, cls in POLICY_BY_KIND.items())
    assert isinstance(make_policy(Kind.SLIDING_WINDOW, 16, window=4096), SlidingWindowPolicy)
    with pytest.raises(SpecError, match="needs a window"):
        make_policy(Kind.SLIDING_WINDOW, 16)
    with pytest.raises(SpecError, match="needs a chunk"):
        make_policy(Kind.CHUNKED_LOCAL, 16)


def test_full_attention_keeps_everything():
    p = FullAttentionPolicy(16)
    assert [p.num_blocks(n) for n in (0, 1, 16, 17, 1000)] == [0, 1, 1, 2, 63]
    assert p.first_live_block(10_000) == 0
    assert p.active_blocks(40) == range(0, 3)
    assert p.prefix_length(2) == 48
    assert p.possible_prefix([True, True, False, True]) == {16, 32}
    assert p.hit_blocks(32) == range(0, 2)


def test_pyramid_fraction_allocates_less_and_serves_no_hit():
    p = FullAttentionPolicy(16, token_fraction=(1, 4))
    assert p.num_blocks(1000) == 16  # ceil(250 / 16)
    assert p.possible_prefix([True] * 8) == set()
    with pytest.raises(SpecError, match="0 < num <= den, got 3/2"):
        FullAttentionPolicy(16, token_fraction=(3, 2))


def test_sliding_window_releases_blocks_that_left_the_window():
    p = SlidingWindowPolicy(16, window=64)
    # position 100 reads [37, 100]: block 2 (32..47) is the first still read
    assert p.first_live_block(100) == 2
    assert p.first_live_block(63) == 0
    assert p.first_live_block(64) == 0  # reads [1, 64]
    assert p.first_live_block(81) == 1  # reads [18, 81]
    assert p.active_blocks(100) == range(2, 7)
    assert p.hit_blocks(96) == range(2, 6)


def test_chunked_local_keeps_the_current_chunk():
    p = ChunkedLocalPolicy(4, chunk=16)
    assert [p.first_live_block(n) for n in (0, 15, 16, 17, 40)] == [0, 0, 4, 4, 8]
    # every chunk boundary is a valid prefix without any cached block
    hits = [False] * 4 + [True, True] + [False] * 2
    assert p.possible_prefix(hits) == {16, 20, 24, 32}


def test_mamba_keeps_one_live_state_and_hits_only_at_checkpoints():
    p = MambaPolicy(512)
    assert [p.num_blocks(n) for n in (1, 512, 513, 1500)] == [1, 1, 2, 3]
    # while computing from position 1500 the live state is block 2 (states after 1024 .. )
    assert p.first_live_block(1500) == 2
    assert p.first_live_block(1024) == 1  # at a boundary: the checkpoint is the source
    assert p.possible_prefix([False, True, False]) == {1024}
    assert p.hit_blocks(1024) == range(1, 2)
    assert p.prefix_length(1) == 1024


IMAGES = (ImageSpan(2, 5, 111), ImageSpan(10, 3, 222))  # blocks of 2: image 0 -> 3, image 1 -> 2


def test_cross_attention_images_all_or_nothing():
    p = CrossAttentionPolicy(2)
    assert p.image_ranges(IMAGES) == [range(0, 3), range(3, 5)]
    assert [p.num_blocks(n, IMAGES) for n in (2, 3, 10, 11, 20)] == [0, 3, 3, 5, 5]
    assert p.first_live_block(20, IMAGES) == 0
    assert [p.prefix_length(b, IMAGES) for b in range(5)] == [7, 7, 7, 13, 13]
    # image 0 cached, image 1 only half: positions up to 10 valid, after 10 not
    valid = p.possible_prefix([True, True, True, True, False], 15, IMAGES)
    assert valid == set(range(1, 11))
    assert p.possible_prefix([True, False, True, True, True], 15, IMAGES) == {1, 2}


def test_vision_embeddings_needed_only_while_the_image_is_prefilled():
    p = VisionEmbeddingPolicy(2)
    assert [p.first_live_block(n, IMAGES) for n in (0, 6, 7, 12, 13)] == [0, 0, 3, 3, 5]
    # image 1 missing: a prefix may not end inside it (11, 12), but may end after it
    valid = p.possible_prefix([True, True, True, False, False], 15, IMAGES)
    assert valid == set(range(1, 16)) - {11, 12}
    assert p.hit_blocks(4, IMAGES) == range(0, 3)
    assert p.hit_blocks(8, IMAGES) == range(0)


POLICIES = [
    FullAttentionPolicy(2),
    FullAttentionPolicy(2, token_fraction=(1, 2)),
    SlidingWindowPolicy(2, window=5),
    ChunkedLocalPolicy(2, chunk=6),
    MambaPolicy(4),
    CrossAttentionPolicy(2),
    VisionEmbeddingPolicy(2),
]


@settings(max_examples=300, deadline=None)
@given(
    which=st.integers(0, len(POLICIES) - 1),
    hits=st.lists(st.booleans(), max_size=14),
    num_tokens=st.integers(1, 28),
)
def test_vectorized_mask_agrees_with_possible_prefix(which: int, hits: list[bool], num_tokens: int):
    policy = POLICIES[which]
    step = 4  # a multiple of every policy's block size above
    images = IMAGES if policy.reads_images else ()
    if policy.reads_images:
        num_tokens = max(num_tokens, 13)
        hits = (hits + [True] * 5)[:5]
    mask = policy.valid_prefix_mask(np.array(hits, dtype=bool), step, num_tokens, images)
    from_mask = {step * (i + 1) for i in np.flatnonzero(mask)}
    from_set = {p for p in policy.possible_prefix(hits, num_tokens, images) if p % step == 0}
    if not policy.reads_images:
        from_mask = {p for p in from_mask if p <= len(hits) * policy.tokens_per_block}
    assert from_mask == {p for p in from_set if p <= num_tokens}


def test_kept_tokens_per_kind():
    assert [FullAttentionPolicy(16).kept_tokens(n) for n in (0, 1, 100)] == [0, 1, 100]
    assert [FullAttentionPolicy(16, (1, 4)).kept_tokens(n) for n in (1, 4, 5)] == [1, 1, 2]
    assert [SlidingWindowPolicy(16, window=64).kept_tokens(n) for n in (0, 63, 64, 65, 1000)] == [
        0,
        63,
        64,
        64,
        64,
    ]
    assert [ChunkedLocalPolicy(4, chunk=16).kept_tokens(n) for n in (0, 1, 16, 17, 40)] == [
        0,
        1,
        16,
        1,
        8,
    ]
    assert MambaPolicy(512).kept_tokens(1000) == 0
    assert CrossAttentionPolicy(2).kept_tokens(13) == 13


TOKEN_RANGES = [  # kinds whose kept tokens are a range (not a state, not a score-picked share)
    FullAttentionPolicy(2),
    SlidingWindowPolicy(2, window=5),
    ChunkedLocalPolicy(2, chunk=6),
    CrossAttentionPolicy(2),
]


@pytest.mark.parametrize("policy", TOKEN_RANGES, ids=repr)
def test_first_live_block_is_the_start_of_what_the_next_token_reads(policy):
    # one rule per kind: the next token (position L) reads the tokens kept at L + 1
    for length in range(40):
        start = length + 1 - policy.kept_tokens(length + 1)
        assert start == policy.attended_start(length)
        assert policy.first_live_block(length) == start // policy.tokens_per_block


def test_policy_for_reads_the_spec():
    from jenga.specs import LayerSpec

    window = policy_for(LayerSpec(Kind.SLIDING_WINDOW, 1, 8, block_size=4, window=32))
    assert window == SlidingWindowPolicy(4, window=32)
    mamba = LayerSpec(Kind.MAMBA, state_bytes=64, checkpoint_interval=256)
    assert policy_for(mamba, step_end_only=True) == MambaPolicy(256, step_end_only=True)
    traits = {
        kind: (cls.releases_early, cls.holds_state, cls.reads_images, cls.prefill_only)
        for kind, cls in POLICY_BY_KIND.items()
    }
    assert traits == {
        Kind.FULL: (False, False, False, False),
        Kind.SLIDING_WINDOW: (True, False, False, False),
        Kind.CHUNKED_LOCAL: (True, False, False, False),
        Kind.MAMBA: (False, True, False, False),
        Kind.CROSS_ATTENTION: (False, False, True, False),
        Kind.VISION_EMBEDDING: (False, False, True, True),
        Kind.MLA: (False, False, False, False),
        Kind.SLIDING_WINDOW_MLA: (True, False, False, False),
        Kind.SINK_FULL: (False, False, False, False),
        Kind.REPLAY_SLIDING_WINDOW_MLA: (True, False, False, False),
        Kind.CIRCULAR_BUFFER: (False, False, False, False),
        Kind.COMPRESSED_MLA: (False, False, False, False),
    }


def test_make_policy_rejects_a_parameter_no_policy_has():
    with pytest.raises(TypeError, match=r"no policy takes \['windw'\]"):
        make_policy(Kind.SLIDING_WINDOW, 16, windw=4096)
    # another kind's parameter is ignored: one call builds every group's policy
    assert make_policy(Kind.FULL, 16, window=4096, chunk=8) == FullAttentionPolicy(16)


@pytest.mark.parametrize(
    "policy",
    [
        FullAttentionPolicy(16),
        FullAttentionPolicy(16, token_fraction=(1, 2)),
        make_policy(Kind.SLIDING_WINDOW, 16, window=64),
        make_policy(Kind.SLIDING_WINDOW, 16, window=7),
        make_policy(Kind.SLIDING_WINDOW, 8, window=100),
        make_policy(Kind.CHUNKED_LOCAL, 16, chunk=48),
        make_policy(Kind.CHUNKED_LOCAL, 16, chunk=8),
        make_policy(Kind.MAMBA, 16),
        make_policy(Kind.MAMBA, 16, step_end_only=True),
    ],
    ids=repr,
)
def test_length_limits_agree_with_the_block_functions(policy):
    """The closed forms the allocate fast path uses are exactly the largest lengths whose
    `num_blocks` / `first_live_block` stay within a bound (None: the caller searches)."""
    for n in range(12):
        held = policy.last_length_held(n)
        if held is None:
            assert policy.token_fraction != (1, 1)
            continue
        assert policy.num_blocks(held) <= n < policy.num_blocks(held + 1)
    for first in range(12):
        limit = policy.last_length_first_live(first)
        assert limit is not None
        if limit == sys.maxsize:
            assert all(policy.first_live_block(length) == 0 for length in range(2000))
            continue
        assert policy.first_live_block(limit) <= first < policy.first_live_block(limit + 1)
