"""Baseline paged allocators: uniform paging, vLLM-style hybrid, static partition.

Rationale
    The paper compares Jenga with PagedAttention-style engines. Those engines are *not*
    Jenga: they cut memory into equal pages and give each layer group one page per
    block, and evict like vLLM's block pool (one LRU, a finished request's tail first).
    One small, generic paged pool expresses these baselines by configuration
    (which groups, tokens per block, bytes charged per block, which pool), so the
    comparison differs only where the engines differ.

Approach
    ``PagedAllocator(config)`` keeps, per pool, a byte budget; a block of group g costs
    ``block_cost[g]`` bytes of its pool. Per-layer pages are equal inside a pool for
    every baseline, so byte accounting is exact (no cross-size fragmentation).

        uniform          one group "all", every layer stores every token, 16 tokens/block
                         (vLLM 0.6's PagedAttention block manager)
        vllm_hybrid      real groups, equal page bytes: tokens/block = page // bytes/token
                         (vLLM's hybrid allocator as first merged, RFC #11382 / v0.9:
                         ``unify_kv_cache_spec_page_size`` grows the smaller pages' block
                         size, all groups share one block pool; no group-size padding, no
                         Mamba, every computed block cached; today's manager with those
                         rules is `jenga.sim.vllm_v1`)
        static_partition real groups, one pool per group, equal blocks per group

    Blocks move free -> live (refcount > 0) -> cached (refcount 0, hashed, in the LRU)
    -> evicted. A full, computed block gets a chained hash (role-local, extra key = the
    image's hash for text after an image). Sliding-window / chunked blocks that left the
    kept interval (`needs.kept_interval`) are released to the cache at once. A prefix
    hit is the longest length valid in every group (its kept interval fully cached).

    The MAX-page baseline is not here: it is a page-table configuration of the real
    Jenga core (`jenga_adapter.max_page`). Tokens per block come from the model's specs
    (16 unless ``--block-size`` changed them). ``use_prefix_cache = False`` turns lookups
    and hashing off (``--no-prefix-cache``).

Limitations
    No Mamba groups (raises SimError). LRU ties follow release order (tail first).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from jenga.sim.needs import group_length, kept_interval, role_of
from jenga.sim.protocol import AllocatorSnapshot, RequestState, SimError
from jenga.specs import Kind, LayerSpec, ModelSpec


@dataclass(frozen=True)
class GroupLayout:
    """One group as a baseline lays it out: rules (``spec``), block size, cost, pool."""

    name: str
    spec: LayerSpec
    role: str
    tokens_per_block: int
    block_cost: int
    pool: int


@dataclass(frozen=True)
class PagedConfig:
    name: str
    groups: tuple[GroupLayout, ...]
    pool_capacity: tuple[int, ...]


class _Block:
    __slots__ = ("block_hash", "group", "ref")

    def __init__(self, group: int) -> None:
        self.group = group
        self.ref = 1
        self.block_hash: int | None = None


class PagedAllocator:
    """A paged KV pool with prefix caching, configured as one of the baselines."""

    def __init__(self, config: PagedConfig) -> None:
        self.name = config.name
        self.config = config
        self.use_prefix_cache = True
        self._groups = config.groups
        self._capacity = list(config.pool_capacity)
        self._used = [0] * len(self._capacity)
        self._cached = [0] * len(self._capacity)
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in self._capacity]
        self._blocks: dict[int, _Block] = {}
        self._next_id = 0
        self._index: dict[tuple[int, int], int] = {}
        self._tables: dict[str, list[list[int | None]]] = {}
        self._registered: dict[str, list[int]] = {}
        self._group_live = [0] * len(self._groups)

    # --- hashing ------------------------------------------------------------------------

    def _hashes(self, state: RequestState, gi: int, upto: int) -> list[int]:
        """Chained hashes of at least the group's first ``upto`` blocks (cached in the state;
        the list may be longer than ``upto``)."""
        layout = self._groups[gi]
        key = ("hash", layout.role, layout.tokens_per_block)
        hashes = state.scratch.setdefault(key, [])
        assert isinstance(hashes, list)
        bs, image = layout.tokens_per_block, state.image_tokens
        if layout.role == "text":
            seq_start, seq_end = image, len(state.tokens)
            seed = hash(tuple(state.tokens[:image])) if image else 0
        elif layout.role == "image":
            seq_start, seq_end, seed = 0, image, 0
        else:
            seq_start, seq_end, seed = 0, len(state.tokens), 0
        prev = hashes[-1] if hashes else seed
        toks = state.tokens
        while len(hashes) < upto:
            lo = seq_start + len(hashes) * bs
            hi = min(lo + bs, seq_end)
            prev = hash((prev, tuple(toks[lo:hi])))
            hashes.append(prev)
        return hashes

    def _num_hashable(self, gi: int, state: RequestState, n: int) -> int:
        """Blocks of group ``gi`` that are full and computed at ``n`` sequence tokens."""
        layout = self._groups[gi]
        length = group_length(layout.role, n, state.image_tokens)
        if layout.role == "image" and n >= state.image_tokens:
            return -(-length // layout.tokens_per_block)  # the whole image, tail included
        return length // layout.tokens_per_block

    # --- block life cycle ---------------------------------------------------------------

    def _new_block(self, gi: int) -> int:
        layout = self._groups[gi]
        pool = layout.pool
        while self._capacity[pool] - self._used[pool] < layout.block_cost:
            self._evict_one(pool)
        block_id = self._next_id
        self._next_id += 1
        self._blocks[block_id] = _Block(gi)
        self._used[pool] += layout.block_cost
        self._group_live[gi] += layout.block_cost
        return block_id

    def _evict_one(self, pool: int) -> None:
        block_id, _ = self._lru[pool].popitem(last=False)
        block = self._blocks.pop(block_id)
        assert block.block_hash is not None and block.ref == 0
        del self._index[(block.group, block.block_hash)]
        cost = self._groups[block.group].block_cost
        self._used[pool] -= cost
        self._cached[pool] -= cost

    def _claim(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref == 0:
            layout = self._groups[block.group]
            del self._lru[layout.pool][block_id]
            self._cached[layout.pool] -= layout.block_cost
            self._group_live[block.group] += layout.block_cost
        block.ref += 1

    def _drop(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref -= 1
        if block.ref > 0:
            return
        layout = self._groups[block.group]
        self._group_live[block.group] -= layout.block_cost
        if block.block_hash is None:
            del self._blocks[block_id]
            self._used[layout.pool] -= layout.block_cost
        else:
            self._lru[layout.pool][block_id] = None
            self._cached[layout.pool] += layout.block_cost

    def _register_computed(self, state: RequestState) -> None:
        """Give every full, computed block of the request a hash (so it can be shared)."""
        if not self.use_prefix_cache:
            return
        tables = self._tables[state.req_id]
        done = self._registered[state.req_id]
        for gi, table in enumerate(tables):
            upto = min(self._num_hashable(gi, state, state.num_computed), len(table))
            if upto <= done[gi]:
                continue
            hashes = self._hashes(state, gi, upto)
            for j in range(done[gi], upto):
                block_id = table[j]
                if block_id is None:
                    continue
                block = self._blocks[block_id]
                if block.block_hash is None and (gi, hashes[j]) not in self._index:
                    block.block_hash = hashes[j]
                    self._index[(gi, hashes[j])] = block_id
            done[gi] = upto

    # --- prefix hits --------------------------------------------------------------------

    def _cached_prefix_sums(self, state: RequestState, gi: int, upto_tokens: int) -> list[int]:
        """``sums[j]`` = cached blocks among the group's first j (hashable) blocks."""
        num = self._num_hashable(gi, state, upto_tokens)
        hashes = self._hashes(state, gi, num)
        sums = [0]
        for h in hashes[:num]:
            sums.append(sums[-1] + ((gi, h) in self._index))
        return sums

    def _hit_interval(self, gi: int, state: RequestState, hit: int) -> tuple[int, int]:
        """Tokens (group coordinates) that must be cached for a hit of ``hit`` tokens.

        A vision-embedding cache is not needed once the hit covers the whole image (its
        tokens were consumed when the image's positions were computed)."""
        layout = self._groups[gi]
        length = group_length(layout.role, hit, state.image_tokens)
        if length == 0:
            return 0, 0
        if layout.spec.kind is Kind.VISION_EMBEDDING and hit >= state.image_tokens:
            return length, length
        return kept_interval(layout.spec, length, prompt_done=False)

    def _valid_hit(self, state: RequestState, gi: int, hit: int, sums: list[int]) -> bool:
        bs = self._groups[gi].tokens_per_block
        start, end = self._hit_interval(gi, state, hit)
        if end == start:
            return True
        first, last = start // bs, -(-end // bs)
        return last < len(sums) and sums[last] - sums[first] == last - first

    def _full_prefix_bound(self, state: RequestState, sums: list[list[int]]) -> int:
        """Sequence tokens covered by the leading cached run of every full-attention group:
        no hit can be longer (a cheap bound that skips most candidates)."""
        bound = len(state.tokens)
        for gi, layout in enumerate(self._groups):
            if layout.spec.kind is not Kind.FULL or layout.role == "image":
                continue
            group_sums = sums[gi]
            run = 0
            while run + 1 < len(group_sums) and group_sums[run + 1] == run + 1:
                run += 1
            offset = state.image_tokens if layout.role == "text" else 0  # "all": none
            bound = min(bound, offset + run * layout.tokens_per_block)
        return bound

    def _longest_hit(self, state: RequestState) -> int:
        upper = len(state.tokens) - 1
        image = state.image_tokens
        if upper <= image:
            return 0
        steps = [g.tokens_per_block for g in self._groups if g.role != "image"] or [1]
        step = math.lcm(*steps)
        # block boundaries of text groups count from the image's end ("text") or from 0
        offset = image if any(g.role == "text" for g in self._groups) else 0
        sums = [self._cached_prefix_sums(state, gi, upper) for gi in range(len(self._groups))]
        upper = min(upper, self._full_prefix_bound(state, sums))
        hit = offset + ((upper - offset) // step) * step
        while hit > 0 and hit >= image:
            if all(self._valid_hit(state, gi, hit, sums[gi]) for gi in range(len(self._groups))):
                return hit
            hit -= step
        return 0

    # --- the protocol -------------------------------------------------------------------

    def admit(self, state: RequestState) -> int:
        if state.req_id in self._tables:
            raise SimError(f"{self.name}: request {state.req_id} admitted twice")
        hit = self._longest_hit(state) if self.use_prefix_cache else 0
        tables: list[list[int | None]] = []
        for gi, layout in enumerate(self._groups):
            start, end = self._hit_interval(gi, state, hit)
            length = group_length(layout.role, hit, state.image_tokens)
            num_blocks = -(-length // layout.tokens_per_block)
            hashes = self._hashes(state, gi, num_blocks)
            table: list[int | None] = []
            for j in range(num_blocks):
                if end == start or (j + 1) * layout.tokens_per_block <= start:
                    table.append(None)
                    continue
                block_id = self._index[(gi, hashes[j])]
                self._claim(block_id)
                table.append(block_id)
            tables.append(table)
        self._tables[state.req_id] = tables
        self._registered[state.req_id] = [len(t) for t in tables]
        state.num_computed = hit
        return hit

    def _release_out_of_window(self, state: RequestState) -> None:
        for gi, table in enumerate(self._tables[state.req_id]):
            layout = self._groups[gi]
            if layout.spec.kind is Kind.FULL or layout.spec.kind is Kind.CROSS_ATTENTION:
                continue
            length = group_length(layout.role, state.num_computed, state.image_tokens)
            start, _ = kept_interval(layout.spec, length, state.prompt_done)
            for j in range(min(start // layout.tokens_per_block, len(table))):
                block_id = table[j]
                if block_id is not None:
                    table[j] = None
                    self._drop(block_id)

    def allocate(self, state: RequestState, num_tokens: int) -> bool:
        if state.req_id not in self._tables:
            raise SimError(f"{self.name}: allocate for unknown request {state.req_id}")
        self._register_computed(state)
        self._release_out_of_window(state)
        tables = self._tables[state.req_id]
        wanted = [0] * len(self._groups)
        need = [0] * len(self._capacity)
        for gi, layout in enumerate(self._groups):
            length = group_length(layout.role, num_tokens, state.image_tokens)
            wanted[gi] = max(0, -(-length // layout.tokens_per_block) - len(tables[gi]))
            need[layout.pool] += wanted[gi] * layout.block_cost
        for pool, nbytes in enumerate(need):
            if nbytes > self._capacity[pool] - self._used[pool] + self._cached[pool]:
                return False
        for gi, count in enumerate(wanted):
            tables[gi].extend(self._new_block(gi) for _ in range(count))
        return True

    def trim(self, state: RequestState) -> None:
        self._register_computed(state)
        self._release_out_of_window(state)

    def release(self, state: RequestState) -> None:
        tables = self._tables.get(state.req_id)
        if tables is None:
            raise SimError(f"{self.name}: release of unknown request {state.req_id}")
        self._register_computed(state)
        del self._tables[state.req_id]
        del self._registered[state.req_id]
        for table in tables:
            for block_id in reversed(table):
                if block_id is not None:
                    self._drop(block_id)

    def snapshot(self) -> AllocatorSnapshot:
        group_live = {g.name: live for g, live in zip(self._groups, self._group_live, strict=True)}
        return AllocatorSnapshot(
            capacity_bytes=sum(self._capacity),
            committed_bytes=sum(self._capacity),
            live_bytes=sum(self._used) - sum(self._cached),
            cached_bytes=sum(self._cached),
            group_live_bytes=group_live,
        )

    def check_invariants(self) -> None:
        used = [0] * len(self._capacity)
        cached = [0] * len(self._capacity)
        live = [0] * len(self._groups)
        refs: dict[int, int] = {}
        for table_set in self._tables.values():
            for table in table_set:
                for block_id in table:
                    if block_id is not None:
                        refs[block_id] = refs.get(block_id, 0) + 1
        for block_id, block in self._blocks.items():
            layout = self._groups[block.group]
            used[layout.pool] += layout.block_cost
            assert block.ref == refs.get(block_id, 0), f"block {block_id} ref {block.ref}"
            in_lru = block_id in self._lru[layout.pool]
            assert in_lru == (block.ref == 0), f"block {block_id} LRU membership"
            if block.ref == 0:
                cached[layout.pool] += layout.block_cost
                assert block.block_hash is not None
            else:
                live[block.group] += layout.block_cost
            if block.block_hash is not None:
                assert self._index[(block.group, block.block_hash)] == block_id
        assert len(self._index) == sum(b.block_hash is not None for b in self._blocks.values())
        assert used == self._used, f"used {used} != {self._used}"
        assert cached == self._cached, f"cached {cached} != {self._cached}"
        assert live == self._group_live, f"group live {live} != {self._group_live}"
        for pool, cap in enumerate(self._capacity):
            assert self._used[pool] <= cap, f"pool {pool} over capacity"


# --- configurations ----------------------------------------------------------------------

FULL_RULES = LayerSpec(Kind.FULL, 1, 1)


def _reject_mamba(model: ModelSpec, name: str) -> None:
    if any(g.spec.kind is Kind.MAMBA for g in model.groups):
        raise SimError(f"{name}: baseline allocators do not model Mamba state ({model.name})")


def uniform(model: ModelSpec, capacity: int) -> PagedAllocator:
    """PagedAttention: one page size, every layer stores every token."""
    _reject_mamba(model, "uniform")
    per_token = sum(g.num_layers * g.spec.bytes_per_token for g in model.groups)
    layout = GroupLayout(
        "all", FULL_RULES, "all", _block_tokens(model), _block_tokens(model) * per_token, 0
    )
    return PagedAllocator(PagedConfig("uniform", (layout,), (capacity,)))


def _small_page(spec: LayerSpec) -> int:
    return spec.bytes_per_token * spec.block_size


def _block_tokens(model: ModelSpec) -> int:
    """The model's tokens per block (the smallest, when groups differ)."""
    return min(g.spec.block_size for g in model.groups)


def vllm_hybrid(model: ModelSpec, capacity: int) -> PagedAllocator:
    """vLLM's hybrid manager: equal page bytes, tokens per block scaled, remainder padded."""
    _reject_mamba(model, "vllm_hybrid")
    page = max(_small_page(g.spec) for g in model.groups)
    layouts = tuple(
        GroupLayout(
            g.name,
            g.spec,
            role_of(g.spec, model),
            page // g.spec.bytes_per_token,
            g.num_layers * page,
            0,
        )
        for g in model.groups
    )
    return PagedAllocator(PagedConfig("vllm_hybrid", layouts, (capacity,)))


def static_partition(model: ModelSpec, capacity: int) -> PagedAllocator:
    """One pool per layer type, each holding the same number of blocks."""
    _reject_mamba(model, "static_partition")
    costs = [g.num_layers * _small_page(g.spec) for g in model.groups]
    blocks_each = capacity // sum(costs)
    layouts = tuple(
        GroupLayout(g.name, g.spec, role_of(g.spec, model), g.spec.block_size, cost, i)
        for i, (g, cost) in enumerate(zip(model.groups, costs, strict=True))
    )
    pools = tuple(blocks_each * c for c in costs)
    return PagedAllocator(PagedConfig("static_partition", layouts, pools))
