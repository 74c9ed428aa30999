"""Mamba state counts per call: a long step holds the states it needs, not one per block."""

from __future__ import annotations

import pytest
from jenga.allocator import NULL_BLOCK, AllocatorConfig, GroupConfig, JengaAllocator
from jenga.errors import InvalidInput, InvalidSize, UnknownRequest
from jenga.specs import Kind

GROUPS = (
    GroupConfig("attn", Kind.FULL, 16, 4, 1),
    GroupConfig("mamba", Kind.MAMBA, 16, 1, 1),
)


def make(step_end_only: bool, units: int = 1024) -> JengaAllocator:
    return JengaAllocator(AllocatorConfig(GROUPS, units, mamba_step_end_only=step_end_only))


def test_a_2048_token_chunk_holds_one_state_not_128():
    alloc = make(step_end_only=True)
    alloc.add_request("a", list(range(6000)))
    got = alloc.allocate("a", 2048)
    assert got is not None and len(got.new_blocks[0]) == 128 and len(got.new_blocks[1]) == 1
    assert alloc.usage().used_blocks == (128, 1)
    table = alloc.block_table("a", "mamba")
    assert len(table) == 128 and table[:127] == [NULL_BLOCK] * 127 and table[127] >= 0
    alloc.check_invariants(expensive=True)
    # next chunk: the state it starts from (after 2048) stays, the one after 4096 is new
    got = alloc.allocate("a", 2048)
    assert got is not None and got.released == ((), ()) and len(got.new_blocks[1]) == 1
    assert alloc.usage().used_blocks == (256, 2)
    assert [i for i, b in enumerate(alloc.block_table("a", "mamba")) if b >= 0] == [127, 255]
    alloc.check_invariants(expensive=True)
    # third chunk: the start state of the previous step is released, still 2 held
    got = alloc.allocate("a", 1000)
    assert got is not None and got.released[1] == (table[127],)
    assert alloc.usage().used_blocks == (319, 2)
    assert [i for i, b in enumerate(alloc.block_table("a", "mamba")) if b >= 0] == [255, 318]
    alloc.check_invariants(expensive=True)
    alloc.free("a")
    assert alloc.usage().used_blocks == (0, 0)
    alloc.check_invariants(expensive=True)


def test_step_end_states_are_the_cached_checkpoints():
    alloc = make(step_end_only=True)
    prompt = list(range(64))
    alloc.add_request("a", prompt)
    assert alloc.allocate("a", 32) is not None and alloc.allocate("a", 32) is not None
    assert alloc.cache("a", 64) == 4 + 2  # 4 attention blocks, states after 32 and 64
    alloc.free("a")
    assert alloc.prefix_match([*prompt, 7]).hit == 64
    assert alloc.prefix_match(prompt[:48] + [9] * 17).hit == 32  # 16 and 48 never existed
    alloc.check_invariants(expensive=True)


def test_a_step_of_one_block_is_unchanged():
    alloc = make(step_end_only=True)
    alloc.add_request("a", list(range(100)))
    for n in (16, 16, 16):
        got = alloc.allocate("a", n)
        assert got is not None and len(got.new_blocks[1]) == 1
    assert alloc.usage().used_blocks == (3, 2)  # live state + the one the step started from
    assert alloc.block_table("a", "mamba")[0] == NULL_BLOCK


@pytest.mark.parametrize("step_end_only", [False, True])
def test_states_held_per_call(step_end_only):
    """Default: every checkpoint in the span is written, so each is held until cached."""
    alloc = make(step_end_only)
    alloc.add_request("a", list(range(200)))
    assert alloc.allocate("a", 160) is not None
    assert alloc.usage().used_blocks[1] == (1 if step_end_only else 10)
    assert alloc.allocate("a", 16) is not None
    assert alloc.usage().used_blocks[1] == 2
    alloc.check_invariants(expensive=True)


def test_the_state_count_decides_whether_a_chunk_fits():
    # 33 units: a 2048-token chunk's 128 attention blocks take 32 pages, 1 unit is left
    small = (GROUPS[0], GroupConfig("mamba", Kind.MAMBA, 16, 1, 1))
    every = JengaAllocator(AllocatorConfig(small, 33))
    every.add_request("a", list(range(2048)))
    assert every.allocate("a", 2048) is None  # needs 32 + 128 units
    end_only = JengaAllocator(AllocatorConfig(small, 33, mamba_step_end_only=True))
    end_only.add_request("a", list(range(2048)))
    assert end_only.allocate("a", 2048) is not None  # 32 + 1
    assert end_only.usage().free_units == 0


