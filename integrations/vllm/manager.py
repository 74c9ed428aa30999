"""A vLLM 0.32 and 0.33 KV-cache manager backed by the Jenga allocator.

Rationale
    vLLM's hybrid manager pads every group's page to one size and shares one block
    pool, so a Mamba state or a small sliding-window page costs as much as the largest
    page, and a prefix hit is whatever each group's own LRU left behind. Jenga evicts
    aligned across groups (prefix-subset eviction), so the same memory keeps longer
    common prefixes; on VMM tensors it also gives each group its own unpadded large pages
    (k chunks per layer range) and allocates request-aware, so hybrid models with small
    Mamba or window pages fit more requests.

Approach
    `JengaKVCacheManager` offers the methods vLLM's `Scheduler` calls on its
    ``kv_cache_manager`` and translates them to `jenga.allocator.JengaAllocator`:

    ============================  ==============================================
    vLLM call                     jenga
    ============================  ==============================================
    get_computed_blocks           prefix_match + digest check (kept for the admission)
    allocate_slots (new request)  add_request (adopts that match) + allocate
    allocate_slots (running)      allocate for the tokens past what it holds
    cache_blocks                  append_tokens + cache (hash complete blocks)
    free                          free (hashed blocks stay cached, evictable)
    get_blocks / get_block_ids    block_table per group (released → null block)
    ============================  ==============================================

    Like vLLM, blocks are committed to the prefix cache when they are allocated for
    tokens about to be computed, so a request admitted later in the same step can hit
    them. Every allocator call that changes physical needs returns its plan; the manager
    replays the plan's raw op keys into its tables (`_apply_plan`: no op object is
    built), and only with ``kv_tensors="vmm"`` queues the plan in order for the worker's
    VMM tensors (`take_mapping_plans`; `integrations.vllm.scheduler` attaches them to
    each `SchedulerOutput`). A request's tokens reach the allocator only when one of its
    blocks can complete.

    Block ids: one strategy per tensor geometry, picked at construction
    (`integrations.vllm.block_ids`). With vLLM's own KV tensors (``pages="vllm"``, the
    default) every group overlays one buffer, so each mapped allocator page gets a vLLM
    block slot of its own (`integrations.vllm.slots.SharedSlots`, driven by the same plan
    ops); with VMM tensors (``pages="vmm"``) the allocator's ids are used as they are
    (per_layer geometry) or spread so that page ``q`` starts at id ``q*M`` (per_group
    geometry, `integrations.vllm.placement`).

    Per-request state: the allocator's record (its tables, its length) is read through
    the allocator's methods; the manager keeps beside it, in one `_RequestState` per
    live request, only what vLLM adds (how far the request's token ids are final, when
    the next commit can name a block, which blocks the KV events have seen).

    Blocks that leave a sliding window / local chunk (and old Mamba states) are released
    as vLLM releases them: in `allocate_slots` and `remove_skipped_blocks`, only those out
    of the window as of the tokens whose step has finished (``num_computed_tokens -
    num_in_flight_tokens``), so under asynchronous scheduling a block the in-flight step
    still reads is not handed to another request before that step's output is processed
    (`JengaAllocator.allocate`'s ``release_upto``).

    Null blocks: a released entry (out of the window, an old Mamba state) is shown as
    a `KVCacheBlock` with ``is_null=True`` and the group's null id (0 on vLLM's tensors,
    ``capacity`` on VMM ranges; see `integrations.vllm.layout`), never a live id.

    Block identity is vLLM's (`integrations.vllm.identity`): hits are verified block by
    block against the request's own ``block_hashes``; the same registry produces the KV
    events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). Only computed
    tokens enter the cache (a sampled token vLLM may still replace never does). The
    ``full_sequence_must_fit`` gate (vLLM's ``scheduler_reserve_full_isl``) uses
    `blocks_needed`, which also answers the coordinator view
    (`integrations.vllm.coordinator`) the engine reads.

Limitations
    Prefix lookups and block tables: `integrations.vllm.lookup`. KV connectors:
    `integrations.vllm.connector`; speculative decoding: `integrations.vllm.speculative`;
    sub-block Mamba hits: `integrations.vllm.partial_hits`.
    No watermark. `get_computed_blocks` returns the hit's blocks as vLLM does (the tables
    of one prefix lookup); `allocate_slots` adopts that lookup (or looks up again when a
    call that may evict ran in between). The
    ``full_sequence_must_fit`` gate is an estimate in allocator units (free units plus
    whole pages of evictable blocks), not vLLM's block count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from jenga.allocator import NULL_BLOCK, JengaAllocator, PrefixMatch
from jenga.pages import capacity_units
from jenga.plan import OP_UNMAP, MappingPlan
from jenga.specs import Kind

from integrations.vllm import connector, partial_hits
from integrations.vllm.block_ids import VmmSlotBlockIds, new_block_ids
from integrations.vllm.compat import (
    AllBlocksCleared,
    KVCacheBlock,
    KVCacheBlocks,
    KVCacheEvent,
    PrefixCacheStats,
    Request,
)
from integrations.vllm.coordinator import CoordinatorView
from integrations.vllm.errors import JengaVllmError, UnsupportedFeature
from integrations.vllm.identity import DigestRegistry, request_salt
from integrations.vllm.layout import JengaLayout
from integrations.vllm.lookup import PrefixLookup, digests_of
from integrations.vllm.speculative import SpeculativeSetup, marked_eagle_groups

if TYPE_CHECKING:
    from integrations.vllm.compat import KVCacheConfig


@dataclass(slots=True)
class _RequestState:
    """What the manager keeps of a live request beside the allocator's record.

    ``grow_held``: the allocator's `grow` of this request for a step that needs no core
    call (`JengaAllocator.held_step`, bound once; the held-step fast path). ``num_known``:
    the request's tokens whose ids are final (the prompt, then computed tokens; a sampled
    token vLLM may still replace is not), so `_cache` commits no block past them.
    ``next_cache``: the computed length below which `_cache` has nothing to commit.
    ``recorded`` (KV events on): per group, the leading blocks the event registry has
    looked at. Nothing here repeats the allocator's record (tables, length, hit).
    """

    grow_held: Callable[[int], bool]
    num_known: int
    next_cache: int = 0
    recorded: list[int] | None = None


class JengaKVCacheManager(PrefixLookup):
    """The Scheduler-facing surface of vLLM's `KVCacheManager`, on a `JengaAllocator`.

    Invariants: a request is in ``_requests`` exactly while the allocator holds it (a
    request parked for a connector is held under its `connector.ParkedRequest` id); block
    objects are interned per (group, id) so identity comparisons in the scheduler behave.
    """

    def __init__(
        self,
        layout: JengaLayout,
        *,
        enable_caching: bool = True,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        kv_cache_config: KVCacheConfig | None = None,
        hash_block_size: int | None = None,
        speculative: SpeculativeSetup | None = None,
        shared_prefix: bool = False,
    ) -> None:
        self.layout = layout
        self.speculative = speculative or SpeculativeSetup()
        self.max_model_len = layout.model.max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(layout.groups)
        self.hash_block_size = hash_block_size or min(g.block_size for g in layout.groups)
        # sub-block Mamba hits (`integrations.vllm.partial_hits`): vLLM's coordinator flag
        self.enable_partial_hash_hits = partial_hits.enabled(
            layout, self.hash_block_size, enable_caching, self.speculative
        )
        # vLLM's shared-prefix (junction) checkpoints: a state kept where a sibling resumes
        self.mamba_shared_prefix_checkpoint = partial_hits.junctions_on(
            self.enable_partial_hash_hits, self.speculative, kv_cache_config, shared_prefix
        )
        self.kv_cache_config = kv_cache_config
        self._partial = partial_hits.PartialHits(self) if self.enable_partial_hash_hits else None
        self.allocator: JengaAllocator = self._new_allocator()
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in layout.groups))
        self._requests: dict[Hashable, _RequestState] = {}  # the live ones
        self._block_ids = new_block_ids(layout)
        self._plans: list[MappingPlan] = []
        # encoder-decoder: the encoder input is not in the decoder prompt (cross groups)
        self._encoder_side = any(g.kind is Kind.CROSS_ATTENTION for g in layout.groups)
        # text groups commit blocks only at multiples of their block sizes: between two
        # multiples of their gcd `_cache` has nothing to commit (0: images commit at
        # their end, call every time); `_RequestState.next_cache`: the next length to try
        sizes = [g.block_size for g in layout.groups] + [self.hash_block_size] * bool(self._partial)
        self._cache_step = 0 if self._encoder_side else math.gcd(*sizes)
        # only VMM tensors consume plans (`JengaScheduler` ships them to the worker)
        self._queue_plans = layout.options.vmm_tensors
        self._events: list[KVCacheEvent] = []
        self.identity = DigestRegistry(layout, self.hash_block_size, enable_kv_cache_events)
        self.identity.lookahead_tokens = self.speculative.num_hash_lookahead_tokens
        self.enable_kv_cache_events = enable_kv_cache_events
        # the last lookup (request id, match), adopted by that request's admission
        self._last_match: tuple[Hashable, PrefixMatch] | None = None
        self.counters = {"requests.admitted": 0, "requests.rejected": 0, "prefix.hit_tokens": 0}
        self._connector = connector.new_state(self)
        # what vLLM's scheduler, KV connectors and routed-experts connector read
        self.block_pool = connector.ConnectorBlockPool(self)

    @property
    def enable_kv_cache_events(self) -> bool:
        return self.identity.events_on

    @enable_kv_cache_events.setter
    def enable_kv_cache_events(self, on: bool) -> None:
        self.identity.events_on = on

    # -- stats ------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of the KV-cache bytes held by live requests' blocks (0.0 .. 1.0)."""
        use = self.allocator.usage()
        used = sum(
            n * g.block_bytes for n, g in zip(use.used_blocks, self.layout.groups, strict=True)
        )
        return (
            used * self.layout.total_units / (self.layout.memory_bytes * self.allocator.total_units)
        )

    @property
    def committed_bytes(self) -> int:
        """Bytes the KV tensors back now: on VMM pages the chunks mapped (per group / per
        layer: the allocator's mapped units; the slots geometry: the chunks its mapped
        slots and the null slot touch), on vLLM's own tensors vLLM's whole buffer."""
        if isinstance(self._block_ids, VmmSlotBlockIds):
            return self._block_ids.committed_bytes
        if not self.layout.options.tensor_geometry.on_vmm_ranges:
            return self.layout.memory_bytes
        return self.allocator.usage().used_units * self.layout.options.chunk_bytes

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    @property
    def coordinator(self) -> CoordinatorView:
        """The coordinator-level metadata vLLM's engine and scheduler read."""
        if self.kv_cache_config is None:
            raise AttributeError(
                "this JengaKVCacheManager was built without kv_cache_config, so it has no "
                "coordinator view (install_jenga_manager passes the scheduler's)"
            )
        lookup = connector.CachedBlockLookup(self)
        view = CoordinatorView(self.kv_cache_config, self.blocks_needed, self.layout.groups, lookup)
        view.enable_partial_hash_hits = self.enable_partial_hash_hits
        return view

    def blocks_needed(self, request_id: str, num_tokens: int, num_computed: int = 0) -> int:
        """Blocks (over all groups) the request must still get to hold ``num_tokens``."""
        live = request_id if request_id in self._requests else None
        return sum(self.allocator.blocks_to_hold(num_tokens, live))

    def _fits(self, request_id: str, num_tokens: int, reserved_units: int = 0) -> bool:
        """Whether ``num_tokens`` of the request fit now, leaving ``reserved_units`` to
        others: the allocator's answer (`JengaAllocator.fits`)."""
        live = request_id if request_id in self._requests else None
        return self.allocator.fits(num_tokens, live, reserved_units=reserved_units)

    def stats(self) -> dict[str, int]:
        """The allocator's dotted counters plus ``requests.*`` of this manager."""
        out = self.allocator.stats()
        out.update(self.counters)
        return out

    # -- allocation -------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        **_ignored: object,
    ) -> KVCacheBlocks | None:
        """New blocks for ``num_new_tokens`` (+ lookahead), or None (no room, or `partial_hits`
        defers the hit): a request admitted by this call is released again, a running one
        keeps what it had but the blocks it no longer reads (released as vLLM does). New
        blocks are queued for zeroing as vLLM's (``skip_zeroing_group_ids`` in ``_ignored``)."""
        state = self._requests.get(request.request_id)
        if self._partial is not None and not self._partial.step_starts(request, state):
            return None
        extra = num_new_computed_tokens or num_external_computed_tokens or delay_cache_blocks
        extra = extra or num_encoder_tokens or full_sequence_must_fit or reserved_blocks
        if not extra and self._step_within_held(
            state, request, num_new_tokens, num_lookahead_tokens
        ):
            return self.empty_kv_cache_blocks
        known = num_new_computed_tokens + num_external_computed_tokens
        self._check_call(request, num_new_tokens, known, num_encoder_tokens)
        rid = request.request_id
        admitted = state is None
        state = state or self._admit(request, num_new_computed_tokens)
        whole = min(request.num_tokens, self.max_model_len)  # checked with the hit claimed
        if full_sequence_must_fit and not self._fits(rid, whole):
            return self._refused(rid, admitted)
        computed = request.num_computed_tokens + known  # hit and connector-loaded tokens
        target = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        need = target - self.allocator.num_tokens(rid)
        cache_upto = min(computed + num_new_tokens, request.num_tokens)
        processed = max(0, computed - request.num_in_flight_tokens)  # as vLLM: in flight
        room = need > 0 and self._reserves_room(rid, target, reserved_blocks)
        external = num_external_computed_tokens if admitted else 0
        ahead = max(0, target - computed - num_new_tokens)  # slots that hold no Mamba state
        # vLLM's internal prefill checkpoint (`partial_hits`): a block below the running state
        ckpt = self._partial.checkpoint_for(request, computed, cache_upto) if self._partial else 0
        grow = (request, need, target, processed, external, ahead, bool(ckpt))
        new_blocks = self._grow(*grow) if room else None
        if need > 0 and new_blocks is None:
            return self._refused(rid, admitted, processed)
        if self.enable_caching and not delay_cache_blocks:  # delayed: cached once loaded
            self._cache(request, state, cache_upto)
        if ckpt and self._partial is not None:
            self._partial.name_checkpoint(rid, ckpt, cache_upto)
        if new_blocks is None or new_blocks is self.allocator.no_blocks:
            return self.empty_kv_cache_blocks  # decode within held blocks: nothing new
        blocks = self._blocks_of(new_blocks)
        return connector.record_new_for_zeroing(self, rid, blocks, _ignored, computed)

    def _refused(
        self, rid: str, admitted: bool, processed: int | None = None
    ) -> KVCacheBlocks | None:
        """`allocate_slots`' "no room": a request admitted by the call is released again;
        a running one keeps its blocks but, as vLLM frees them even when the request cannot
        grow, those skipped as of ``processed`` tokens (None: none)."""
        if admitted:
            self._release(rid)
        elif processed is not None:
            self._apply_plan(self.allocator.release_skipped(rid, release_upto=processed))
        self.counters["requests.rejected"] += 1
        return None

    def _check_call(self, request: Request, new: int, new_computed: int, encoder: int) -> None:
        """`allocate_slots`' refusals: encoder tokens without a cross-attention group, a
        call with no tokens at all (``new_computed``: local hit plus connector tokens)."""
        if encoder and not self._encoder_side:
            raise JengaVllmError(
                f"request {request.request_id!r}: {encoder} encoder tokens, but the "
                "KV-cache config has no cross-attention group to hold them"
            )
        if new == 0 and new_computed == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no computed tokens")

    def _step_within_held(
        self, state: _RequestState | None, request: Request, num_new_tokens: int, lookahead: int
    ) -> bool:
        """A running request's plain step answered from the allocator's record: True (the
        step is done, caching included) when its slots are held and nothing leaves a
        window; False (nothing changed) when `allocate_slots` must do the full work."""
        if state is None or num_new_tokens <= 0:  # not admitted yet / nothing to add
            return False
        computed = request.num_computed_tokens
        target = min(computed + num_new_tokens + lookahead, self.max_model_len)
        if not state.grow_held(target):
            return False
        upto = computed + num_new_tokens
        if self.enable_caching and upto >= state.next_cache:
            self._cache(request, state, min(upto, request.num_tokens))
        return True

    def _reserves_room(self, rid: str, target: int, reserved_blocks: int) -> bool:
        """Whether ``target`` tokens fit with ``reserved_blocks`` vLLM block slots left
        free for other in-flight requests (vLLM's async KV-load gate; "vllm" pages only)."""
        if not reserved_blocks:
            return True
        if not self._block_ids.sizes_slots:
            raise UnsupportedFeature(
                f"reserved_blocks={reserved_blocks} (async KV-connector loads) on VMM pages: "
                "a vLLM block slot has no size there"
            )
        return self._fits(rid, target, reserved_blocks)

    def _grow(
        self,
        request: Request,
        need: int,
        target: int,
        processed: int,
        external: int,
        lookahead: int,
        checkpoint: bool = False,
    ) -> tuple[tuple[int, ...], ...] | None:
        """`_allocate` of ``need`` tokens, the last ``lookahead`` of ``target`` a draft's
        slots; a just-admitted request's ``external`` connector tokens first, in a call
        of their own (`connector.external_then_new`)."""
        if external:
            return connector.external_then_new(
                self, request, external, target, processed, lookahead
            )
        return self._allocate(request, need, processed, lookahead, checkpoint)

    def _allocate(
        self, request: Request, need: int, processed: int, lookahead: int = 0, ckpt: bool = False
    ) -> tuple[tuple[int, ...], ...] | None:
        """Slots for ``need`` more tokens in one all-or-nothing allocator call, releasing
        the blocks out of the window as of ``processed`` tokens.

        Per group the new block ids, or None with nothing changed. The layout configures
        Mamba groups with ``mamba_step_end_only`` (vLLM writes a state only where a chunk
        ends), so a long chunk holds the state it starts from and the one it ends at, and
        does not count the ``lookahead`` slots. A Mamba group's rows are every entry the
        call appended (NULL skips and moved speculative states too), as vLLM's worker
        appends them to its block table.
        """
        rid = request.request_id
        got = self.allocator.allocate(
            rid, need, release_upto=processed, lookahead=lookahead, checkpoint=ckpt
        )
        if got is None:
            return None
        self._apply_plan(got.plan)
        if got.copies and self._partial is not None:
            self._partial.queue(got.copies)
        if self.identity.events_on:
            for g, ids in enumerate(got.new_blocks):
                if ids and self.identity.digest[g]:
                    self.identity.forget(g, ids)  # a recorded block handed out again
        return got.appended or got.new_blocks

    def _new_allocator(self) -> JengaAllocator:
        """The layout's allocator, naming text blocks by vLLM's own digests (one per
        ``hash_block_size`` tokens: one hash per block, vLLM's), sized by `_gated_units`."""
        config = self.layout.allocator_config
        identity = replace(config.identity, digest_block_size=self.hash_block_size)
        units = self._gated_units()
        proof = self.speculative.hit_proof(
            len(self.layout.groups), marked_eagle_groups(self.kv_cache_config)
        )
        unit = self.hash_block_size if self._partial is not None else None
        # vLLM's scheduler calls the manager from its one thread: no per-call guard
        allocator = replace(
            config, identity=identity, total_units=units, hit_proof=proof, state_unit=unit
        )
        return JengaAllocator(allocator, guard_threads=False)

    def _gated_units(self) -> int:
        """The units the allocator may map: the layout's, or on a shared pool the chunks
        the owner guarantees the tenant (``tenant_min_bytes``), so no plan the scheduler
        queues can fail at the worker for chunks the owner did not lend. More is handed to
        the allocator with `set_capacity` once the owner has lent it."""
        options = self.layout.options
        total = self.layout.total_units
        if not options.shared_pool:
            return total
        return min(total, capacity_units(options.tenant_min_bytes, options.chunk_bytes))

    def _apply_plan(self, plan: MappingPlan) -> None:
        """Every plan the allocator returns, in order: unmapped pages lose their identity,
        slots move (from the raw op keys), and only for a worker (VMM tensors) is the plan
        queued."""
        if not plan:
            return
        keys = plan.keys
        if self.identity.events_on:
            for kind, group, page, _ in keys:
                if kind == OP_UNMAP:
                    self.identity.forget_page(group, page)
        self._block_ids.apply_keys(keys)
        if self._queue_plans:
            self._plans.append(plan)

    def _admit(self, request: Request, num_new_computed_tokens: int) -> _RequestState:
        rid = request.request_id
        tokens = request.all_token_ids
        use_cache = self.prefix_cache_lookup_enabled(request) and num_new_computed_tokens > 0
        last, self._last_match = self._last_match, None
        hit = self.allocator.add_request(
            rid,
            tokens,
            images=self._images(request),
            salt=request_salt(request),
            use_cache=use_cache,
            match=last[1] if last is not None and last[0] == rid else None,
            digests=digests_of(request),
        )
        if hit != num_new_computed_tokens:
            self._apply_plan(self.allocator.free(rid))
            raise JengaVllmError(
                f"request {rid!r}: the scheduler adopted {num_new_computed_tokens} cached "
                f"tokens but the allocator's hit is {hit}"
            )
        state = _RequestState(self.allocator.held_step(rid), len(tokens))
        self._requests[rid] = state
        if self.identity.events_on:
            state.recorded = [
                sum(1 for b in self.allocator.block_table(rid, g) if b != NULL_BLOCK)
                for g in range(self.num_kv_cache_groups)
            ]
        self.counters["requests.admitted"] += 1
        self.counters["prefix.hit_tokens"] += hit
        return state

    def _release(self, rid: Hashable) -> None:
        self._apply_plan(self.allocator.free(rid))
        del self._requests[rid]
        self._connector.forget(rid)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Commit the hashes of the request's blocks complete within the computed tokens."""
        state = self._requests.get(request.request_id)
        if self.enable_caching and state is not None:
            self._cache(request, state, num_computed_tokens)

    def _cache(self, request: Request, state: _RequestState, num_computed_tokens: int) -> None:
        rid = request.request_id
        num_computed_tokens = self.speculative.cacheable(num_computed_tokens)
        if num_computed_tokens < state.next_cache:
            return  # no block of any group completes before then: tokens are handed later
        # only computed tokens: a sampled token not yet computed may still be replaced
        # (streaming-input sessions drop the chunk's last sampled token); the allocator
        # names blocks by the request's digests, so no token id is handed over
        upto = min(request.num_tokens, num_computed_tokens)
        if upto > state.num_known:
            state.num_known = upto
        limit = min(self.allocator.num_tokens(rid), state.num_known)
        computed = max(0, min(num_computed_tokens, limit))
        hashes: Sequence[bytes] | None = getattr(request, "block_hashes", None)
        added = self.allocator.cache(rid, computed, digests=() if hashes is None else hashes)
        if added and self.identity.events_on:
            self._record(request, state, computed)
        if self._partial is not None:
            self._partial.cache(request, computed)
        if self._connector.mamba_groups:
            connector.offer_boundary_states(self, rid, computed)
        if self._cache_step:
            # a block is named only once its digest exists: with lookahead hashes the
            # digests lag the computed tokens, so the next call must look again
            named = computed if hashes is None else len(hashes) * self.hash_block_size
            upto = min(computed, named)
            state.next_cache = (upto // self._cache_step + 1) * self._cache_step

    def _record(self, request: Request, state: _RequestState, computed: int) -> None:
        """Hand the registry the blocks this request just entered in the index (complete
        within ``computed`` tokens; blocks below ``state.recorded`` were looked at before)."""
        rid = request.request_id
        done = state.recorded
        if done is None:
            raise JengaVllmError(
                f"request {rid!r}: KV events were turned on after it was admitted, so its "
                "earlier blocks were never recorded"
            )
        hashes = getattr(request, "block_hashes", None)
        if hashes is not None:  # lookahead hashes: only blocks with a digest are named
            computed = min(computed, len(hashes) * self.hash_block_size)
        for g, group in enumerate(self.layout.groups):
            table = self.allocator.block_table(rid, g)
            stop = min(len(table), computed // group.block_size)
            new = {
                i: b
                for i in range(done[g], stop)
                if (b := table[i]) != NULL_BLOCK and self.allocator.is_cached_block(g, b)
            }
            if stop > done[g]:
                self.identity.record(request, g, new, done[g], stop)
            done[g] = max(done[g], stop)

    def free(self, request: Request) -> None:
        """Finish or preempt: hashed blocks stay cached; unknown requests are ignored."""
        if request.request_id in self._requests:
            if self._partial is not None:
                self._partial.forget(request)
            self._release(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Free the request for the scheduler, but keep its blocks until they come back
        through ``block_pool.free_blocks`` (an in-flight step may still write them); its
        live blocks in allocation order (`integrations.vllm.connector`)."""
        if self._partial is not None and request.request_id in self._requests:
            self._partial.forget(request)
        return connector.park_request(self, request)

    def bind_connector(self) -> connector.ConnectorBlockPool:
        """The ``block_pool`` vLLM's scheduler and connectors read (deferred frees, the
        null block, cached-block lookups by vLLM block hash)."""
        return self.block_pool

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Release the blocks out of the window as of ``processed_computed_tokens``."""
        if request_id in self._requests:
            self._apply_plan(
                self.allocator.release_skipped(request_id, release_upto=processed_computed_tokens)
            )

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these vLLM blocks from the prefix cache (a KV load left them bad); see
        `integrations.vllm.connector.evict_by_id`."""
        connector.evict_by_id(self, block_ids)

    def set_capacity(self, num_units: int) -> None:
        """Grow or shrink the KV cache to ``num_units`` units (chunks on VMM tensors, block
        slots on vLLM's own), at most the layout's ``total_units`` (what the ranges or
        vLLM's buffer hold). The allocator owns the count (`JengaAllocator.set_total_units`):
        a shrink evicts cached pages first and below what live requests hold raises
        `jenga.errors.CapacityInUse` with nothing changed. On VMM tensors the worker's pool
        follows through the plan queue (`MappingPlan.resize`, after the evictions)."""
        limit = self.layout.total_units
        if not 0 < num_units <= limit:
            raise JengaVllmError(
                f"capacity {num_units} units is outside (0, {limit}]: the layout holds {limit}"
            )
        self._apply_plan(self.allocator.set_total_units(num_units))
        if self._queue_plans:
            self._plans.append(MappingPlan(resize_units=num_units))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while any request holds blocks."""
        if self._requests or self._connector.live_parked:
            return False
        units = self.allocator.total_units
        self.allocator = self._new_allocator()
        # a capacity set at run time stays
        if units != self.allocator.total_units:
            self.allocator.set_total_units(units)
        self._last_match = None
        self._block_ids.reset()
        if self._partial is not None:
            self._partial.reset()
        self.identity.clear()
        if self._queue_plans:
            self._plans.append(MappingPlan.unmap_all())
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    # -- per-step hand-offs -------------------------------------------------------------
    def new_step_starts(self) -> None:
        """A new step: states named in the last one are filled (`partial_hits`)."""
        if self._partial is not None:
            self._partial.new_step()

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return self.identity.take_events() + events

    def take_mapping_plans(self) -> list[MappingPlan]:
        """Plans since the last call, in order (`MappingPlan.reset` / `resize_units` mark a
        prefix-cache reset and a capacity change)."""
        plans, self._plans = self._plans, []
        return plans

    def take_new_block_ids(self) -> list[int]:
        """Block ids queued for zeroing (`record_blocks_for_zeroing`), drained."""
        ids, self._connector.to_zero = self._connector.to_zero, []
        return ids

    def take_kv_cache_block_copies(self) -> tuple[list[object], list[KVCacheBlock]]:
        """Block copies for the worker to run before this step's forward (sub-block Mamba
        states), and the blocks kept for them until ``block_pool.free_blocks``."""
        return ([], []) if self._partial is None else self._partial.take()

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba boundary states (vLLM's "align" mode) committed since the last call, for
        a KV connector to offload: ``{request id: [(group, block id, boundary tokens)]}``
        (`integrations.vllm.connector.offer_boundary_states`)."""
        return connector.take_offers(self)

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """A finishing KV producer's sub-block Mamba tails still in its running blocks
        (`partial_hits.PartialHits.finalize`): [(group, block id, tokens)], each once."""
        return [] if self._partial is None else self._partial.finalize(request)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Queue the blocks a failed KV load left unwritten, from ``start_token`` on."""
        connector.record_for_zeroing(self, request_id, start_token)

    def check_invariants(self, expensive: bool = False) -> None:
        """The allocator's checks plus: every live request is known to the allocator."""
        self.allocator.check_invariants(expensive)
        self._block_ids.check_invariants(self.allocator.usage().used_units)
        for rid in self._requests:
            self.allocator.num_tokens(rid)  # raises UnknownRequest if not live
