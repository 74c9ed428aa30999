"""The Jenga two-level allocator with per-group prefix caching: the engine-facing API.

Rationale
    Models mix layer kinds whose caches differ in size and in which tokens they keep.
    One pool of units (2 MiB chunks under VMM, LCM large pages without it) is shared by
    all groups; each group cuts its large pages into its own small pages (blocks). A
    request's blocks live in large pages associated with that request, so a finished
    request hands whole large pages back (paper §4.3, Fig. 8). Finished requests' blocks
    stay cached and are evicted LRU, aligned across groups by prefix length (§5).

Approach
    Python keeps the per-request view (tokens, block tables per group, how many blocks
    are hashed) and asks each group's policy (`jenga.policies`) which blocks a length
    needs, which blocks may be released to the cache, and which prefix lengths a group can
    serve. The per-block bookkeeping — free lists, request association of large pages,
    LRU order of evictable blocks and pages, the hash index, the five allocation steps —
    lives in the C++ core (`vmm._core.jenga.Core`), reached by batched calls with the GIL
    released. Every call that changes physical needs returns a `MappingPlan`.

    Allocating one block of group g for request r tries, in order (paper order):

    1. a free block in a large page associated with r,
    2. a new large page from free units (``MapPage``),
    3. evict whole evictable large pages of any group (LRU by the newest last access of
       their blocks) until ``units_per_large_page[g]`` units are free, and remap those
       units (``UnmapPage``... then ``MapPage(reused_units=k)``),
    4. a free block in a large page of another request,
    5. evict one evictable block of g (LRU; ties: the longest prefix first).

    ``AllocationOrder.COMPACT`` tries 4 before 2 (commits fewer units, frees less cleanly).
    `allocate` is all-or-nothing across groups: on "no room" it returns None and the
    core rolls back every step it took (evictions included).

Limitations
    One allocator serves one model (groups of a draft and a target model are just more
    groups). Block hashes are 64-bit; a collision would alias two prefixes (probability
    ~n²/2⁶⁵ for n cached blocks). Times are a logical clock advanced by each mutating call.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from jenga.plan import MappingPlan
from jenga.specs import Kind

NULL_BLOCK = -1
"""Block-table entry of a block the request released (out of the window, an old Mamba state)."""


class AllocatorError(Exception):
    """Base class of every error the allocator raises on purpose (state is unchanged)."""


class InvalidSize(AllocatorError, ValueError):
    """A count, size or length is zero/negative or out of range."""


class UnknownRequest(AllocatorError, KeyError):
    """The request id was never added, or was already freed."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateRequest(AllocatorError, ValueError):
    """`add_request` with an id that is live."""


class DoubleFree(UnknownRequest):
    """`free` of a request that was already freed."""


class PageTooLarge(AllocatorError, ValueError):
    """A group's large page costs more units than the whole pool holds."""


