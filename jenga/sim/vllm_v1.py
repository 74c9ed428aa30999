"""Today's vLLM (V1, vLLM 0.32) KV cache manager as a simulator baseline: ``vllm_v1``.

Rationale
    The Jenga paper's baseline is vLLM 0.6 (uniform paging). vLLM has since grown a
    hybrid KV cache manager, so "Jenga vs vLLM" today means Jenga against *that*. Its
    choices differ from Jenga's where it matters: one page size for every layer (the
    attention block size of a Mamba hybrid is raised until one attention page holds a
    Mamba state), equal-sized KV cache groups (padding layers), one free queue for
    every group, and sparse retention of sliding-window and Mamba prefix-cache entries.
    This module follows those rules as vLLM 0.32's code states them (read from the
    installed package; no code copied) so the comparison is with the real engine's
    policy, not with a 2024 one.

Approach
    Layout (`v1_layout`), in the order vLLM's config code applies it:

    1. Mamba hybrids: attention block size ``B = 16 * ceil(mamba_page / (16 * a))``
       (``a`` = attention bytes per token per layer, 16 = FlashAttention's kernel block
       multiple, or the user's ``--block-size`` when larger), the Mamba page padded to
       ``B * a``, and in "align" mode (the default with prefix caching) the Mamba block
       size set to ``B``. [vllm/platforms/interface.py
       ``Platform._align_hybrid_block_size``, which 0.32's
       ``HybridAttentionMambaModelConfig.verify_and_update_config`` defers to (earlier
       releases computed it there); vllm/model_executor/models/config.py
       ``MambaModelConfig.verify_and_update_config`` for "align" mode]
    2. Pages unified: a smaller attention page gets ``block_size x ratio`` when the
       largest page is a multiple of it, else is padded. [vllm/v1/core/kv_cache_utils.py
       ``unify_kv_cache_spec_page_size``]
    3. Layers of one kind are split into KV cache groups of ``group_size`` layers (the
       smallest kind's layer count; the largest when it is < 1.5x the smallest), the last
       group of a kind padded with empty layers. [``_get_kv_cache_groups_uniform_page_size``]
    4. One pool of ``num_blocks = KV bytes // (group_size x page)`` blocks; a block is
       one page in each of a group's ``group_size`` layer tensors.
       [``get_kv_cache_config_from_groups``]

    The vLLM groups of one model group behave identically, so they are simulated as one
    *bucket* whose blocks cost ``m`` pool blocks each (``m`` = its number of vLLM groups).

    Manager (`VllmV1Allocator`):

    - One free queue holds every free block: allocation pops the head and evicts its
      hash; freed blocks with a hash join the tail in the order freed (a request's blocks
      tail first, group by group: LRU), freed blocks without one go to the head (reused
      first). Cached blocks are not de-duplicated: two requests computing the same block
      both cache it, a lookup takes either. [vllm/v1/core/block_pool.py ``free_blocks``,
      ``get_new_blocks``, ``BlockHashToBlockMap``; single_type_kv_cache_manager.py ``free``]
    - Full attention hashes every full computed block. Sliding window frees blocks
      before ``computed - w + 1``; Mamba keeps one state block (plus the next while a
      step crosses a block boundary) and frees the rest.
      [``SlidingWindowManager.get_num_skipped_tokens``, ``MambaManager.remove_skipped_blocks``]
    - Retention (``prefix_cache_retention_interval = 0``, the default): sliding-window
      and Mamba blocks are hashed only at *reachable boundaries* — the prompt's replay
      boundary ``prompt_len - 1`` and a shared-prefix junction — floored to the
      scheduler block size; every other block is freed unhashed.
      [config/cache.py; ``SlidingWindowManager.reachable_block_mask``,
      ``MambaManager.reachable_block_mask``, kv_cache_coordinator.py ``replay_boundaries``]
      A chunk that crosses a retained Mamba boundary takes one more block for the
      checkpoint state (``MambaManager.get_num_blocks_to_allocate``).
    - Hits: full attention's leading cached run bounds the hit; each other group lowers
      it (sliding window: ``ceil((w - 1) / B)`` contiguous cached blocks ending on an
      aligned boundary; Mamba: a cached state exactly there) until a fixed point, a
      multiple of the scheduler block size (lcm of group block sizes) and < the prompt.
      When full attention alone hit further, that length is the request's junction
      (Marconi-style), so this request retains its sparse entries there.
      [``HybridKVCacheCoordinator.find_longest_cache_hit``,
      ``KVCacheManager.get_computed_blocks``]

Limitations
    Models with chunked-local, cross-attention, vision-embedding or PyramidKV-style layers
    raise `SimError` (vLLM 0.32 has no mllama, keeps vision embeddings outside the KV
    pool, and its chunked-local rules are not modelled). Eagle/MTP drops, fine-grained
    (sub-block) hash hits, KV connectors and the chunk cuts of Mamba "align" mode are
    not modelled; the engine is the simulator's, not vLLM's scheduler.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from jenga.sim.protocol import AllocatorSnapshot, RequestState, SimError
from jenga.specs import Kind, LayerSpec, ModelSpec

KERNEL_BLOCK = 16  # FlashAttention's supported kernel block sizes: MultipleOf(16)
DEFAULT_BLOCK_SIZE = 16  # vLLM CacheConfig.DEFAULT_BLOCK_SIZE
SUPPORTED = frozenset({Kind.FULL, Kind.SLIDING_WINDOW, Kind.MAMBA})


@dataclass(frozen=True)
class Bucket:
    """The ``mult`` vLLM KV cache groups one model group becomes (see the module note)."""

    name: str  # the model group's name
    spec: LayerSpec
    block_size: int  # tokens per block (Mamba: tokens per state in "align" mode)
    num_layers: int  # the model group's real layers
    mult: int  # vLLM groups (each group_size layers, the last padded)


@dataclass(frozen=True)
class V1Layout:
    """What vLLM's config code chooses for a model and a KV budget."""

    buckets: tuple[Bucket, ...]
    group_size: int
    page_bytes: int  # one layer's page (every group's, after unification and padding)
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.group_size * self.page_bytes

    @property
    def scheduler_block_size(self) -> int:
        return math.lcm(*(b.block_size for b in self.buckets))

    @property
    def padding_layers(self) -> int:
        return sum(b.mult * self.group_size - b.num_layers for b in self.buckets)


