"""
jenga private extension: two-level LCM allocator bookkeeping and block hashing
"""

from __future__ import annotations

import collections.abc
import typing

import numpy
import numpy.typing

__all__: list[str] = ["AllocationOrder", "BlockHasher", "Core", "Rules", "blake2b", "sha256"]

class AllocationOrder:
    """
    order of the five allocation steps

    Members:

      PAPER

      COMPACT

      PINNED
    """

    COMPACT: typing.ClassVar[AllocationOrder]
    PAPER: typing.ClassVar[AllocationOrder]
    PINNED: typing.ClassVar[AllocationOrder]
    __members__: typing.ClassVar[dict[str, AllocationOrder]]
    @typing.overload
    def __eq__(self, other: AllocationOrder) -> bool: ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool: ...
    def __getstate__(self) -> int: ...
    def __hash__(self) -> int: ...
    def __index__(self) -> int: ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def __int__(self) -> int: ...
    @typing.overload
    def __ne__(self, other: AllocationOrder) -> bool: ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool: ...
    def __repr__(self) -> str: ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def __str__(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class Rules:
    """
    The rules the core allocates and evicts by (one value)
    """
    def __init__(self, **kwargs) -> None: ...
    @property
    def demote_window_releases(self) -> bool:
        """
        early releases are cached in a lower tier, evicted before every block cached by release(), unless they served a prefix hit
        """
    @property
    def early_release_groups(self) -> list[bool]:
        """
        one flag per group (empty: none): blocks cached by allocate()'s release lists of a flagged group are early (ties: shortest prefix first)
        """
    @property
    def frugal_retry(self) -> bool:
        """
        retry a refused allocate() in frugal order
        """
    @property
    def order(self) -> AllocationOrder:
        """
        step order: PAPER 1, 2, 3, 4, 5; COMPACT 1, 4, 2, 3, 5; PINNED 1, 4, 2, then 5 on pages not wholly evictable, 3, 5
        """
    @property
    def pack_window_blocks(self) -> bool:
        """
        a call's last window_blocks[g] blocks (those the request keeps) first take a demoted cached block on the pinned page with the most used blocks, then steps 1, 4, 2, 5p, 3, 5; the blocks before them (released right after) keep the order
        """
    @property
    def pinned_lru_fair(self) -> bool:
        """
        with PINNED order, the pinned step takes its block only when no wholly evictable page is less recently used (else step 3 evicts that page first)
        """
    @property
    def retention_interval(self) -> int:
        """
        positive: retention boundaries every this many tokens; an early block of a group with a retention reach is demoted unless a hit at the next boundary at or after its prefix reads it, or it served a prefix hit (0: off)
        """
    @property
    def retention_reach(self) -> list[int]:
        """
        one per group (empty: none): a block is read by a hit at boundary R iff its prefix length p has R - reach < p <= R (-1: the group is not thinned)
        """
    @property
    def reuse_window_releases(self) -> bool:
        """
        with demote_window_releases, while under 1/4 of the pool is free: right after step 4, a group reuses its own demoted (window-released) cached blocks on pages it pins before mapping or evicting a page (counted as 5)
        """
    @property
    def window_blocks(self) -> list[int]:
        """
        one count per group (empty: none): blocks a request keeps once its window passed (0: the group does not release early)
        """

class BlockHasher:
    """
    128-bit block identities: keyed BLAKE2b-128 or (HMAC-)SHA-256 cut to 128 bits (csrc/jenga/digest.hpp)
    """
    def __init__(self, algorithm: str, key: bytes) -> None: ...
    def block(
        self,
        parent: typing.Annotated[numpy.typing.ArrayLike, numpy.uint64],
        tokens: typing.Annotated[numpy.typing.ArrayLike, numpy.int64],
        extra: bytes = b"",
    ) -> numpy.typing.NDArray[numpy.uint64]:
        """
        Identity of one block: parent identity, its tokens, extra bytes (image keys)
        """
    def chain(
        self,
        tokens: typing.Annotated[numpy.typing.ArrayLike, numpy.int64],
        tokens_per_block: typing.SupportsInt | typing.SupportsIndex,
        parent: typing.Annotated[numpy.typing.ArrayLike, numpy.uint64],
    ) -> numpy.typing.NDArray[numpy.uint64]:
        """
        Chained identities (n, 2) of the complete blocks of `tokens` after `parent`
        """
    def digest(self, data: bytes) -> numpy.typing.NDArray[numpy.uint64]:
        """
        Identity (2 uint64 words) of the message 0x00 | data
        """

class Core:
    """
    Two-level LCM allocator bookkeeping (see jenga/allocator.py)
    """
    def __init__(
        self,
        blocks_per_page: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        units_per_page: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        total_units: typing.SupportsInt | typing.SupportsIndex,
        rules: Rules = ...,
        short_key_bits: typing.SupportsInt | typing.SupportsIndex = 64,
        record_plan: bool = True,
    ) -> None:
        """
        short_key_bits < 64 keys the hash index by fewer bits of each identity (a test hook: collisions of the short key are then common, and must never be served); record_plan=False keeps no plan ops (nothing maps pages; drain_plan() is empty)
        """
    def acquire(
        self,
        group: typing.SupportsInt | typing.SupportsIndex,
        blocks: typing.Annotated[numpy.typing.ArrayLike, numpy.int32],
        now: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def allocate(
        self,
        owner: typing.SupportsInt | typing.SupportsIndex,
        counts: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        now: typing.SupportsInt | typing.SupportsIndex,
        releases: collections.abc.Sequence[
            collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
        ] = [],
    ) -> list[list[int]] | None: ...
    def allocate_arrays(
        self,
        owner: typing.SupportsInt | typing.SupportsIndex,
        counts: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        now: typing.SupportsInt | typing.SupportsIndex,
        releases: collections.abc.Sequence[
            typing.Annotated[numpy.typing.ArrayLike, numpy.int32]
        ] = [],
    ) -> typing.Any:
        """
        allocate() taking and returning int32 arrays
        """
    def allocate_blocks(
        self,
        group: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        owner: typing.SupportsInt | typing.SupportsIndex,
        now: typing.SupportsInt | typing.SupportsIndex,
        out: typing.Any = None,
    ) -> typing.Any:
        """
        allocate() of `count` blocks in one group: a list of block ids, or None (no room, nothing changed); with `out` (writable 1-D int32 buffer) the ids go to out[:count] and the call returns count
        """
    def block_info(
        self,
        group: typing.SupportsInt | typing.SupportsIndex,
        block: typing.SupportsInt | typing.SupportsIndex,
    ) -> tuple:
        """
        (state 0 free/1 used/2 cached, refcount, hashed, last_access, prefix_len)
        """
    def check_invariants(self, expensive: bool = False) -> None: ...
    def commit(
        self,
        group: typing.SupportsInt | typing.SupportsIndex,
        blocks: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        hashes: typing.Annotated[numpy.typing.ArrayLike, numpy.uint64],
        prefix_lens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
    ) -> int:
        """
        Enter the identities (n, 2) of USED blocks in the index
        """
    def commit_run(
        self,
        group: typing.SupportsInt | typing.SupportsIndex,
        blocks: typing.Annotated[numpy.typing.ArrayLike, numpy.int32],
        hashes: typing.Annotated[numpy.typing.ArrayLike, numpy.uint64],
        first_prefix: typing.SupportsInt | typing.SupportsIndex,
        step: typing.SupportsInt | typing.SupportsIndex,
    ) -> int:
        """
        commit() for consecutive blocks: prefix_len[i] = first_prefix + i * step; negative block ids are skipped
        """
    def counters(self) -> dict: ...
    def drain_plan(self) -> list:
        """
        The plan ops since the last drain as (kind 0 map / 1 unmap, group, page, reused_units) tuples
        """
    def evict_cached_pages(self, units: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        Evict whole evictable pages in step 3's order until `units` units are freed or none is left; returns the units freed (the unmaps are plan ops)
        """
    def eviction_order(self, group: typing.SupportsInt | typing.SupportsIndex) -> list[int]: ...
    def group_counts(self, group: typing.SupportsInt | typing.SupportsIndex) -> tuple:
        """
        (mapped_pages, cached_blocks, free_blocks, used_blocks)
        """
    def lookup(
        self,
        group: typing.SupportsInt | typing.SupportsIndex,
        hashes: typing.Annotated[numpy.typing.ArrayLike, numpy.uint64],
    ) -> numpy.typing.NDArray[numpy.int32]:
        """
        Block id per identity (int32 array), -1 where absent or where the short key names another identity
        """
    def memory_bytes(self) -> int:
        """
        Bytes the core holds (its containers' capacities; set nodes estimated)
        """
    def page_eviction_order(self) -> list[tuple[int, int]]: ...
    def release(
        self,
        group: typing.SupportsInt | typing.SupportsIndex,
        blocks: typing.Any,
        now: typing.SupportsInt | typing.SupportsIndex,
    ) -> None:
        """
        Drop one reference per block (a list/tuple of ints or a 1-D int32 array), last listed first; ValueError (nothing changed) if one is not in use
        """
    def set_total_units(self, units: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Grow or shrink the pool to `units` units; a shrink takes free units only (ValueError, nothing changed, when fewer are free)
        """
    def uncache_blocks(
        self,
        group: typing.SupportsInt | typing.SupportsIndex,
        blocks: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
    ) -> int:
        """
        Drop these blocks of a group from the prefix cache (bad data): cached ones turn free (pages left empty are unmapped: plan ops), used ones lose their hash; returns how many left the index
        """
    @property
    def free_units(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def record_plan(self) -> bool: ...
    @property
    def rules(self) -> Rules:
        """
        The rules (a copy; assign a new Rules to change them)
        """
    @rules.setter
    def rules(self, arg1: Rules) -> None: ...
    @property
    def total_units(self) -> int: ...

def blake2b(
    data: bytes, key: bytes = b"", digest_size: typing.SupportsInt | typing.SupportsIndex = 64
) -> bytes:
    """
    BLAKE2b of data (RFC 7693), keyed when key is not empty
    """

def sha256(data: bytes, key: bytes = b"") -> bytes:
    """
    SHA-256 of data, HMAC-SHA-256 when key is not empty
    """
