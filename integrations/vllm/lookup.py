"""The prefix-lookup half of `integrations.vllm.manager.JengaKVCacheManager` (a mixin).

Rationale
    vLLM's scheduler asks for a request's computed blocks before it admits the request;
    the manager answers from one allocator lookup and keeps it for the admission. The
    lookup, its connector variant, the cut a connector's longer hit makes and the
    cached-token estimate live here so the manager's allocation half stays readable.

Approach
    `PrefixLookup` holds the calls; the manager inherits them and owns every attribute
    they read (declared below for type checking). `digests_of` and ``_images`` give the
    allocator the request's vLLM block digests and multimodal spans, for lookups and for
    the admission alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from jenga.allocator import ImageSpan, JengaAllocator, PrefixMatch
from jenga.specs import Kind

from integrations.vllm import connector
from integrations.vllm.compat import KVCacheBlock, KVCacheBlocks, Request
from integrations.vllm.identity import request_salt, stable_int

if TYPE_CHECKING:
    from integrations.vllm.block_ids import BlockIds
    from integrations.vllm.layout import JengaLayout


class PrefixLookup:
    """`JengaKVCacheManager`'s prefix-lookup calls (a mixin: the manager owns the state)."""

    layout: JengaLayout
    allocator: JengaAllocator
    enable_caching: bool
    empty_kv_cache_blocks: KVCacheBlocks
    num_kv_cache_groups: int
    _encoder_side: bool
    _block_ids: BlockIds
    _requests: dict[Hashable, Any]
    _last_match: tuple[Hashable, PrefixMatch] | None

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """(hit blocks, hit tokens, shared-prefix boundary), as vLLM's manager returns them.

        Per group ``hit // block_size`` cached blocks (null where the group does not read
        them); `allocate_slots` claims the same hit. The boundary (0 if none) is the
        longest prefix one group alone caches past the hit (a full-attention prefix whose
        Mamba state was never written): vLLM's scheduler ends the chunk there so the next
        sibling hits it all. ``max_cache_hit_length`` (the routed-experts connector's
        rows) caps the hit at the longest prefix below it valid in every group.
        """
        blocks, hit, boundary, _ = self._lookup(request, max_cache_hit_length, False)
        return blocks, hit, boundary

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """`get_computed_blocks` plus ``hit_diverged`` for a connector that restores a
        deeper hit's Mamba state (``supports_divergent_local_hybrid_hits``): the longest
        prefix valid in every stateless group unless a Mamba group alone runs past it;
        when deeper than the cached states (boundary 0), the Mamba tables hold no state
        and the Mamba group gets a fresh block after the connector's tokens."""
        return self._lookup(request, max_cache_hit_length, True)

    def _lookup(
        self, request: Request, max_hit: int | None, restored_states: bool
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The one prefix lookup of both `get_computed_blocks` calls, kept for `_admit`:
        (blocks, hit, shared-prefix boundary, hit diverged)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        match = self.allocator.prefix_match(
            request.all_token_ids,
            images=self._images(request),
            salt=request_salt(request),
            request_id=request.request_id,
            digests=digests_of(request),
            max_hit=max_hit,  # a shorter hit valid in every group below it
            restored_states=restored_states,
        )
        self._last_match = (request.request_id, match)  # `_admit` adopts it
        hit, junction = match.hit, match.junction
        blocks = self._blocks_of(match.tables) if hit else self.empty_kv_cache_blocks
        report = self.layout.options.junctions and junction > hit and not match.diverged
        return blocks, hit, junction if report else 0, match.diverged

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """The hit cut at ``num_computed_tokens`` (a connector's longer hit covers the
        rest); the next admission adopts the cut hit."""
        last = self._last_match
        if last is not None and last[1].hit > num_computed_tokens:
            match = last[1]
            tables = [
                t[: num_computed_tokens // g.block_size]
                for t, g in zip(match.tables, self.layout.groups, strict=True)
            ]
            cut = replace(match, hit=num_computed_tokens, tables=tables)
            self._last_match = (last[0], cut)
        return connector.truncated(self, blocks, num_computed_tokens)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request whose blocks are committed to the prefix cache."""
        rid = request.request_id
        state = self._requests.get(rid)
        if not self.enable_caching or state is None:
            return 0
        computed = min(request.num_computed_tokens, self.allocator.num_tokens(rid), state.num_known)
        sizes = [g.block_size for g in self.layout.groups if g.kind is not Kind.CROSS_ATTENTION]
        return min((computed // size * size for size in sizes), default=0)

    def _images(self, request: Request) -> tuple[ImageSpan, ...]:
        """The request's multimodal inputs as jenga images, keyed by vLLM's identifiers.

        Decoder-only models (LLaVA-style) have the placeholder tokens in the prompt, so
        their positions hash by the image's identity (a different image never hits).
        Encoder-decoder models hold the encoder input only in cross-attention groups,
        allocated with the step that computes the first decoder token, cached and hit
        by identity (vLLM itself never caches cross-attention blocks).
        """
        features = getattr(request, "mm_features", None) or ()
        return tuple(
            ImageSpan(
                int(f.mm_position.offset),
                int(f.mm_position.length),
                stable_int(f.identifier),
                in_text=not self._encoder_side,
            )
            for f in features
        )

    # -- block tables -------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        if request_id not in self._requests:
            return self.empty_kv_cache_blocks
        tables = tuple(
            self.allocator.block_table(request_id, g) for g in range(self.num_kv_cache_groups)
        )
        return self._blocks_of(tables)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        ids = self.get_block_ids(request_id)
        return tuple(
            row[: -(-num_computed_tokens // g.block_size)]
            for row, g in zip(ids, self.layout.groups, strict=True)
        )

    def is_cached_block(self, group: int, block_id: int) -> bool:
        """Whether vLLM block ``block_id`` of ``group`` is committed to the prefix cache."""
        return self.allocator.is_cached_block(
            group, self._block_ids.allocator_block(group, block_id)
        )

    @property
    def shares_block_ids(self) -> bool:
        """True when block ids are vLLM's slots, unique across groups (``pages="vllm"`` and
        the "slots" VMM geometry)."""
        return self._block_ids.shares_block_ids

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def _blocks_of(self, tables: Sequence[Sequence[int]]) -> KVCacheBlocks:
        if not any(tables):
            return self.empty_kv_cache_blocks
        return self.create_kv_cache_blocks(self._block_ids.rows(tables))


def digests_of(request: Request) -> Sequence[bytes]:
    """The request's vLLM block digests (``block_hashes``; none without a hasher)."""
    hashes: Sequence[bytes] | None = getattr(request, "block_hashes", None)
    return () if hashes is None else hashes
