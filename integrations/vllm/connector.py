"""vLLM's KV-connector surface of the jenga manager: external tokens, deferred frees, zeroing.

Rationale
    vLLM's KV connectors (its CPU offloading connector, P/D transfers, LMCache, ...) speak
    to the scheduler, and the scheduler speaks to its KV-cache manager: it asks how many
    tokens the connector holds beyond the local hit, allocates slots for them, keeps a
    finished request's blocks while the connector still sends them, re-zeroes blocks a
    failed load left unwritten, and returns deferred blocks through the manager's
    ``block_pool``. Those calls are served here, beside the manager, so the manager's own
    path (prefix hits, allocation, caching) stays one path with or without a connector.

Approach
    - External tokens (``num_external_computed_tokens``): the manager allocates them in
      their own allocator call before the step's new tokens (`external_then_new`), so
      each group's table has a block at the external boundary exactly where vLLM's
      has one (a Mamba state the connector writes lands on the boundary's block).
      Both calls happen at admission, so a failure of the second releases the request.
    - Deferred frees (`pop_blocks_for_free`): the request is forked into a parked
      allocator request that shares every live block (`JengaAllocator.fork`: one
      reference each, no memory), then the request itself is freed. The scheduler gets
      fresh `KVCacheBlock` objects naming the request's blocks; when it hands them back
      through ``block_pool.free_blocks`` the parked request is freed, and the blocks
      turn evictable (hashed) or free as a finished request's do.

          request r  ─ fork ─▶ parked p (same blocks, +1 ref)   free(r): refs drop by 1
          scheduler holds [KVCacheBlock(b) ...] of p  ──free_blocks──▶ free(p)

    - `ConnectorBlockPool` is the small ``block_pool`` the scheduler and connectors
      read: ``free_blocks`` (deferred frees), ``null_block``, ``evict_blocks``, and for
      vLLM 0.33's routed-experts connector (``enable_return_routed_experts``, which keys
      the rows it keeps by vLLM block hash and keeps them while the KV is cached)
      ``hash_block_size``; that connector asks each group's ``block_pool`` in the
      coordinator view, `CachedBlockLookup`, ``get_cached_block`` (is the block a vLLM
      hash names in the prefix cache of these groups: one index lookup each, as the
      allocator names text blocks by vLLM's digests). A connector that drives vLLM's
      own `BlockPool` (its ref counts, free queue, hash map) cannot run on it and is
      refused at start-up (`bind_connector`).
    - Eviction by block id (`evict_by_id`, vLLM's ``evict_blocks`` after a failed load
      under the "fail" policy): each id is dropped from the prefix cache of every group
      it names a block of (`jenga.allocator.JengaAllocator.uncache_blocks`); on VMM
      ranges ids repeat across groups, so an id drops that block in each of them (more
      than vLLM drops, never less).
    - Mamba boundary states ("align" mode): each state committed at a block boundary is
      offered once to the connector (`offer_boundary_states`, drained by
      `take_offers`), as vLLM's manager offers the snapshots it caches.
    - Divergent hybrid hits (a connector with ``supports_divergent_local_hybrid_hits``):
      the manager's `get_computed_blocks_for_connector` may hit past the cached Mamba
      states (``hit_diverged``); the external tokens then follow that hit and the Mamba
      group's fresh block at their end is the one the connector fills.
    - Failed loads: `record_blocks_for_zeroing` queues the attention blocks past the
      valid prefix for the worker to zero (`take_new_block_ids`), as vLLM's manager
      does when the KV cache needs zeroing; the recompute that follows writes them.

Limitations
    Partial-tail offloads (a KV producer's sub-block Mamba tails) belong to vLLM's "align"
    sub-block hits, which the jenga manager does not make (``enable_partial_hash_hits``
    is False): none are offered. The block pool serves the scheduler's calls, not vLLM's
    `BlockPool` internals. Under decode context parallelism block sizes are the scaled
    ones the manager uses (`integrations.vllm.layout`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jenga.allocator import NULL_BLOCK
from jenga.errors import InvalidInput
from jenga.prefix import digest_identities
from jenga.specs import Kind

from integrations.vllm.compat import KVCacheBlock, KVCacheBlocks, kv_connector_base_class
from integrations.vllm.errors import InvalidTruncation, UnsupportedFeature
from integrations.vllm.slots import SlotError

if TYPE_CHECKING:
    from integrations.vllm.compat import Request

JengaKVCacheManager = Any
"""The `integrations.vllm.manager.JengaKVCacheManager` these functions serve (not imported:
the manager imports this module)."""


@dataclass(frozen=True, slots=True)
class ParkedRequest:
    """The allocator id of a finished request's blocks kept for a connector."""

    request_id: Hashable
    serial: int


Offer = tuple[int, int, int]
"""A Mamba boundary state offered to a connector: (group, vLLM block id, boundary tokens)."""