class AllocationOrder(StrEnum):
    """Order of the five allocation steps (see the module note)."""

    PAPER = "paper"  # 1, 2, 3, 4, 5
    COMPACT = "compact"  # 1, 4, 2, 3, 5


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens in the prompt: positions [start, start + length)."""

    start: int
    length: int
    content_hash: int

    @property
    def end(self) -> int:
        return self.start + self.length


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


@dataclass(frozen=True)
class AllocatorConfig:
    """The pool (``total_units``), the groups, the step order and the length limit."""

    groups: tuple[GroupConfig, ...]
    total_units: int
    order: AllocationOrder = AllocationOrder.PAPER
    max_model_len: int | None = None


@dataclass(frozen=True)
class Allocation:
    """What `allocate` gave: per group (config order) the new block ids, and the plan.

    ``released`` lists, per group, the blocks the request gave back to the cache in the
    same call (they left the sliding window / chunk, or an old Mamba state).
    """

    new_blocks: tuple[tuple[int, ...], ...]
    released: tuple[tuple[int, ...], ...]
    plan: MappingPlan
    num_tokens: int


@dataclass(frozen=True)
class Usage:
    """Unit and block accounting at one moment.

    ``used_units + free_units == total_units``. ``mapped_pages[g]`` large pages of group g
    hold ``used_blocks[g]`` blocks owned by requests, ``cached_blocks[g]`` evictable
    blocks, and the rest free.
    """

    total_units: int
    used_units: int
    free_units: int
    mapped_pages: tuple[int, ...]
    used_blocks: tuple[int, ...]
    cached_blocks: tuple[int, ...]
    free_blocks: tuple[int, ...]


@dataclass
class _Request:
    internal_id: int
    tokens: list[int]
    images: tuple[ImageSpan, ...]
    salt: int
    num_tokens: int = 0  # tokens with allocated slots
    num_cached_hit: int = 0
    tables: list[list[int]] = field(default_factory=list)
    num_hashed: list[int] = field(default_factory=list)  # blocks committed to the index


class JengaAllocator:
    """Two-level LCM allocator + prefix cache for one model's groups.

    Request ids are any hashable the engine likes. Block ids are per group:
    ``page * blocks_per_large_page[g] + slot``. Every public method either completes or
    raises before changing anything.
    """

    def __init__(self, config: AllocatorConfig) -> None:
        raise NotImplementedError

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: Hashable,
        prompt: Sequence[int],
        *,
        images: Sequence[ImageSpan] = (),
        salt: int = 0,
        use_cache: bool = True,
    ) -> int:
        """Register a request and claim its longest cached prefix; returns its length.

        The hit is the longest length valid in every group's `possible_prefix`, capped at
        ``len(prompt) - 1`` so one token is always computed. The hit's blocks are shared
        (refcounted), not copied; no new memory is needed, so this never fails for room.
        Raises `DuplicateRequest`, `InvalidSize` (empty prompt, > max_model_len).
        """
        raise NotImplementedError

    def allocate(self, request_id: Hashable, num_new_tokens: int) -> Allocation | None:
        """Give the request slots for ``num_new_tokens`` more tokens in every group.

        Releases blocks the policies no longer need (window/chunk/Mamba) to the cache
        first, then allocates what each group needs. Returns None ("no room") with
        nothing changed when any group cannot be satisfied. Raises `UnknownRequest`,
        `InvalidSize` (``num_new_tokens <= 0`` or beyond ``max_model_len``).
        """
        raise NotImplementedError

    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Record generated token ids so their blocks can be hashed by `cache`."""
        raise NotImplementedError

    def cache(self, request_id: Hashable, num_computed_tokens: int) -> int:
        """Commit the hashes of blocks complete within ``num_computed_tokens``.

        Returns the number of blocks newly entered in the hash index. Raises
        `UnknownRequest`, `InvalidSize` (more tokens than allocated or known).
        """
        raise NotImplementedError

    def free(self, request_id: Hashable) -> MappingPlan:
        """Finish a request: hashed blocks stay cached (evictable), the rest are freed.

        Large pages left with only free blocks are unmapped (the returned plan). Raises
        `DoubleFree` for an id already freed, `UnknownRequest` for one never added.
        """
        raise NotImplementedError

    # -- queries ----------------------------------------------------------------------
    def match_prefix(
        self, prompt: Sequence[int], *, images: Sequence[ImageSpan] = (), salt: int = 0
    ) -> int:
        """Length of the longest cached prefix a new request with this prompt would hit."""
        raise NotImplementedError

    def block_table(self, request_id: Hashable, group: int | str) -> list[int]:
        """The request's block ids in ``group`` by block index; `NULL_BLOCK` where released."""
        raise NotImplementedError

    def num_tokens(self, request_id: Hashable) -> int:
        """Tokens with allocated slots."""
        raise NotImplementedError

    def usage(self) -> Usage:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """Counters in dotted keys, e.g. ``"alloc.step.3"``, ``"evict.blocks.full"``,
        ``"plan.remapped_units"``, ``"prefix.hit_tokens"``, ``"units.free.current"``."""
        raise NotImplementedError

    def check_invariants(self, expensive: bool = False) -> None:
        """Raise AssertionError when bookkeeping disagrees (C++ core + Python tables)."""
        raise NotImplementedError