def _check_supported(model: ModelSpec) -> None:
    for g in model.groups:
        if g.spec.kind not in SUPPORTED or g.spec.token_fraction != (1, 1):
            raise SimError(
                f"vllm_v1: group {g.name!r} ({g.spec.kind}) is not modelled; vllm_v1 serves "
                "full, sliding-window and Mamba layers"
            )


def attention_block_size(model: ModelSpec, base_block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The tokens per attention block vLLM chooses (step 1 of the module note)."""
    mamba = [g.spec.page_bytes for g in model.groups if g.spec.kind is Kind.MAMBA]
    attn = [g.spec.bytes_per_token for g in model.groups if g.spec.kind is not Kind.MAMBA]
    if not mamba or not attn:
        return base_block_size
    per_token, state = attn[0], max(mamba)  # vLLM reads one attention spec from the config
    align = max(KERNEL_BLOCK, base_block_size)
    block = align * -(-state // (align * per_token))
    block = KERNEL_BLOCK * -(-block // KERNEL_BLOCK)
    return max(base_block_size, block)


def _unified_pages(model: ModelSpec, block: int) -> tuple[int, dict[str, int]]:
    """(page bytes, tokens per block of each group) after steps 1-2 of the module note."""
    pages = {
        g.name: (g.spec.bytes_per_token * block if g.spec.kind is not Kind.MAMBA else 0)
        for g in model.groups
    }
    page = max(max(pages.values()), *(g.spec.page_bytes for g in model.groups))
    sizes = {}
    for g in model.groups:
        own = pages[g.name]
        scaled = own and page % own == 0  # a multiple: grow the block, else pad the page
        sizes[g.name] = block * (page // own) if scaled else block
    return page, sizes


def v1_layout(model: ModelSpec, kv_bytes: int, base_block_size: int | None = None) -> V1Layout:
    """Steps 1-4 of the module note for ``model`` with ``kv_bytes`` of KV cache."""
    _check_supported(model)
    base = base_block_size or min(g.spec.block_size for g in model.groups)
    block = attention_block_size(model, base)
    page, sizes = _unified_pages(model, block)
    counts = [g.num_layers for g in model.groups]
    group_size = min(counts)
    if max(counts) < 1.5 * group_size:
        group_size = max(counts)
    buckets = tuple(
        Bucket(g.name, g.spec, sizes[g.name], g.num_layers, -(-g.num_layers // group_size))
        for g in model.groups
    )
    num_blocks = kv_bytes // (group_size * page)
    if num_blocks <= 1:
        raise SimError(f"vllm_v1: {kv_bytes} B hold no block of {group_size * page} B")
    return V1Layout(buckets, group_size, page, num_blocks)


class _Entry:
    """A bucket block held by requests (``ref > 0``) or cached in the free queue (``ref == 0``,
    hashed). Free blocks without a hash are not entries, only counts in the queue."""

    __slots__ = ("block_hash", "bucket", "ref")

    def __init__(self, bucket: int) -> None:
        self.bucket = bucket
        self.ref = 1
        self.block_hash: int | None = None


class _Req:
    __slots__ = ("junction", "num_cached", "prompt_len", "tables")

    def __init__(self, tables: list[list[int | None]], junction: int, prompt_len: int) -> None:
        self.tables = tables
        self.num_cached = [len(t) for t in tables]
        self.junction = junction
        self.prompt_len = prompt_len


class VllmV1Allocator:
    """vLLM 0.32's KV cache manager on a `V1Layout`; see the module note.

    Invariant: every pool block but the null block is in exactly one place — held by a
    live entry (``mult`` blocks each), a cached entry in the free queue, or an unhashed
    run in the free queue (negative ids).
    """

    def __init__(self, model: ModelSpec, kv_bytes: int, name: str = "vllm_v1") -> None:
        self.name = name
        self.use_prefix_cache = True
        self.layout = v1_layout(model, kv_bytes)
        self._buckets = self.layout.buckets
        self._align = self.layout.scheduler_block_size
        self._entries: dict[int, _Entry] = {}
        self._next_id = 0
        self._next_run = -1
        # the free queue, head = next to reuse: entry id (> 0, cached) or run id (< 0,
        # unhashed) -> pool blocks; one block is vLLM's null block, never in the pool
        self._free: OrderedDict[int, int] = OrderedDict(
            {self._run_id(): self.layout.num_blocks - 1}
        )
        self._free_units = self.layout.num_blocks - 1
        self._cached_units = 0
        self._live_units = [0] * len(self._buckets)
        # (bucket, hash) -> entries with that hash: vLLM does not de-duplicate cached blocks
        # (``BlockHashToBlockMap``), a lookup takes any of them
        self._index: dict[tuple[int, int], dict[int, None]] = {}
        self._reqs: dict[str, _Req] = {}

    # --- hashing ------------------------------------------------------------------------

    def _hashes(self, state: RequestState, block: int, upto: int) -> list[int]:
        """Chained hashes of (at least) the first ``upto`` full blocks of ``block`` tokens."""
        hashes = state.scratch.setdefault(("v1", block), [])
        assert isinstance(hashes, list)
        prev = hashes[-1] if hashes else 0
        toks = state.tokens
        while len(hashes) < upto:
            lo = len(hashes) * block
            prev = hash((prev, tuple(toks[lo : lo + block])))
            hashes.append(prev)
        return hashes

    def _lookup(self, state: RequestState, b: int, upto: int) -> list[int | None]:
        """Cached entry ids of the first ``upto`` blocks of bucket ``b`` (None: not cached)."""
        hashes = self._hashes(state, self._buckets[b].block_size, upto)
        index = self._index
        return [next(iter(index[(b, h)])) if (b, h) in index else None for h in hashes[:upto]]

    # --- the free queue -----------------------------------------------------------------

    def _run_id(self) -> int:
        self._next_run -= 1
        return self._next_run

    def _take_units(self, units: int) -> None:
        """Pop ``units`` pool blocks off the queue head, evicting the hashes they held."""
        while units:
            key, held = self._free.popitem(last=False)
            if key > 0:  # a cached entry: its first block's reuse breaks the hit
                self._forget(key)
            used = min(units, held)
            units -= used
            self._free_units -= used
            if held > used:  # the rest stays at the head, unhashed
                run = self._run_id()
                self._free[run] = held - used
                self._free.move_to_end(run, last=False)

    def _forget(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        assert entry.block_hash is not None and entry.ref == 0
        key = (entry.bucket, entry.block_hash)
        del self._index[key][entry_id]
        if not self._index[key]:
            del self._index[key]
        self._cached_units -= self._buckets[entry.bucket].mult

    def _new_entry(self, b: int) -> int:
        self._take_units(self._buckets[b].mult)
        self._next_id += 1
        self._entries[self._next_id] = _Entry(b)
        self._live_units[b] += self._buckets[b].mult
        return self._next_id

    def _claim(self, entry_id: int) -> None:
        entry = self._entries[entry_id]
        if entry.ref == 0:
            units = self._free.pop(entry_id)
            self._free_units -= units
            self._cached_units -= units
            self._live_units[entry.bucket] += units
        entry.ref += 1

    def _drop(self, entry_id: int) -> None:
        entry = self._entries[entry_id]
        entry.ref -= 1
        if entry.ref:
            return
        units = self._buckets[entry.bucket].mult
        self._live_units[entry.bucket] -= units
        self._free_units += units
        if entry.block_hash is None:  # never matches a prefix: reused first
            del self._entries[entry_id]
            run = self._run_id()
            self._free[run] = units
            self._free.move_to_end(run, last=False)
        else:
            self._free[entry_id] = units
            self._cached_units += units

    # --- retention and caching ----------------------------------------------------------

    def _boundaries(self, req: _Req) -> list[int]:
        """Reachable boundaries: replay (prompt - 1) and the junction, floored to alignment."""
        points = [req.prompt_len - 1] + ([req.junction] if req.junction else [])
        return [p // self._align * self._align for p in points]

    def _retained(self, b: int, req: _Req, j: int) -> bool:
        """Whether block ``j`` of bucket ``b`` may be hashed (retention interval 0)."""
        bucket = self._buckets[b]
        kind, size = bucket.spec.kind, bucket.block_size
        if kind is Kind.FULL:
            return True
        for boundary in self._boundaries(req):
            end = boundary // size
            if kind is Kind.MAMBA and j == end - 1:
                return True
            if kind is Kind.SLIDING_WINDOW and end - self._need(bucket) <= j < end:
                return True
        return False

    @staticmethod
    def _need(bucket: Bucket) -> int:
        """Contiguous blocks a sliding-window hit needs: ceil((w - 1) / B)."""
        assert bucket.spec.window is not None
        return -(-(bucket.spec.window - 1) // bucket.block_size)

    def _register(self, state: RequestState) -> None:
        """Hash the request's full computed blocks that retention keeps (``cache_blocks``)."""
        if not self.use_prefix_cache:
            return
        req = self._reqs[state.req_id]
        computed = state.num_computed
        if len(self._buckets) > 1:
            computed = computed // self._align * self._align
        for b, table in enumerate(req.tables):
            size = self._buckets[b].block_size
            full = min(computed // size, len(table))
            if full <= req.num_cached[b]:
                continue
            hashes = self._hashes(state, size, full)
            for j in range(req.num_cached[b], full):
                entry_id = table[j]
                if entry_id is None or not self._retained(b, req, j):
                    continue
                entry = self._entries[entry_id]
                if entry.block_hash is None:
                    entry.block_hash = hashes[j]
                    self._index.setdefault((b, hashes[j]), {})[entry_id] = None
            req.num_cached[b] = full

    # --- prefix hits (HybridKVCacheCoordinator.find_longest_cache_hit) -------------------

    def _full_hit(self, state: RequestState, b: int, limit: int) -> int:
        size = self._buckets[b].block_size
        run = 0
        for entry_id in self._lookup(state, b, limit // size):
            if entry_id is None:
                break
            run += 1
        return run * size // self._align * self._align

    def _window_hit(self, state: RequestState, b: int, limit: int) -> int:
        bucket = self._buckets[b]
        size, need = bucket.block_size, self._need(bucket)
        found = self._lookup(state, b, limit // size)
        run = 0
        for i in range(len(found) - 1, -1, -1):
            if found[i] is None:
                run = 0
                continue
            if run == 0 and ((i + 1) * size) % self._align:
                continue  # a run must end on an aligned boundary
            run += 1
            if run >= need:
                return (i + run) * size
        return run * size // self._align * self._align  # a run from token 0 (short prompt)

    def _mamba_hit(self, state: RequestState, b: int, limit: int) -> int:
        size = self._buckets[b].block_size
        found = self._lookup(state, b, limit // size)
        for i in range(len(found) - 1, -1, -1):
            if found[i] is not None and ((i + 1) * size) % self._align == 0:
                return (i + 1) * size
        return 0

    def _find_hit(self, state: RequestState) -> tuple[int, int]:
        """(hit, longest single-group hit): the fixed point of the module note."""
        hit = (len(state.tokens) - 1) // self._align * self._align
        full = [b for b, k in enumerate(self._buckets) if k.spec.kind is Kind.FULL]
        for b in full:
            hit = min(hit, self._full_hit(state, b, hit))
        longest = hit if full else 0
        others = [b for b in range(len(self._buckets)) if b not in full]
        while others:
            start = hit
            for b in others:
                kind = self._buckets[b].spec.kind
                finder = self._mamba_hit if kind is Kind.MAMBA else self._window_hit
                hit = finder(state, b, hit)
                longest = max(longest, hit)
            if hit >= start or len(others) == 1:
                break
        return hit, longest

    def _hit_tables(self, state: RequestState, hit: int) -> list[list[int | None]]:
        tables: list[list[int | None]] = []
        for b, bucket in enumerate(self._buckets):
            count = hit // bucket.block_size
            found = self._lookup(state, b, count)
            keep = count
            if bucket.spec.kind is Kind.SLIDING_WINDOW:
                keep = min(count, self._need(bucket))
            elif bucket.spec.kind is Kind.MAMBA:
                keep = min(count, 1)
            table = [None] * (count - keep) + found[count - keep :]
            assert all(e is not None for e in table[count - keep :])
            tables.append(table)
        return tables

    # --- the protocol -------------------------------------------------------------------

    def admit(self, state: RequestState) -> int:
        if state.req_id in self._reqs:
            raise SimError(f"{self.name}: request {state.req_id} admitted twice")
        hit, longest = self._find_hit(state) if self.use_prefix_cache else (0, 0)
        tables = self._hit_tables(state, hit) if hit else [[] for _ in self._buckets]
        for table in tables:
            for entry_id in table:
                if entry_id is not None:
                    self._claim(entry_id)
        junction = longest if longest > hit else 0
        self._reqs[state.req_id] = _Req(tables, junction, state.request.prompt_len)
        state.num_computed = hit
        return hit

    def _release_skipped(self, state: RequestState, req: _Req) -> None:
        """Free blocks no step reads again (sliding window: left the window; Mamba: old states)."""
        computed = state.num_computed
        for b, table in enumerate(req.tables):
            bucket = self._buckets[b]
            if bucket.spec.kind is Kind.SLIDING_WINDOW:
                assert bucket.spec.window is not None
                skipped = max(0, computed - bucket.spec.window + 1)
            elif bucket.spec.kind is Kind.MAMBA:
                skipped = max(0, computed - 1)
            else:
                continue
            for j in range(min(skipped // bucket.block_size, len(table)) - 1, -1, -1):
                entry_id = table[j]
                if entry_id is None:
                    if bucket.spec.kind is Kind.MAMBA:
                        continue  # Mamba tables have null gaps between states
                    break
                table[j] = None
                self._drop(entry_id)

    def _wanted(self, req: _Req, first: int, num_tokens: int) -> list[list[int]]:
        """Per bucket, the block indices to allocate for tokens ``[first, num_tokens)``."""
        wanted: list[list[int]] = []
        for b, bucket in enumerate(self._buckets):
            size, have = bucket.block_size, len(req.tables[b])
            last = -(-num_tokens // size)
            if bucket.spec.kind is not Kind.MAMBA:
                wanted.append(list(range(have, last)))
                continue
            want = {last - 1} if last > have else set()
            for boundary in self._boundaries(req):  # checkpoint blocks inside the chunk
                if first < boundary < num_tokens and boundary // size - 1 >= have:
                    want.add(boundary // size - 1)
            wanted.append(sorted(want))
        return wanted

    def allocate(self, state: RequestState, num_tokens: int) -> bool:
        req = self._reqs.get(state.req_id)
        if req is None:
            raise SimError(f"{self.name}: allocate for unknown request {state.req_id}")
        self._register(state)
        self._release_skipped(state, req)
        wanted = self._wanted(req, state.num_computed, num_tokens)
        units = sum(len(w) * self._buckets[b].mult for b, w in enumerate(wanted))
        if units > self._free_units:
            return False
        for b, indices in enumerate(wanted):
            table = req.tables[b]
            for j in indices:
                table.extend([None] * (j - len(table)))
                table.append(self._new_entry(b))
        return True

    def trim(self, state: RequestState) -> None:
        self._register(state)
        self._release_skipped(state, self._reqs[state.req_id])

    def release(self, state: RequestState) -> None:
        req = self._reqs.get(state.req_id)
        if req is None:
            raise SimError(f"{self.name}: release of unknown request {state.req_id}")
        self._register(state)
        del self._reqs[state.req_id]
        for table in req.tables:
            for entry_id in reversed(table):
                if entry_id is not None:
                    self._drop(entry_id)

    def snapshot(self) -> AllocatorSnapshot:
        unit = self.layout.block_bytes
        live = {b.name: 0 for b in self._buckets}
        for bucket, units in zip(self._buckets, self._live_units, strict=True):
            live[bucket.name] += units * unit
        capacity = self.layout.num_blocks * unit
        return AllocatorSnapshot(
            capacity_bytes=capacity,
            committed_bytes=capacity,
            live_bytes=sum(live.values()),
            cached_bytes=self._cached_units * unit,
            group_live_bytes=live,
        )

    def check_invariants(self) -> None:
        refs: dict[int, int] = {}
        for req in self._reqs.values():
            for table in req.tables:
                for entry_id in table:
                    if entry_id is not None:
                        refs[entry_id] = refs.get(entry_id, 0) + 1
        live = [0] * len(self._buckets)
        for entry_id, entry in self._entries.items():
            assert entry.ref == refs.get(entry_id, 0), f"entry {entry_id} ref {entry.ref}"
            assert (entry.ref == 0) == (entry_id in self._free), f"entry {entry_id} queue"
            if entry.ref:
                live[entry.bucket] += self._buckets[entry.bucket].mult
            else:
                assert entry.block_hash is not None, f"free entry {entry_id} has no hash"
            if entry.block_hash is not None:
                assert entry_id in self._index[(entry.bucket, entry.block_hash)]
        assert live == self._live_units, f"live {live} != {self._live_units}"
        indexed = sum(len(ids) for ids in self._index.values())
        assert indexed == sum(e.block_hash is not None for e in self._entries.values())
        assert sum(self._free.values()) == self._free_units
        cached = sum(u for k, u in self._free.items() if k > 0)
        assert cached == self._cached_units, f"cached {cached} != {self._cached_units}"
        assert self._free_units + sum(live) == self.layout.num_blocks - 1


def vllm_v1(model: ModelSpec, kv_bytes: int) -> VllmV1Allocator:
    """vLLM 0.32's hybrid KV cache manager (see the module note)."""
    return VllmV1Allocator(model, kv_bytes)