@dataclass(slots=True)
class ConnectorState:
    """What the manager keeps for connectors: parked requests by the id of each block
    object handed out for them, the next parked serial, block ids queued for zeroing;
    the Mamba groups whose boundary states are offered ("align" mode), per request the
    blocks of each looked at so far and the offers not yet taken."""

    parked: dict[int, ParkedRequest] = field(default_factory=dict)
    num_parked: int = 0
    live_parked: set[ParkedRequest] = field(default_factory=set)
    to_zero: list[int] = field(default_factory=list)
    mamba_groups: tuple[int, ...] = ()
    offered: dict[Hashable, list[int]] = field(default_factory=dict)
    offers: dict[Hashable, list[Offer]] = field(default_factory=dict)

    def forget(self, request_id: Hashable) -> None:
        """The request left the manager: its offers not yet taken go (vLLM's rule: an
        offer holds committed bytes only while the request holds the block)."""
        self.offered.pop(request_id, None)
        self.offers.pop(request_id, None)

    def retag(self, request_id: Hashable, group: int, block_id: int, tokens: int) -> None:
        """An offered block holds the state after ``tokens`` tokens, not its boundary's
        (an internal prefill checkpoint: `integrations.vllm.partial_hits`)."""
        entries = self.offers.get(request_id, [])
        for i, (g, b, _) in enumerate(entries):
            if (g, b) == (group, block_id):
                entries[i] = (g, b, tokens)

    def offer(self, request_id: Hashable, entries: list[Offer]) -> None:
        """Offer states kept elsewhere (a sub-block tail moved off the running block:
        `integrations.vllm.partial_hits`), taken with the boundary states."""
        if entries:
            self.offers.setdefault(request_id, []).extend(entries)


def new_state(manager: JengaKVCacheManager) -> ConnectorState:
    """The connector state of a new manager; boundary states are offered in "align"
    mode only (states written where a step ends, as vLLM's manager offers them)."""
    layout = manager.layout
    align = layout.allocator_config.mamba_step_end_only
    mamba = tuple(g for g, grp in enumerate(layout.groups) if grp.kind is Kind.MAMBA)
    return ConnectorState(mamba_groups=mamba if align else ())


def offer_boundary_states(manager: JengaKVCacheManager, request_id: str, computed: int) -> None:
    """Offer the request's Mamba states at block boundaries within ``computed`` tokens
    (the ones just committed with the step that writes them), each once."""
    state = manager._connector
    done = state.offered.setdefault(request_id, [0] * len(state.mamba_groups))
    ids = None
    for i, g in enumerate(state.mamba_groups):
        size = manager.layout.groups[g].block_size
        stop = computed // size
        if stop <= done[i]:
            continue
        if ids is None:
            ids = manager.get_block_ids(request_id)
        null = manager._block_ids.null_blocks[g].block_id
        row = ids[g]
        new = [
            (g, row[j], (j + 1) * size)
            for j in range(done[i], min(stop, len(row)))
            if row[j] != null
        ]
        if new:
            state.offers.setdefault(request_id, []).extend(new)
        done[i] = stop


def take_offers(manager: JengaKVCacheManager) -> dict[str, list[Offer]]:
    """The offers since the last call, by request id (drained)."""
    state = manager._connector
    offers, state.offers = state.offers, {}
    return {str(rid): entries for rid, entries in offers.items()}


