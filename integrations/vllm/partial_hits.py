"""vLLM's sub-block ("partial hash") prefix hits on Mamba "align" hybrids, on jenga.

Rationale
    vLLM 0.32/0.33 hash prompts in blocks of ``hash_block_size`` tokens, smaller than
    a Mamba "align" block (the interval between cached states). Its scheduler ends the
    prompt's chunk at the last hash boundary below the prompt end (the prompt's tail
    checkpoint) when ``coordinator.enable_partial_hash_hits`` says the manager keeps the
    Mamba state there, so a later request sharing the prompt resumes at that boundary
    instead of the Mamba block below it.

Approach
    `enabled` decides it as vLLM does where jenga can serve it: a Mamba group whose block
    is a multiple of ``hash_block_size`` larger than it (or equal, under decode context
    parallelism), every other group that caches either on the hash grid (blocks of
    ``hash_block_size``: jenga hits them whole) or full attention with blocks a
    multiple of it (decode CP's blocks span the ranks: ``block_size * dcp``), vLLM's own
    KV tensors (the worker runs vLLM's block copies). The allocator then keeps Mamba
    states and partial attention blocks at hash boundaries (`jenga.substates`,
    ``state_unit``).
    `PartialHits` is the manager's side:

    - a step whose computed tokens end at the prompt's tail checkpoint names the running
      state there, and the step that computes the prompt's last hash boundary names the
      larger attention block holding it (`JengaAllocator.cache_state`). With EAGLE's
      block drop the state is kept one hash block below that boundary (vLLM's
      ``get_mamba_prefill_checkpoint_position``) and the attention block named at the
      boundary proves the hit (the allocator's `jenga.config.HitProof`);
    - the request's next `allocate_slots` moves that name to a fresh block before its step
      overwrites the state (`JengaAllocator.move_state`), and a request that hits a
      state inside a block copies it into a block of its own on its first allocation
      (`JengaAllocator.allocate`'s copies);
    - the copies go to the worker through ``take_kv_cache_block_copies`` with the blocks
      kept for them; vLLM's scheduler hands those back through ``block_pool.free_blocks``
      once the copying step ran (`release`);
    - with vLLM's ``enable_mamba_shared_prefix_checkpoint`` (`junctions_on`) the state is
      also named where the prompt chunk being computed ends at the request's shared-prefix
      junction (`junction`): the scheduler stops there, so the next sibling resumes at it;
    - with Mamba checkpoint blocks (``num_prefill_checkpoint_blocks``) vLLM's worker
      writes the prompt's tail checkpoint state inside the last chunk, into the entry
      just below the running state (`checkpoint_for`): the allocator keeps a block there
      (``allocate(checkpoint=True)``) and it is named by that position
      (`JengaAllocator.cache_checkpoint`);
    - a state named or moved in this step is filled only by this step's forward or
      copy, so a request whose hit holds it is not admitted before the next step
      (`defers`), as vLLM defers it.

Limitations
    No KV events or connector offloads for states or attention blocks named inside a
    block (but a producer's tail state, `finalize`). No sparse retention: states at block
    boundaries stay cached where vLLM's retention interval 0 drops them. With MLA,
    sliding-window or chunked-local groups off the hash grid or VMM tensors the manager
    says ``enable_partial_hash_hits = False`` and hits whole blocks; internal checkpoint
    blocks are kept only with partial hits on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from jenga.policies import POLICY_BY_KIND
from jenga.requests import BlockCopy
from jenga.specs import Kind
from jenga.substates import append_only

from integrations.vllm.compat import KVCacheBlock, KVCacheBlockCopy, RequestStatus
from integrations.vllm.speculative import marked_eagle_groups

if TYPE_CHECKING:
    from integrations.vllm.compat import KVCacheConfig, Request
    from integrations.vllm.layout import JengaLayout
    from integrations.vllm.speculative import SpeculativeSetup

JengaKVCacheManager = Any
"""The `integrations.vllm.manager.JengaKVCacheManager` served (not imported: it imports
this module)."""


def enabled(
    layout: JengaLayout, hash_block_size: int, caching: bool, speculative: SpeculativeSetup
) -> bool:
    """Whether the manager serves hits at ``hash_block_size`` inside Mamba blocks."""
    groups = layout.groups
    mamba = [g for g in groups if g.kind is Kind.MAMBA]
    if not caching or layout.options.vmm_tensors:
        return False
    # vLLM's rule: a Mamba block above the hash block (at it, under decode CP)
    dcp = max(g.dcp_world_size for g in groups)
    if not any(g.block_size > hash_block_size or dcp > 1 for g in mamba):
        return False
    if any(g.block_size % hash_block_size for g in mamba):
        return False
    return all(
        g.kind is Kind.MAMBA
        or not POLICY_BY_KIND[g.kind].caches_blocks  # never hit (a circular buffer)
        or g.block_size == hash_block_size
        or (append_only(POLICY_BY_KIND[g.kind]) and g.block_size % hash_block_size == 0)
        for g in groups
    )


def junctions_on(
    partial: bool, speculative: SpeculativeSetup, config: KVCacheConfig | None, asked: bool
) -> bool:
    """Whether states are kept at shared-prefix junctions too (vLLM's
    ``mamba_shared_prefix_checkpoint``): asked for, with sub-block hits on, a group that
    drops EAGLE's block (every group with the drop on, or one the config marks), and no
    multi-module MTP tail (then the computed tokens handed to the cache lag the chunk
    end, so no state would be kept where the scheduler stopped)."""
    eagle = speculative.use_eagle or bool(marked_eagle_groups(config))
    return asked and partial and eagle and speculative.num_reprefillable_tokens == 0


def junction(request: Request, computed: int) -> bool:
    """Whether ``computed`` is the request's shared-prefix junction inside the prompt chunk
    being computed (past the prompt, the running state changes before a sibling could
    read it)."""
    boundary = getattr(request, "shared_prefix_boundary", 0)
    return (
        bool(boundary)
        and computed == boundary
        and (request.num_computed_tokens < computed <= request.num_prompt_tokens)
    )


def tail_checkpoint(
    num_prompt_tokens: int, hash_block_size: int, lookahead: int, eagle: bool = False
) -> int:
    """The prompt's last hash boundary a state is kept at: one token (or the lookahead
    hashes' tokens) stays to compute, as vLLM's scheduler splits the prompt; with
    EAGLE's block drop one hash block below the prompt's last boundary (the hit drops
    it)."""
    if eagle:
        return max(0, (num_prompt_tokens // hash_block_size - 1) * hash_block_size)
    limit = num_prompt_tokens - max(1, lookahead)
    return max(0, limit // hash_block_size * hash_block_size)


def attention_tail(num_prompt_tokens: int, hash_block_size: int, eagle: bool) -> int:
    """The prompt's last hash boundary a larger attention block is named at (vLLM's
    partial tail block): below the prompt's last token, at it with EAGLE's block drop
    (whose hit drops one hash block)."""
    limit = num_prompt_tokens if eagle else num_prompt_tokens - 1
    return max(0, limit // hash_block_size * hash_block_size)


def checkpoint_alignment(config: KVCacheConfig | None) -> int | None:
    """vLLM's internal prefill checkpoints: the alignment of the exported state, when
    every Mamba group reserves checkpoint blocks (``num_prefill_checkpoint_blocks``)."""
    specs = [] if config is None else [g.kv_cache_spec for g in config.kv_cache_groups]
    mamba = [s for s in specs if hasattr(s, "num_prefill_checkpoint_blocks")]
    if not mamba or not all(s.num_prefill_checkpoint_blocks > 0 for s in mamba):
        return None
    return getattr(mamba[0], "prefill_checkpoint_alignment", None)


class PartialHits:
    """The manager's pending copies, the blocks kept for them, this step's new names."""

    def __init__(self, manager: JengaKVCacheManager) -> None:
        self._manager = manager
        self._copies: list[BlockCopy] = []
        # id(block object) -> (object, group, allocator block, the allocator then)
        self._retained: dict[int, tuple[KVCacheBlock, int, int, Any]] = {}
        self._fresh: set[tuple[int, int]] = set()  # (group, block) named this step
        # request -> its named tail states (group, block, tokens) a connector may offload
        self._tails: dict[str, list[tuple[int, int, int]]] = {}
        self._align = checkpoint_alignment(manager.kv_cache_config)
        mamba = [g.block_size for g in manager.layout.groups if g.kind is Kind.MAMBA]
        self._state_block = mamba[0]

    def checkpoint_for(self, request: Request, start: int, end: int) -> int:
        """Where vLLM's worker exports an internal prefill checkpoint in a step computing
        tokens ``start`` .. ``end`` (0: none): the prompt's tail checkpoint, in its last
        chunk, at the checkpoint alignment from ``start``, in a block between the state
        the step starts from and the one it ends at (vLLM's
        ``is_mamba_prefill_checkpoint_valid``)."""
        size, block, spec = (
            self._manager.hash_block_size,
            self._state_block,
            self._manager.speculative,
        )
        if self._align is None or end < max(request.num_prompt_tokens, request.num_tokens - 1):
            return 0
        p = tail_checkpoint(end, size, spec.num_hash_lookahead_tokens, spec.use_eagle)
        valid = start % size == 0 and -(-end // block) - 2 > (start - 1) // block
        valid = valid and start + size <= p < end and (p - start) % self._align == 0
        return p if valid else 0

    def name_checkpoint(self, rid: str, position: int, end: int) -> None:
        """Name the block `allocate` kept below the running state (index ``ceil(end /
        block) - 2``) by the checkpoint ``position`` the step's forward writes there."""
        column = -(-end // self._state_block) - 2
        named, plan = self._manager.allocator.cache_checkpoint(rid, column, position)
        self._manager._apply_plan(plan)
        self._fresh.update(named)
        for g, block in named:  # offered to a connector by its boundary: it holds this
            self._manager._connector.retag(rid, g, self._vllm_id(g, block), position)

    def cache(self, request: Request, computed: int) -> None:
        """Name the request's running state when its computed tokens end at the prompt's
        tail checkpoint (inside a Mamba block), and the attention block holding the
        prompt's tail in the step that computes it (inside a larger attention block)."""
        manager = self._manager
        spec, size = manager.speculative, manager.hash_block_size
        prompt, rid = request.num_prompt_tokens, request.request_id
        allocator = manager.allocator
        eagle = spec.use_eagle
        at_junction = manager.mamba_shared_prefix_checkpoint and junction(request, computed)
        if at_junction or computed == tail_checkpoint(
            prompt, size, spec.num_hash_lookahead_tokens, eagle
        ):
            named = allocator.cache_state(rid, computed, True)
            self._fresh.update(named)
            if named:
                self._tails[rid] = [(g, b, computed) for g, b in named]
        tail = attention_tail(prompt, size, eagle)
        if request.num_computed_tokens < tail <= min(computed, allocator.num_tokens(rid)):
            self._fresh.update(allocator.cache_state(rid, tail, False))

    def step_starts(self, request: Request, state: object) -> bool:
        """Before a request's allocation: a running request's named state moves off the
        block its step writes; a request admitted on a hit that holds a state named in
        this step waits for the next (False)."""
        rid = request.request_id
        if state is not None:
            self._move(rid)
            return True
        last = self._manager._last_match
        if not self._fresh or last is None or last[0] != rid:
            return True
        return not self.defers(last[1].tables)

    def _move(self, rid: str) -> None:
        allocator = self._manager.allocator
        if not allocator.has_named_state(rid):
            return
        copies, plan = allocator.move_state(rid)
        self._manager._apply_plan(plan)
        self.queue(copies)
        self._fresh.update((c.group, c.dst) for c in copies)
        # a named tail now lives in the moved block: offered once its copy ran (the
        # offers are taken after this step's copies)
        tails = {g: n for g, _, n in self._tails.pop(rid, ())}
        offers = [
            (c.group, self._vllm_id(c.group, c.dst), tails[c.group])
            for c in copies
            if c.group in tails
        ]
        self._manager._connector.offer(rid, offers)

    def finalize(self, request: Request) -> list[tuple[int, int, int]]:
        """A finishing request's named tail states still in its running block (no later
        token computed or in flight), each as (group, vLLM block id, tokens), once."""
        tails = self._tails.pop(request.request_id, ())
        if getattr(request, "num_in_flight_tokens", 0):
            return []
        done = request.num_computed_tokens
        return [(g, self._vllm_id(g, b), n) for g, b, n in tails if n == done]

    def _vllm_id(self, group: int, block: int) -> int:
        (vllm_id,) = self._vllm_ids(group, [block])
        return vllm_id

    def _vllm_ids(self, group: int, blocks: list[int]) -> list[int]:
        """vLLM block ids of allocator blocks of one group."""
        rows: list[list[int]] = [[] for _ in self._manager.layout.groups]
        rows[group] = blocks
        return [int(b.block_id) for b in self._manager._block_ids.rows(rows)[group]]

    def queue(self, copies: Sequence[BlockCopy]) -> None:
        """Copies for the worker (run before the next step's forward)."""
        self._copies.extend(copies)

    def defers(self, tables: Sequence[Sequence[int]]) -> bool:
        """Whether a hit's tables hold a state named this step (not filled yet)."""
        return any((g, b) in self._fresh for g, t in enumerate(tables) if t for b in t[-1:])

    def forget(self, request: Request) -> None:
        """A running request freed in the step that named its state (preempted before
        that step's forward wrote it) leaves no name: its block does not hold the state."""
        self._tails.pop(request.request_id, None)
        if not self._fresh or request.status != RequestStatus.RUNNING:
            return
        rid = request.request_id
        allocator = self._manager.allocator
        for g in range(len(self._manager.layout.groups)):
            stale = [b for b in allocator.block_table(rid, g) if (g, b) in self._fresh]
            if stale:
                self._manager._apply_plan(allocator.uncache_blocks(g, stale))

    def new_step(self) -> None:
        self._fresh.clear()

    def take(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The pending copies in vLLM block ids, and the blocks kept for them (each an
        object of its own, handed back through `release`)."""
        copies, self._copies = self._copies, []
        if not copies:
            return [], []
        pairs, kept = [], []
        for c in copies:
            src, dst = self._vllm_ids(c.group, [c.src, c.dst])
            pairs.append(KVCacheBlockCopy(src, dst))
            for b in c.retained:
                obj = KVCacheBlock(src if b == c.src else dst)
                obj.ref_cnt = 1
                self._retained[id(obj)] = (obj, c.group, b, self._manager.allocator)
                kept.append(obj)
        return pairs, kept

    def release(self, blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        """Drop the references kept for copies that ran; the other blocks are returned."""
        rest = []
        allocator: Any = self._manager.allocator
        for obj in blocks:
            entry = self._retained.pop(id(obj), None)
            if entry is None:
                rest.append(obj)
                continue
            obj.ref_cnt = 0
            if entry[3] is allocator:  # else the prefix cache was reset since: gone
                self._manager._apply_plan(allocator.release_retained(entry[1], [entry[2]]))
        return rest

    def reset(self) -> None:
        """The allocator was rebuilt: no pending copy or name refers to it (blocks kept
        for copies still come back through `release`, and are let go)."""
        self._copies.clear()
        self._fresh.clear()
        self._tails.clear()