@pytest.mark.parametrize("prompt_only", [False, True])
def test_decode_states_are_cached_only_without_prompt_states_only(prompt_only):
    """``mamba_prompt_states_only`` (vLLM's align mode): the states a decode step writes
    past the prompt are not entered in the prefix cache (vLLM's manager caches none), so
    they cannot crowd out an older shared prefix's state; attention blocks still are."""
    config = AllocatorConfig(
        GROUPS, 1024, mamba_step_end_only=True, mamba_prompt_states_only=prompt_only
    )
    alloc = JengaAllocator(config)
    prompt = list(range(64))
    alloc.add_request("a", prompt)
    assert alloc.allocate("a", 64) is not None
    assert alloc.cache("a", 64) == 4 + 1  # 4 attention blocks, the state after 64
    for i in range(32):  # decode 32 tokens, one per step: states after 80 and 96
        assert alloc.allocate("a", 1) is not None
        alloc.append_tokens("a", [1000 + i])
        alloc.cache("a", 65 + i)
    alloc.free("a")
    assert alloc.usage().cached_blocks == (6, 1 if prompt_only else 3)
    assert alloc.prefix_match([*prompt, 5]).hit == 64
    follow_up = [*prompt, *range(1000, 1032), 5]
    assert alloc.prefix_match(follow_up).hit == (64 if prompt_only else 96)
    alloc.check_invariants(expensive=True)


def make_speculative(num_states: int, units: int = 1024) -> JengaAllocator:
    groups = (GROUPS[0], GroupConfig("mamba", Kind.MAMBA, 16, 1, 1, speculative_states=num_states))
    return JengaAllocator(AllocatorConfig(groups, units, mamba_step_end_only=True))


def test_speculative_states_follow_the_running_one():
    """Three scratch states after the running one; lookahead slots hold no state."""
    alloc = make_speculative(3)
    alloc.add_request("a", list(range(200)))
    got = alloc.allocate("a", 40 + 3, lookahead=3)  # running state after 40: index 2
    assert got is not None and len(got.new_blocks[1]) == 4
    table = alloc.block_table("a", "mamba")
    assert table[:2] == [NULL_BLOCK] * 2 and all(b >= 0 for b in table[2:]) and len(table) == 6
    assert got.appended[1] == tuple(table)  # NULL skips too: what the engine appends
    assert alloc.blocks_to_hold(43, "a") == [0, 0]
    alloc.check_invariants(expensive=True)


def test_a_step_past_the_scratch_states_moves_them_to_the_end():
    """A chunk ending at 112 (running index 6): the scratch states at 3..5 sit on
    checkpoints it skips, so they move after the running one (NULL where they were);
    the state the step starts from (index 2) stays until released; one block is new."""
    alloc = make_speculative(3)
    alloc.add_request("a", list(range(200)))
    assert alloc.allocate("a", 48) is not None
    before = alloc.block_table("a", "mamba")  # [N, N, s2, x3, x4, x5]
    got = alloc.allocate("a", 64)
    assert got is not None and len(got.new_blocks[1]) == 1
    after = alloc.block_table("a", "mamba")
    assert len(after) == 7 + 3
    assert after[:6] == [NULL_BLOCK, NULL_BLOCK, before[2], *[NULL_BLOCK] * 3]
    assert after[6:9] == before[3:6] and after[9] == got.new_blocks[1][0]
    assert got.appended[1] == tuple(after[6:])
    alloc.cache("a", 112)
    alloc.free("a")
    # the moved scratch states were never cached as the checkpoints 64..96
    assert alloc.prefix_match(list(range(113))).hit == 112
    assert alloc.prefix_match(list(range(100))).hit == 48
    alloc.check_invariants(expensive=True)


def test_a_hit_table_has_no_scratch_states_until_the_request_grows():
    alloc = make_speculative(2)
    prompt = list(range(64))
    alloc.add_request("a", prompt)
    assert alloc.allocate("a", 32) is not None and alloc.allocate("a", 32) is not None
    alloc.cache("a", 64)
    alloc.free("a")
    alloc.add_request("b", [*prompt, 1, 2])
    hit = alloc.block_table("b", "mamba")
    assert hit[:3] == [NULL_BLOCK] * 3 and hit[3] >= 0 and len(hit) == 4
    got = alloc.allocate("b", 2)  # the running state after 66 (index 4) and 2 scratch
    assert got is not None and len(got.new_blocks[1]) == 1 + 2
    assert alloc.block_table("b", "mamba") == [*hit, *got.new_blocks[1]]
    alloc.check_invariants(expensive=True)


def test_a_negative_lookahead_or_one_past_the_length_is_refused():
    alloc = make_speculative(1)
    alloc.add_request("a", list(range(20)))
    with pytest.raises(InvalidSize, match="lookahead 5 not in"):
        alloc.allocate("a", 4, lookahead=5)
    assert alloc.num_tokens("a") == 0


def test_a_request_holding_speculative_states_is_not_forked():
    alloc = make_speculative(2)
    alloc.add_request("a", list(range(40)))
    assert alloc.allocate("a", 40) is not None
    with pytest.raises(InvalidInput, match=r"'a': groups \[1\] hold speculative Mamba states"):
        alloc.fork("a", ["b"])
    with pytest.raises(UnknownRequest):  # nothing registered
        alloc.num_tokens("b")
    alloc.check_invariants(expensive=True)