class ConnectorBlockPool:
    """The ``block_pool`` vLLM's scheduler and connectors read, over the jenga manager.

    Only what the scheduler and the served connectors call; vLLM's pool internals (free
    counts, free queue, hash map) are not here: reading them raises AttributeError.
    """

    def __init__(self, manager: JengaKVCacheManager) -> None:
        self._manager = manager

    @property
    def hash_block_size(self) -> int:
        """Tokens per vLLM block hash (the request's ``block_hashes``)."""
        return int(self._manager.hash_block_size)

    @property
    def null_block(self) -> KVCacheBlock:
        """Group 0's null block (every group's null on vLLM's shared tensors)."""
        return self._manager._block_ids.null_blocks[0]

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Return blocks `pop_blocks_for_free` handed out: each parked request whose
        blocks these are is freed once; blocks kept for block copies
        (`integrations.vllm.partial_hits`) are let go. Others raise ValueError."""
        partial = self._manager._partial
        free_parked(self._manager, blocks if partial is None else partial.release(blocks))

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._manager.evict_blocks(block_ids)


class CachedBlockLookup:
    """The ``block_pool`` of each group in the coordinator view: what vLLM 0.33's
    routed-experts connector asks of it, whether the block a vLLM hash names is cached.

    Kept apart from `ConnectorBlockPool` so that code reading vLLM's pool internals
    through ``kv_cache_manager.block_pool`` (its hash map included) still fails by name.
    """

    def __init__(self, manager: JengaKVCacheManager) -> None:
        self._manager = manager

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """Per group the cached block whose last hash block is ``block_hash`` (vLLM's
        rule for a group block spanning several hash blocks), or None when any group
        has none in its prefix cache (live requests' committed blocks included)."""
        manager = self._manager
        try:
            identity = digest_identities([block_hash], 1, 1, 0, 1)
        except InvalidInput:  # shorter than the 16 bytes an identity takes: never indexed
            return None
        found = []
        for g in kv_cache_group_ids:
            if not 0 <= g < manager.num_kv_cache_groups:
                raise IndexError(
                    f"KV-cache group {g} out of range [0, {manager.num_kv_cache_groups})"
                )
            block = int(manager.allocator.lookup(g, identity)[0])
            if block < 0:
                return None
            tables: list[list[int]] = [[] for _ in range(manager.num_kv_cache_groups)]
            tables[g] = [block]
            found.append(manager._block_ids.rows(tables)[g][0])
        return found


def external_then_new(
    manager: JengaKVCacheManager,
    request: Request,
    external: int,
    target: int,
    processed: int,
    lookahead: int = 0,
) -> tuple[tuple[int, ...], ...] | None:
    """Slots up to ``target`` tokens (the last ``lookahead`` a draft's) for a
    just-admitted request, the ``external`` connector tokens in a call of their own
    first; per group the new blocks, or None with the external slots given back by the
    caller (it releases the request)."""
    rid = request.request_id
    held = manager.allocator.num_tokens(rid)
    past_main = max(0, held + external - (target - lookahead))
    first = manager._allocate(request, external, processed, past_main)
    if first is None:
        return None
    rest = target - held - external
    if rest <= 0:
        return first
    second = manager._allocate(request, rest, processed, lookahead)
    if second is None:
        return None
    return tuple(a + b for a, b in zip(first, second, strict=True))


def park_request(manager: JengaKVCacheManager, request: Request) -> list[KVCacheBlock]:
    """Free ``request`` for the scheduler but keep its blocks until they come back
    through ``block_pool.free_blocks``; its live blocks, in allocation order."""
    rid = request.request_id
    if rid not in manager._requests:
        return []
    tables = [manager.allocator.block_table(rid, g) for g in range(manager.num_kv_cache_groups)]
    live = [[b for b in t if b != NULL_BLOCK] for t in tables]
    if not any(live):
        manager._release(rid)
        return []
    state = manager._connector
    parked = ParkedRequest(rid, state.num_parked)
    manager.allocator.fork(rid, [parked])
    state.num_parked += 1
    manager._release(rid)
    state.live_parked.add(parked)
    rows = manager._block_ids.rows(live)
    blocks = [KVCacheBlock(b.block_id) for row in rows for b in row]
    for b in blocks:
        state.parked[id(b)] = parked
    return blocks


def free_parked(manager: JengaKVCacheManager, blocks: Iterable[KVCacheBlock]) -> None:
    """Free each parked request named by ``blocks`` (once, however many of its blocks
    come back; a later block of an already freed one is ignored)."""
    state = manager._connector
    for block in blocks:
        parked = state.parked.pop(id(block), None)
        if parked is None:
            raise ValueError(
                f"block {block.block_id} was not handed out by pop_blocks_for_free "
                f"({len(state.parked)} such blocks are outstanding)"
            )
        if parked in state.live_parked:
            state.live_parked.discard(parked)
            manager._apply_plan(manager.allocator.free(parked))


def record_for_zeroing(manager: JengaKVCacheManager, request_id: str, start_token: int) -> None:
    """Queue the request's attention blocks from ``start_token`` on for zeroing (vLLM's
    rule: only when the KV cache needs zeroing; ``start_token`` block-aligned)."""
    config = manager.kv_cache_config
    if config is None or not getattr(config, "needs_kv_cache_zeroing", False):
        return
    if request_id not in manager._requests:
        return
    ids = manager.get_block_ids(request_id)
    for g, group in enumerate(manager.layout.groups):
        if group.kind is Kind.MAMBA:
            continue
        if start_token % group.block_size:
            raise ValueError(
                f"request {request_id!r}: zeroing from token {start_token}, not a multiple "
                f"of group {g}'s block size {group.block_size}"
            )
        nulls = manager._block_ids.null_blocks[g].block_id
        row = ids[g][start_token // group.block_size :]
        manager._connector.to_zero.extend(b for b in row if b != nulls)


def record_new_for_zeroing(
    manager: JengaKVCacheManager,
    request_id: str,
    blocks: KVCacheBlocks,
    call: dict[str, Any],
    loaded_upto: int,
) -> KVCacheBlocks:
    """Queue the attention blocks just allocated to ``request_id`` for zeroing, as vLLM's
    manager does when the KV cache needs it (mixed precision, Mamba); in the groups of
    ``call["skip_zeroing_group_ids"]`` (``call``: `allocate_slots`' other arguments) the
    blocks below ``loaded_upto`` tokens are left alone (an asynchronous load writes
    them). ``blocks``: the new blocks `allocate_slots` returns; returned as they are."""
    config = manager.kv_cache_config
    if config is None or not getattr(config, "needs_kv_cache_zeroing", False):
        return blocks
    skip = set(call.get("skip_zeroing_group_ids", ()))
    for g, group in enumerate(manager.layout.groups):
        row = blocks.blocks[g]
        if group.kind is Kind.MAMBA or not row:
            continue
        if g in skip:  # the new blocks end the request's table
            first = len(manager.allocator.block_table(request_id, g)) - len(row)
            loaded = -(-loaded_upto // group.block_size)
            row = row[max(0, loaded - first) :]
        manager._connector.to_zero.extend(b.block_id for b in row if not b.is_null)
    return blocks


def truncated(
    manager: JengaKVCacheManager, blocks: KVCacheBlocks, num_computed_tokens: int
) -> KVCacheBlocks:
    """A hit's blocks cut at ``num_computed_tokens`` (block-aligned in every group, and
    covered by every group's blocks but a Mamba group's, whose state a connector may
    load instead); `InvalidTruncation` otherwise."""
    rows = []
    for g, (row, group) in enumerate(zip(blocks.blocks, manager.layout.groups, strict=True)):
        keep = num_computed_tokens // group.block_size
        if num_computed_tokens % group.block_size:
            raise InvalidTruncation(
                f"truncating a hit at {num_computed_tokens} tokens: not a multiple of "
                f"group {g}'s block size {group.block_size}"
            )
        if len(row) < keep and group.kind is not Kind.MAMBA:
            raise InvalidTruncation(
                f"truncating a hit at {num_computed_tokens} tokens: group {g} holds "
                f"{len(row)} blocks of {group.block_size} tokens"
            )
        rows.append(list(row[:keep]))
    return manager.create_kv_cache_blocks(tuple(rows))


def bind_connector(manager: JengaKVCacheManager, kv_connector: object) -> None:
    """Bind vLLM's scheduler-side connector (built against vLLM's own manager) to
    ``manager``, refusing with `UnsupportedFeature` one that drives vLLM's `BlockPool` or
    coordinator internals (the message names the connector and what it reads)."""
    problems = list(_connector_problems(kv_connector))
    if problems:
        raise UnsupportedFeature(
            "the jenga KV-cache manager does not support the KV connector(s) "
            + "; ".join(problems)
            + " (supported: connectors that use the scheduler's connector interface, e.g. "
            "vLLM's OffloadingConnector offloading every group, P/D and LMCache connectors)"
        )
    manager.bind_connector()
    kv_connector.bind_kv_cache_manager(manager)  # type: ignore[attr-defined]


def _connector_problems(kv_connector: object) -> Iterable[str]:
    children = getattr(kv_connector, "_connectors", None)
    if children is not None:  # vLLM's MultiConnector: each child binds on its own
        for child in children:
            yield from _connector_problems(child)
        return
    base = kv_connector_base_class()
    cls = type(kv_connector)
    name = cls.__name__
    if cls.bind_gpu_block_pool is not base.bind_gpu_block_pool:  # type: ignore[attr-defined]
        yield f"{name} (it drives vLLM's own GPU block pool: bind_gpu_block_pool)"
    elif cls.bind_kv_cache_manager is not base.bind_kv_cache_manager:  # type: ignore[attr-defined]
        yield f"{name} (it reads vLLM's KV-cache manager internals: bind_kv_cache_manager)"
    elif getattr(kv_connector, "_bounding_group_ids", ()):
        yield (
            f"{name} offloading only some KV-cache groups (it bounds its loads by vLLM's "
            "hybrid coordinator's per-group hits)"
        )


def evict_by_id(manager: JengaKVCacheManager, block_ids: Iterable[int]) -> None:
    """Drop the blocks these vLLM ids name from the prefix cache, in every group."""
    ids = sorted(set(block_ids))
    for g, group in enumerate(manager.layout.groups):
        blocks = []
        for vllm_id in ids:
            if vllm_id == group.null_block_id:
                continue
            try:
                block = manager._block_ids.allocator_block(g, vllm_id)
            except SlotError:
                continue  # a slot of another group (vLLM's shared tensors)
            if 0 <= block < group.capacity:
                blocks.append(block)
        if not blocks:
            continue
        if manager.identity.events_on:
            manager.identity.forget(
                g, [b for b in blocks if manager.allocator.is_cached_block(g, b)]
            )
        manager._apply_plan(manager.allocator.uncache_blocks(g, blocks))
