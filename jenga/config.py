"""Allocator configuration: the groups, the pool, and the rules the core allocates by.

Rationale
    An allocator is configured once, at construction, by frozen dataclasses (no knob is
    set on a live allocator). The rules that decide allocation and eviction order are one
    value, `AllocationRules`, handed to the C++ core whole (`jenga._core.Rules`, the same
    fields by name), so a new rule is one field here and one line of ``JENGA_RULES`` in
    ``csrc/jenga/core.hpp`` instead of a setter threaded through every layer.

Approach
    `GroupConfig`: one group as the allocator sees it (its kind's policy parameters and
    its page shape). `AllocatorConfig`: the groups, the pool's units, the rules, the
    length limit and the block identity (`jenga.prefix.BlockIdentity`);
    `AllocatorConfig.from_page_table` builds one from a `jenga.pages` page table. What
    each rule does is in the design note of `jenga.allocator`.

Limitations
    Validation that needs the whole configuration (a window beyond ``max_model_len``, a
    page costing more than the pool) happens when `jenga.allocator.JengaAllocator` is
    built, where it raises the allocator's errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum

import numpy as np

from jenga import _core
from jenga.pages import PageTable
from jenga.policies import POLICY_BY_KIND
from jenga.prefix import BlockIdentity
from jenga.specs import Kind, ModelSpec, SpecError


class AllocationOrder(StrEnum):
    """Order of the five allocation steps (see the `jenga.allocator` note)."""

    PAPER = "paper"  # 1, 2, 3, 4, 5
    COMPACT = "compact"  # 1, 4, 2, 3, 5
    PINNED = "pinned"  # 1, 4, 2, 5 on pages not wholly evictable, 3, 5


@dataclass(frozen=True)
class AllocationRules:
    """How the core allocates and evicts, as one value (`jenga._core.Rules` by field name).

    ``order``: the step order. ``frugal_retry``: a refused multi-group allocate is retried
    in frugal order (costless blocks first), so it fails only when no assignment exists;
    False is the paper's single pass (the engine then waits instead of evicting scattered
    cached blocks to admit: more prefix hits in the simulator, some refusals with units
    free; docs/jenga.md). ``demote_window_releases``: blocks a running request releases
    from a sliding-window or chunked-local group (they left its window / chunk) are
    evicted before every block of a finished request (LRU within each tier); off by
    default, it lost hit rate in the measured runs ("Window-release demotion" in
    docs/jenga.md). ``reuse_window_releases`` (with demotion): under pressure (less than
    a quarter of the pool free), right after step 4 a group reuses its own demoted blocks
    on pages it still pins before mapping or evicting a page (on for vLLM's per-group
    VMM pages; docs/vllm.md). ``pinned_lru_fair`` (pinned order only): the pinned step
    takes a cached block of a page live blocks pin only when no wholly evictable page is
    less recently used, else step 3 evicts that page first (on for vLLM's per-group VMM
    pages; docs/jenga.md). ``pack_window_blocks`` (with demotion): in a sliding-window
    or chunked-local group, the blocks a call allocates that the request keeps (its last
    `Policy.window_blocks`) first take a demoted block on the pinned page holding the most
    used blocks, so live window blocks gather in few pages and the others drain whole (a
    vLLM option, off by default; docs/vllm-geometry.md). Which groups release early, and how
    many blocks they keep, follows from their policies (`Policy.releases_early`,
    `Policy.window_blocks`), so it is not a rule here. ``retention_interval`` (0: off): a
    positive one makes every multiple of it a retention boundary (vLLM's
    ``prefix_cache_retention_interval``); a block a running request releases from a group
    a retention interval thins (`Policy.retention_reach`: sliding window) is demoted, as
    with ``demote_window_releases``, unless a prefix hit at the next boundary at or after
    the block reads it or it served a prefix hit. Blocks a finished request releases (its
    last window, read by a hit at its end) are never demoted.
    """

    order: AllocationOrder = AllocationOrder.PAPER
    frugal_retry: bool = True
    demote_window_releases: bool = False
    reuse_window_releases: bool = False
    pinned_lru_fair: bool = False
    pack_window_blocks: bool = False
    retention_interval: int = 0

    def __post_init__(self) -> None:
        if self.retention_interval < 0:
            raise SpecError(f"retention_interval must be >= 0, got {self.retention_interval}")

    def to_core(
        self,
        early_release_groups: Sequence[bool],
        window_blocks: Sequence[int] = (),
        retention_reach: Sequence[int] = (),
    ) -> _core.Rules:
        """The core's copy: the same fields by name (an enum by its member name), plus
        each group's early-release flag, kept window blocks and retention reach (from its
        policy)."""
        values: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Enum):
                value = getattr(getattr(_core, type(value).__name__), value.name)
            values[f.name] = value
        return _core.Rules(
            **values,
            early_release_groups=list(early_release_groups),
            window_blocks=list(window_blocks),
            retention_reach=list(retention_reach),
        )


_DEFAULT_RULES = AllocationRules()


@dataclass(frozen=True)
class GroupConfig:
    """One group as the allocator sees it: its policy parameters and its page shape.

    ``tokens_per_block``: tokens one block covers (Mamba: the checkpoint interval, one
    state per interval). ``blocks_per_large_page`` / ``units_per_large_page``: the page
    table's B_g and U_g (VMM: chunks per large page over all of g's ranges; static: 1).
    """

    name: str
    kind: Kind
    tokens_per_block: int
    blocks_per_large_page: int
    units_per_large_page: int = 1
    window: int | None = None
    chunk: int | None = None
    token_fraction: tuple[int, int] = (1, 1)
    speculative_states: int = 0  # Mamba: states kept per draft token past the running one


@dataclass(frozen=True)
class HitProof:
    """A prefix hit must be *proven* by ``steps`` more prefix steps cached after it.

    Speculative decoding with a draft that reads the target's hidden states (EAGLE,
    MTP) writes the draft KV of a prefix's last token together with the token after it,
    so a hit is served only where the cache also holds what follows it (vLLM drops the
    last block of a hit). Token kinds must hold the hit plus the proof; state kinds
    (Mamba) only the hit. ``to_prompt_end``: the proof may reach the prompt's last token
    (vLLM's hybrid coordinator), else it stays below it as the hit does (vLLM's
    single-group coordinator: a hit of the whole prompt but one block is proven by
    nothing). ``per_block``: a step of the proof is one of the group's own blocks (its
    hit unit inside blocks, `jenga.substates`), not a prefix step (vLLM's margin: one
    block of the group); ``groups``: the groups that need a proof (None: all; vLLM's
    draft groups where the config marks them).
    """

    steps: int = 1
    to_prompt_end: bool = True
    per_block: bool = False
    groups: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise SpecError(f"hit proof steps must be > 0, got {self.steps}")

    def proven(self, mask: np.ndarray, holds_state: bool, whole: bool) -> np.ndarray:
        """One group's proven hits: ``mask[i]`` says whether the prefix of ``(i+1)*step``
        tokens is valid in the group; ``whole``: the last entry is the whole prompt (never
        a hit: one token is always computed). A state kind's valid hits need no proof."""
        if whole and not self.to_prompt_end:
            mask[-1] = False  # the proof too stays below the prompt's last token
        if not holds_state:
            counts = np.concatenate(([0], np.cumsum(mask, dtype=np.int64)))
            k = self.steps + 1  # the hit and its proof: k valid lengths in a row
            mask = np.zeros_like(mask)
            mask[: max(0, len(mask) - k + 1)] = counts[k:] - counts[:-k] == k
        if whole and len(mask):
            mask[-1] = False
        return mask


@dataclass(frozen=True)
class AllocatorConfig:
    """The pool (``total_units``), the groups, the rules and the length limit."""

    groups: tuple[GroupConfig, ...]
    total_units: int
    rules: AllocationRules = field(default_factory=AllocationRules)
    max_model_len: int | None = None
    # Mamba: True when the engine writes a state only where each step ends (vLLM's
    # "align" mode), so one step holds 2 states, not one per checkpoint it spans.
    mamba_step_end_only: bool = False
    # how blocks are named in the prefix cache (digest, key, the index's short key)
    identity: BlockIdentity = field(default_factory=BlockIdentity)
    # Mamba: True to cache only the states at checkpoints within a request's prompt (as
    # vLLM's "align" mode does): a state a decode step writes serves only a request that
    # repeats the output verbatim, and keeping each one fills the pool with states that
    # LRU ranks above an older shared prefix's (which then goes first)
    mamba_prompt_states_only: bool = False
    # speculative decoding: a hit must be followed by cached steps (`HitProof`)
    hit_proof: HitProof | None = None
    # Mamba: tokens between the positions inside a checkpoint interval at which a state
    # may also be cached and hit (`jenga.substates`; None: checkpoints only)
    state_unit: int | None = None

    @classmethod
    def from_page_table(
        cls,
        model: ModelSpec,
        table: PageTable,
        total_units: int,
        rules: AllocationRules | AllocationOrder = _DEFAULT_RULES,
        *,
        mamba_step_end_only: bool = False,
        identity: BlockIdentity | None = None,
    ) -> AllocatorConfig:
        """One `GroupConfig` per model group from a `jenga.pages` page table row.

        A block covers its kind's `Policy.block_tokens` (Mamba: ``checkpoint_interval``,
        every other kind ``block_size``). ``rules`` may be an `AllocationOrder` alone: the
        default rules in that order.
        """
        if isinstance(rules, AllocationOrder):
            rules = AllocationRules(order=rules)
        groups = []
        for g in model.groups:
            row = table.group(g.name)
            spec = g.spec
            groups.append(
                GroupConfig(
                    g.name,
                    spec.kind,
                    POLICY_BY_KIND[spec.kind].block_tokens(spec),
                    row.blocks_per_large_page,
                    row.units_per_large_page,
                    window=spec.window,
                    chunk=spec.chunk,
                    token_fraction=spec.token_fraction,
                    speculative_states=spec.speculative_states,
                )
            )
        return cls(
            tuple(groups),
            total_units,
            rules,
            model.max_model_len,
            mamba_step_end_only,
            identity or BlockIdentity(),
        )
