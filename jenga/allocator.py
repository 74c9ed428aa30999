"""The Jenga two-level allocator with per-group prefix caching: the engine-facing API.

This is the allocator's design note; csrc/jenga/core.hpp (the C++ data structures) and
docs/jenga.md (measurements, the reasoning behind each rule) point here.

Rationale
    Models mix layer kinds whose caches differ in size and in which tokens they keep.
    One pool of units (2 MiB chunks under VMM, LCM large pages without it) is shared by
    all groups; each group cuts its large pages into its own small pages (blocks). A
    request's blocks live in large pages associated with that request, so a finished
    request hands whole large pages back (paper §4.3, Fig. 8). Finished requests' blocks
    stay cached and are evicted LRU, aligned across groups by prefix length (§5).

Approach
    Python keeps the per-request view (`jenga.requests.LiveRequest`: tokens, block tables
    per group, how many blocks are hashed) and asks each group's policy
    (`jenga.policies`, one class per layer kind) which blocks a length needs, which may
    be released to the cache, and which prefix lengths a group can serve. The per-block
    bookkeeping (free lists, request association of large pages, LRU order of evictable
    blocks and pages, the hash index, the five allocation steps) lives in the C++ core
    (`jenga._core.Core`), reached by batched calls with the GIL released. Every call that
    changes physical needs returns a `MappingPlan`. Configuration (`jenga.config`) and
    errors (`jenga.errors`) have their own modules; this one re-exports them.

    Allocating one block of group g for request r tries, in order (paper order):

    1. a free block in a large page associated with r,
    2. a new large page from free units (``MapPage``),
    3. evict whole evictable large pages of any group (none of their blocks in use, one
       cached at least; LRU by the newest last access of their blocks, ties: the longest
       prefix first, in every group alike, then group and page) until
       ``units_per_large_page[g]`` units are free, and remap those units (``UnmapPage``...
       then ``MapPage(reused_units=k)``); skipped when even every evictable page would
       not free enough,
    4. a free block in a large page of another request,
    5. evict one cached block of g (LRU; ties: the longest prefix first, then block id).

    The rules that change this are one value, `AllocationRules` (``AllocatorConfig.rules``), handed
    to the core whole (`jenga._core.Rules`):

    - ``order``: `AllocationOrder.PAPER` as above; ``COMPACT`` tries 4 before 2 (commits
      fewer units, frees less cleanly); ``PINNED`` is compact order with one more step
      between 2 and 3: once free units run out, evict a cached block of g on a page that
      is not wholly evictable (pinned by live blocks anyway) before evicting whole pages,
      so the units of evictable pages stay for the groups that have nothing else
      (sliding-window pages full of out-of-window cached blocks otherwise starve the
      full-attention group).
    - ``frugal_retry`` (on): `allocate` is all-or-nothing across groups, and groups are
      served one after another, so an earlier group's step 2/3 can spend units a later
      group needed. A refused call is then undone and retried in frugal order (steps 1,
      4, 5 on pages not wholly evictable, then 2, 3; new pages earlier only while their
      units are spare), which succeeds whenever any assignment under the step rules does
      (csrc/jenga/core_frugal.cpp).
    - Early releases (always, for groups whose policy `releases_early`: sliding window,
      chunked local): blocks a running request releases because they left its window or
      chunk are evicted, among blocks of equal last access, head first (shortest prefix
      first); every other tie goes tail first. The last blocks of such a batch still serve
      hits at the prompt's end together with the blocks the request releases later, so
      tail first would break every long prefix.
    - ``demote_window_releases`` (off): early releases are also cached in a lower tier,
      evicted (steps 3 and 5) before any block released by `free`, unless the block
      served a prefix hit since it was taken (its prefix is known to be shared; with a
      `HitProof`, the proof blocks after a hit count as serving it). A page
      is demoted only while every cached block on it is.
    - ``reuse_window_releases`` (off; needs demotion): while less than a quarter of the
      pool is free, right after step 4 a group takes its own least recent demoted block on
      a page that is not wholly evictable, before mapping or evicting a page. With many
      blocks per large page (VMM per-group pages), a live window pins a page whose
      out-of-window blocks stay cached; reusing them keeps the group's pages few, so
      whole pages become evictable for other groups.
    - ``retention_interval`` (0: off): every multiple of a positive interval is a
      retention boundary (vLLM's ``prefix_cache_retention_interval``). An early release
      of a sliding-window group is demoted (as above) unless a hit at the first boundary
      at or after its prefix reads it (`Policy.retention_reach` tokens before the
      boundary) or it served a prefix hit, so under pressure the window blocks of
      boundary hits, in every group, outlive those no boundary reads.

    On "no room" `allocate` returns None and the core rolls back every step it took (releases and
    evictions included): every primitive mutation is logged and undone last-first, which restores
    the exact state.

Limitations
    One allocator serves one model (groups of a draft and a target model are just more
    groups). Block identities are 128 bits of keyed BLAKE2b (or SHA-256; `BlockIdentity`);
    the core's index keys them by 64 bits and compares the whole identity on every hit, so
    a short-key collision is refused (``prefix.identity_mismatches``), never served. Times
    are a logical clock advanced by each mutating call.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jenga import _core, substates
from jenga.allocator_views import AllocatorViews
from jenga.allocator_views import Usage as Usage
from jenga.capacity import pages_fit, pages_for, units_to_free

# `X as X`: re-exported, engines import the allocator's configuration types from here too
from jenga.config import AllocationOrder as AllocationOrder
from jenga.config import AllocationRules as AllocationRules
from jenga.config import AllocatorConfig
from jenga.config import GroupConfig as GroupConfig
from jenga.errors import (
    MAX_TOKENS,
    DoubleFree,
    DuplicateRequest,
    InvalidSize,
    PageTooLarge,
    UnknownRequest,
    as_count,
    checked_token_ids,
)
from jenga.errors import AllocatorError as AllocatorError
from jenga.errors import InvalidInput as InvalidInput
from jenga.fork import CopyOnWrite, checked_children, forked, mark_shared_tail, share_blocks
from jenga.guard import Entry, guard_methods
from jenga.plan import MappingPlan, plan_from_keys
from jenga.policies import Policy, StateExtension, make_policy
from jenga.prefix import IntBuffer, TokenBuffer, TokenCount
from jenga.requests import (
    NULL_BLOCK,
    Allocation,
    ImageSpan,
    LiveRequest,
    PrefixMatch,
    checked_images,
    release_length,
)

_EMPTY_PLAN = MappingPlan()
# calls that change the request tables: one thread at a time (`jenga.guard`)
_CHANGING_CALLS = ("add_request", "allocate", "release_skipped", "append_tokens", "cache",
                   "free", "evict_cached", "set_total_units", "fork", "uncache_blocks",
                   "cache_state", "move_state", "release_retained")  # fmt: skip
_FREED_IDS_KEPT = 1 << 16


def _check_config(config: AllocatorConfig) -> None:
    """Refuse a config no allocator can be built from, naming the group and numbers."""
    if config.total_units <= 0:
        raise InvalidSize(f"total_units must be > 0, got {config.total_units}")
    if not config.groups:
        raise InvalidSize("an allocator needs at least one group, got 0")
    for g in config.groups:
        if g.blocks_per_large_page <= 0 or g.units_per_large_page <= 0:
            raise InvalidSize(
                f"group {g.name!r}: blocks_per_large_page {g.blocks_per_large_page} and "
                f"units_per_large_page {g.units_per_large_page} must be > 0"
            )
        limit = config.max_model_len
        if g.window is not None and limit is not None and g.window > limit:
            raise InvalidSize(f"group {g.name!r}: window {g.window} > max_model_len {limit}")
        if g.units_per_large_page > config.total_units:
            raise PageTooLarge(
                f"group {g.name!r}: a large page costs {g.units_per_large_page} units, "
                f"the pool holds {config.total_units}"
            )


class JengaAllocator(AllocatorViews, substates.SubStateCalls):
    """Two-level LCM allocator + prefix cache for one model's groups.

    Request ids are any hashable the engine likes. Block ids are per group:
    ``page * blocks_per_large_page[g] + slot``. Every public method either completes or
    raises before changing anything.
    """

    def __init__(self, config: AllocatorConfig, *, guard_threads: bool = True) -> None:
        _check_config(config)
        self.config = config
        self.policies: tuple[Policy, ...] = tuple(
            make_policy(
                g.kind,
                g.tokens_per_block,
                window=g.window,
                chunk=g.chunk,
                token_fraction=g.token_fraction,
                step_end_only=config.mamba_step_end_only,
                speculative_states=g.speculative_states,
            )
            for g in config.groups
        )
        only = config.mamba_prompt_states_only  # cached states stop at the prompt
        self._prompt_states_only = [only and p.holds_state for p in self.policies]
        self._core = _core.Core(
            [g.blocks_per_large_page for g in config.groups],
            [g.units_per_large_page for g in config.groups],
            config.total_units,
            config.rules.to_core(
                [p.releases_early for p in self.policies],
                [p.window_blocks if p.releases_early else 0 for p in self.policies],
                [p.retention_reach for p in self.policies],
            ),
            short_key_bits=config.identity.short_key_bits,
        )
        self._hasher = config.identity.hasher()
        self._group_index = {g.name: i for i, g in enumerate(config.groups)}
        unit = config.state_unit  # Mamba states inside an interval (`jenga.substates`)
        if unit is not None:
            substates.check_state_unit(unit, self.policies, config.identity.digest_block_size)
        self._states = substates.SubBlockStates(self._core, self.policies, unit) if unit else None
        text_blocks = [
            substates.hit_unit(p, unit)
            for p in self.policies
            if not p.reads_images and p.caches_blocks
        ]
        # a hit must end on a block boundary of every text group that caches
        self._prefix_step = math.lcm(*text_blocks) if text_blocks else 1
        self._requests: dict[Hashable, LiveRequest] = {}
        # ids freed recently (bounded: an older id's second free reads UnknownRequest)
        self._freed: OrderedDict[Hashable, None] = OrderedDict()
        self._next_internal = 0
        self._clock = 0
        self._epoch = 0  # advanced by every call that may evict (stale `PrefixMatch`)
        self._stats = {"prefix.queries": 0, "prefix.hit_tokens": 0, "prefix.query_tokens": 0}
        self.no_blocks = tuple(() for _ in config.groups)  # per group: no new block
        self._text_only = not any(p.reads_images for p in self.policies)
        self._entry = Entry()  # one thread at a time (`jenga.guard`)
        if guard_threads:
            guard_methods(self, _CHANGING_CALLS)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _request(self, request_id: Hashable) -> LiveRequest:
        req = self._requests.get(request_id)
        if req is None:
            if request_id in self._freed:
                raise DoubleFree(f"request {request_id!r} was already freed")
            raise UnknownRequest(
                f"unknown request {request_id!r} ({len(self._requests)} live requests)"
            )
        return req

    def _length_cap(self) -> int:
        """Most token ids one call may carry (checked before they are read one by one)."""
        limit = self.config.max_model_len
        return MAX_TOKENS if limit is None else limit

    def _check_length(self, request_id: Hashable, what: str, length: int) -> None:
        if (limit := self.config.max_model_len) is not None and length > limit:
            raise InvalidSize(
                f"request {request_id!r} {what}: {length} tokens exceed max_model_len {limit}"
            )

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: Hashable,
        prompt: Sequence[int] | np.ndarray,
        *,
        images: Sequence[ImageSpan] = (),
        salt: int = 0,
        use_cache: bool = True,
        match: PrefixMatch | None = None,
        digests: Sequence[bytes] | None = None,
    ) -> int:
        """Register a request and claim its longest cached prefix; returns its length.

        The hit is the longest length valid in every group's `possible_prefix`, capped at
        ``len(prompt) - 1`` so one token is always computed. The hit's blocks are shared
        (refcounted), not copied; no new memory is needed, so this never fails for room.
        ``match``: `prefix_match` of this same prompt, images and salt; while no call
        that can evict ran since (its ``epoch``), its hit and hashed prompt are adopted
        instead of looking the prefix up again. ``digests``: the caller's chained block
        digests when the allocator's identity has a ``digest_block_size`` (a list the
        caller may extend later; only ``len(prompt)`` is read then, no token id is kept).
        Raises `DuplicateRequest`, `InvalidSize` (empty prompt looked up in the cache, >
        max_model_len, bad image), `InvalidInput` (digests given to an allocator that
        hashes tokens).
        """
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already live")
        req = self._adopt(match, len(prompt), salt)
        if req is not None:
            assert match is not None
            hit, hit_blocks = (match.hit, match.tables) if use_cache else (0, [])
        else:
            req = self._new_live(request_id, prompt, images, salt, digests, not use_cache)
            restored = match is not None and match.diverged  # looked up again as it was
            hit, hit_blocks = self._match(req, None, restored)[:2] if use_cache else (0, [])
        req.internal_id = self._next_internal
        req.tables = [IntBuffer((), np.int32) for _ in self.config.groups]
        req.first_live = [0] * self.num_groups
        req.num_committed = [0] * self.num_groups
        now = self._tick()
        for g, blocks in enumerate(hit_blocks):
            policy = self.policies[g]
            self._core.acquire(g, [b for b in blocks if b != NULL_BLOCK], now)
            req.tables[g] = IntBuffer(blocks, np.int32)
            req.first_live[g] = min(policy.first_live_block(hit, req.images), len(blocks))
            req.num_committed[g] = len(blocks)
        if hit and self.config.hit_proof is not None:
            self._touch_proof(req, hit, now)
        if hit and self._states is not None:  # a state hit inside an interval
            substates.mark_state_tail(req, hit, self.policies, self._states.unit)
        req.num_tokens = req.num_hit = hit
        self._next_internal += 1
        self._requests[request_id] = req
        self._freed.pop(request_id, None)
        self._stats["prefix.queries"] += 1
        self._stats["prefix.hit_tokens"] += hit
        self._stats["prefix.query_tokens"] += len(req.tokens)
        return hit

    def _new_live(
        self,
        request_id: Hashable,
        prompt: Sequence[int] | np.ndarray,
        images: Sequence[ImageSpan],
        salt: int,
        digests: Sequence[bytes] | None = None,
        allow_empty: bool = False,
    ) -> LiveRequest:
        """A checked, unregistered `LiveRequest` for this prompt (no blocks yet; an empty
        prompt only with ``allow_empty``)."""
        size = self.config.identity.digest_block_size
        if size is None and digests is not None:
            raise InvalidInput(
                f"request {request_id!r}: block digests given, but this allocator hashes "
                "token ids (BlockIdentity.digest_block_size is None)"
            )
        if size is None:
            what = f"request {request_id!r}: prompt"
            prompt = checked_token_ids(prompt, what, self._length_cap())
        salt = as_count(salt, f"request {request_id!r}: salt")
        if len(prompt) == 0 and not allow_empty:
            raise InvalidSize(f"request {request_id!r}: prompt has 0 tokens")
        self._check_length(request_id, "prompt", len(prompt))
        spans = checked_images(images, len(prompt))
        tokens = TokenBuffer(prompt) if size is None else TokenCount(len(prompt))
        req = LiveRequest(-1, tokens, spans, salt, self._hasher)
        if size is not None:
            req.digests, req.digest_block_size = (digests if digests is not None else []), size
        req.prompt_tokens = len(prompt)
        return req

    def _adopt(self, match: PrefixMatch | None, length: int, salt: int) -> LiveRequest | None:
        """The prompt state of ``match`` when it is still current (taken: used once)."""
        if match is None or match.request is None or match.epoch != self._epoch:
            return None
        req = match.request
        if len(req.tokens) != length or req.salt != salt:
            raise InvalidInput(
                f"the prefix match is of a {len(req.tokens)}-token prompt with salt "
                f"{req.salt}, the request has {length} tokens and salt {salt}"
            )
        match.request = None
        return req

    def _group_needs(
        self, req: LiveRequest, new: int, upto: int, lookahead: int, kept: list[int] | None
    ) -> tuple[list[np.ndarray], list[int], list[int], list[int], list[int]]:
        """Per group, for growing ``req`` to ``new`` tokens: the blocks to release (those
        left behind at ``upto`` tokens), the first still-live block index, the Mamba
        checkpoints skipped inside the span, the scratch states moved past the running
        one (`MambaPolicy.extension`) and the blocks to take. State groups count the
        tokens without the ``lookahead`` slots (the draft's, which hold no state); ``kept``
        (asked for a checkpoint block) collects the groups that keep one."""
        releases: list[np.ndarray] = []
        firsts: list[int] = []
        skips: list[int] = []
        moves: list[int] = []
        counts: list[int] = []
        for g, policy in enumerate(self.policies):
            release, first = req.skipped(g, policy, upto)
            releases.append(release)
            firsts.append(first)
            held = len(req.tables[g])
            if policy.reads_images:
                grow = StateExtension(0, 0, max(0, policy.num_blocks(new, req.images) - held))
            else:
                length = policy.counted_length(new, lookahead)
                grow = policy.extension(held, g in req.speculative_tails, length)
                if kept is not None and (ckpt := grow.keeping_checkpoint()) is not grow:
                    grow = ckpt
                    kept.append(g)  # the groups that keep a checkpoint block
            skips.append(grow.skipped)
            moves.append(grow.moved)
            counts.append(grow.new)
        return releases, firsts, skips, moves, counts

    def allocate(
        self,
        request_id: Hashable,
        num_new_tokens: int,
        *,
        release_upto: int | None = None,
        lookahead: int = 0,
        checkpoint: bool = False,
    ) -> Allocation | None:
        """Give the request slots for ``num_new_tokens`` more tokens in every group.

        In one all-or-nothing core call: blocks the policies no longer need (window/chunk/
        old Mamba state) are released to the cache, then each group gets what it needs.
        ``release_upto`` bounds the release: only blocks no longer read at that many
        tokens go (default: the request's current length). An engine whose earlier step
        may still be running (asynchronous scheduling) passes the tokens whose step has
        finished, so a block that step still reads is not handed out; a later call (or
        `free`) releases it. ``lookahead``: how many of the request's tokens after this
        call are a draft's lookahead slots, which Mamba groups in step-end mode do not
        count (no state is written for them; vLLM's ``num_tokens_main_model``).
        ``checkpoint``: state groups keep a block just below the running state where the
        step would skip it (`StateExtension.keeping_checkpoint`; `cache_checkpoint`). Returns
        None ("no room") with nothing changed when any group cannot be satisfied. Raises
        `UnknownRequest`, `InvalidSize` (``num_new_tokens <= 0`` or beyond
        ``max_model_len``, ``release_upto < 0``)."""
        req = self._request(request_id)
        new = self._checked_growth(request_id, req.num_tokens, num_new_tokens, lookahead)
        upto = release_length(request_id, req.num_tokens, release_upto)
        if req.grow_held(new):  # every slot is held and nothing leaves any window
            return Allocation(self.no_blocks, self.no_blocks, _EMPTY_PLAN, new)
        kept: list[int] | None = [] if checkpoint and self._states is not None else None
        needs = self._group_needs(req, new, upto, lookahead, kept)
        releases, firsts, skips, moves, counts = needs
        cow = CopyOnWrite(req, self._core, counts, releases) if req.shared_tail else None
        quiet = not any(counts) and not any(skips) and not any(moves)
        if not cow and quiet and not any(len(r) for r in releases):
            # the slots are already held and nothing leaves: no core call, empty plan
            req.num_tokens = new
            req.update_quiet_span(self.policies)
            return Allocation(self.no_blocks, self.no_blocks, _EMPTY_PLAN, new)
        self._epoch += 1
        if cow:  # a forked request's write into a shared block takes a copy
            counts, releases = cow.counts, cow.releases
        got = self._core.allocate_arrays(req.internal_id, counts, self._tick(), releases)
        plan = self._drain_plan()
        if got is None:
            return None
        released = tuple(tuple(r.tolist()) for r in releases)  # before the views change
        got, copies = cow.apply(req, got) if cow else (got, ())
        appended = self._extend_tables(req, got, firsts, skips, moves)
        if self._states is not None:
            self._states.allocated(request_id, copies, kept)
        req.num_tokens = new
        req.update_quiet_span(self.policies)
        new_blocks = tuple(tuple(b.tolist()) for b in got)
        return Allocation(new_blocks, released, plan, new, copies, appended)

    def _checked_growth(self, request_id: Hashable, old: int, num_new: int, lookahead: int) -> int:
        """`allocate`'s argument checks; the request's length after it."""
        if type(num_new) is not int:  # the message is built only when needed
            num_new = as_count(num_new, f"request {request_id!r}: num_new_tokens")
        if num_new <= 0:
            raise InvalidSize(f"request {request_id!r}: num_new_tokens must be > 0, got {num_new}")
        new = old + num_new
        self._check_length(request_id, "after allocate", new)
        if not 0 <= lookahead <= new:
            raise InvalidSize(f"request {request_id!r}: lookahead {lookahead} not in [0, {new}]")
        return new

    def _extend_tables(
        self,
        req: LiveRequest,
        got: Sequence[np.ndarray],
        firsts: list[int],
        skips: list[int],
        moves: list[int],
    ) -> tuple[tuple[int, ...], ...]:
        """Record one `allocate`'s releases and new blocks in the request's tables;
        per group the entries appended (`Allocation.appended`)."""
        appended = []
        for g, blocks in enumerate(got):
            table, policy = req.tables[g], self.policies[g]
            start = len(table)
            req.drop_released(g, firsts[g])
            scratch = policy.scratch_blocks()
            req.extend_state(g, skips[g], moves[g], scratch)
            if len(table):
                table.extend(blocks)
            else:  # a fresh array from the core, referenced nowhere else: no copy
                req.tables[g] = IntBuffer.adopt(blocks)
            if policy.holds_state and (skips[g] or moves[g] or len(blocks)):
                appended.append(tuple(req.tables[g].view(start).tolist()))
                if scratch:
                    req.speculative_tails.add(g)
            else:
                appended.append(tuple(blocks.tolist()))
        return tuple(appended)

    def release_skipped(
        self, request_id: Hashable, *, release_upto: int | None = None
    ) -> MappingPlan:
        """Release the blocks no policy needs at the request's current length (or at
        ``release_upto`` tokens, as in `allocate`), allocating nothing: what `allocate`
        would release first, for an engine that frees them even when the allocation is
        refused (vLLM frees skipped blocks before its check).

        Returns the plan (pages that became empty are unmapped). Raises `UnknownRequest`,
        `InvalidSize` (``release_upto < 0``).
        """
        req = self._request(request_id)
        upto = release_length(request_id, req.num_tokens, release_upto)
        skipped = [req.skipped(g, p, upto) for g, p in enumerate(self.policies)]
        releases = [release for release, _ in skipped]
        if not any(len(r) for r in releases):
            return _EMPTY_PLAN
        self._epoch += 1
        got = self._core.allocate_arrays(
            req.internal_id, [0] * self.num_groups, self._tick(), releases
        )
        plan = self._drain_plan()
        if got is None:  # nothing was asked for, so the core cannot refuse
            raise RuntimeError(f"request {request_id!r}: releasing skipped blocks was refused")
        for g, (_, first) in enumerate(skipped):
            req.drop_released(g, first)
        return plan

    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Record generated token ids so their blocks can be hashed by `cache`."""
        req = self._request(request_id)
        what = f"request {request_id!r}: token_ids"
        if req.digests is None:
            token_ids = checked_token_ids(token_ids, what, self._length_cap())
        self._check_length(request_id, "tokens", len(req.tokens) + len(token_ids))
        req.tokens.extend(token_ids)

    def cache(
        self,
        request_id: Hashable,
        num_computed_tokens: int,
        *,
        digests: Sequence[bytes] | None = None,
    ) -> int:
        """Commit the hashes of blocks complete within ``num_computed_tokens``.

        Text groups commit every block whose tokens are all computed (Mamba: the state
        at each checkpoint); image groups commit an image once its last token is
        computed. Returns the number of blocks newly entered in the hash index.
        ``digests``: the request's digests now (caller-named blocks; those past the last
        digest wait for a later call). Raises `UnknownRequest`, `InvalidSize` (more
        tokens than allocated or known).
        """
        req = self._request(request_id)
        if digests is not None and req.digests is not None:
            req.digests = digests
        num_computed_tokens = as_count(
            num_computed_tokens, f"request {request_id!r}: num_computed_tokens"
        )
        known = req.num_tokens if req.digests is not None else min(req.num_tokens, len(req.tokens))
        if num_computed_tokens < 0 or num_computed_tokens > known:
            raise InvalidSize(
                f"request {request_id!r}: {num_computed_tokens} computed tokens, but only "
                f"{req.num_tokens} allocated and {len(req.tokens)} known"
            )
        if num_computed_tokens < req.next_commit:  # no group has a new complete block
            return 0
        added = 0
        for g, policy in enumerate(self.policies):
            added += self._commit_group(req, g, policy, num_computed_tokens)
        if self._text_only:
            req.next_commit = min(
                (
                    (c + 1) * p.tokens_per_block
                    for c, p in zip(req.num_committed, self.policies, strict=True)
                    if p.caches_blocks
                ),
                default=sys.maxsize,
            )
        return added

    def _commit_group(self, req: LiveRequest, g: int, policy: Policy, computed: int) -> int:
        """Offer group g's blocks complete within ``computed`` tokens to the hash index."""
        if not policy.caches_blocks:
            return 0
        table = req.tables[g]
        start = req.num_committed[g]
        if policy.reads_images:
            done = [im for im in req.images if im.end <= computed]
            stop = min(len(table), sum(policy.image_blocks(im) for im in done))  # type: ignore[attr-defined]
            if stop <= start:
                return 0
            hashes = req.image_hashes(policy)[start:stop]
            ids = table.view(start, stop).tolist()
            picked = [i for i in range(start, stop) if ids[i - start] != NULL_BLOCK]
            req.num_committed[g] = stop
            return int(
                self._core.commit(
                    g,
                    [ids[i - start] for i in picked],
                    hashes[[i - start for i in picked]],
                    [policy.prefix_length(i, req.images) for i in picked],
                )
            )
        t = policy.tokens_per_block
        stop = min(len(table), computed // t)
        if self._prompt_states_only[g] and req.prompt_tokens >= 0:
            stop = min(stop, req.prompt_tokens // t)
        if stop <= start:
            return 0
        hashes = req.identities(t, start, stop)
        stop = start + len(hashes)  # the caller's digests may end sooner
        if stop <= start:
            return 0
        req.num_committed[g] = stop
        return int(self._core.commit_run(g, table.view(start, stop), hashes, (start + 1) * t, t))

    def fork(self, parent_id: Hashable, child_ids: Sequence[Hashable]) -> None:
        """Register ``child_ids`` as copies of the live parent that share its blocks (one
        reference each); the block the next token writes into is copied on each holder's
        next write (`Allocation.copies`; per kind: `jenga.fork`). Needs no memory. Raises
        `UnknownRequest`/`DoubleFree` (parent), `InvalidSize` (no child id),
        `DuplicateRequest` (a child id live or repeated), `InvalidInput` (the parent holds
        speculative Mamba states: each holder's drafts would write the same scratch)."""
        parent = self._request(parent_id)
        children = checked_children(parent_id, child_ids, self._requests)
        if parent.speculative_tails:
            raise InvalidInput(
                f"request {parent_id!r}: groups {sorted(parent.speculative_tails)} hold "
                "speculative Mamba states, which a fork cannot share"
            )
        mark_shared_tail(parent, self.policies)
        now = self._tick()
        for cid in children:
            child = forked(parent, self._next_internal)
            share_blocks(self._core, child, now)
            self._requests[cid], self._next_internal = child, self._next_internal + 1
            self._freed.pop(cid, None)

    def free(self, request_id: Hashable) -> MappingPlan:
        """Finish a request: hashed blocks stay cached (evictable), the rest are freed.

        Large pages left with only free blocks are unmapped (the returned plan). Raises
        `DoubleFree` for an id already freed, `UnknownRequest` for one never added.
        """
        req = self._request(request_id)
        now = self._tick()
        self._epoch += 1
        for g in range(self.num_groups):
            live = req.tables[g].view(req.first_live[g])
            if self.policies[g].holds_state:
                live = live[live != NULL_BLOCK]
            self._core.release(g, live, now)
        del self._requests[request_id]
        if self._states is not None:
            self._states.forget(request_id)
        self._freed[request_id] = None
        if len(self._freed) > _FREED_IDS_KEPT:
            self._freed.popitem(last=False)
        return self._drain_plan()

    def evict_cached(self, num_units: int) -> MappingPlan:
        """Give back prefix-cache memory on request: evict whole evictable large pages (no
        block in use, one cached at least), in the order step 3 evicts them
        (`page_eviction_order`), until at least ``num_units`` units are free beyond those
        free now, or no evictable page is left. Blocks cached on pages that live blocks
        keep mapped are not touched (they free no unit).

        Returns the plan (one ``UnmapPage`` per evicted page, in eviction order); the units
        freed are the pages' ``units_per_large_page``. All or nothing: a failure midway
        undoes every eviction. Raises `InvalidSize` (``num_units < 0``).
        """
        if num_units < 0:
            raise InvalidSize(f"num_units must be >= 0, got {num_units}")
        self._epoch += 1
        self._core.evict_cached_pages(num_units)
        return self._drain_plan()

    def uncache_blocks(self, group: int | str, blocks: Sequence[int]) -> MappingPlan:
        """Drop ``blocks`` of ``group`` from the prefix cache (bad data): cached ones turn
        free (pages left empty unmapped: the plan), held ones lose their identity (free,
        not cached, at release). `InvalidSize` (nothing changed): an id outside the group."""
        try:
            self._core.uncache_blocks(self._group(group), [int(b) for b in blocks])
        except IndexError as e:
            raise InvalidSize(str(e)) from None
        self._epoch += 1
        return self._drain_plan()

    # -- capacity ---------------------------------------------------------------------
    @property
    def total_units(self) -> int:
        """Units in the pool now. The allocator owns this count: `set_total_units` moves
        it (``config.total_units`` follows), everything else reads it."""
        return int(self._core.total_units)

    def blocks_to_hold(self, num_tokens: int, request_id: Hashable | None = None) -> list[int]:
        """Per group, the blocks a request must still get to hold ``num_tokens`` tokens
        (a live request's held blocks count; ``None``: a new request). No state changes."""
        req = None if request_id is None else self._requests.get(request_id)
        return [
            max(0, len(p.active_blocks(num_tokens)) - (0 if req is None else req.held(g)))
            for g, p in enumerate(self.policies)
        ]

    def fits(
        self, num_tokens: int, request_id: Hashable | None = None, *, reserved_units: int = 0
    ) -> bool:
        """Whether a request could hold ``num_tokens`` tokens now (admission control): the
        blocks it lacks beyond each group's free blocks, in whole pages, against free units
        plus whole pages' worth of cached blocks, less ``reserved_units``. No changes."""
        use = self.usage()
        missing = self.blocks_to_hold(num_tokens, request_id)
        return pages_fit(
            self.config.groups, missing, use.free_blocks, use.cached_blocks, use.free_units,
            reserved_units,
        )  # fmt: skip

    def units_needed(self, request_id: Hashable, num_new_tokens: int) -> int:
        """Most units ``allocate(request_id, num_new_tokens)`` can newly map: per group,
        the large pages its new blocks would fill if no page held a free block for them
        (0 when every slot is held). What a gate in front of the pool (a shared pool's
        lease) must secure first. No state changes; raises as `allocate` does."""
        req = self._request(request_id)
        n = as_count(num_new_tokens, f"request {request_id!r}: num_new_tokens")
        if n <= 0:
            raise InvalidSize(f"request {request_id!r}: num_new_tokens must be > 0, got {n}")
        old, new = req.num_tokens, req.num_tokens + n
        self._check_length(request_id, "after allocate", new)
        if old <= req.quiet_until and new <= req.held_until:
            return 0
        return pages_for(self.config.groups, self._group_needs(req, new, old, 0, None)[4])

    def set_total_units(self, units: int) -> MappingPlan:
        """Grow or shrink the pool to ``units`` units; returns the plan of the evictions a
        shrink needed (empty otherwise).

        A shrink takes free units first, then evicts whole evictable cached pages in the
        order step 3 evicts them (`evict_cached`). When even those would not free enough,
        it raises `CapacityInUse` naming the units live requests hold, having changed
        nothing. Raises `InvalidSize` (``units <= 0``), `PageTooLarge` (a group's large
        page would not fit). The caller owns the memory behind the units: it maps no more
        than ``units`` at once after this returns.
        """
        total, free = int(self._core.total_units), int(self._core.free_units)
        evictable = int(self._core.counters()["units.evictable.current"])
        units, short = units_to_free(self.config.groups, units, total, free, evictable)
        plan = self.evict_cached(short) if short else _EMPTY_PLAN
        self._core.set_total_units(units)
        self.config = dataclasses.replace(self.config, total_units=units)
        return plan

    def _drain_plan(self) -> MappingPlan:
        keys = self._core.drain_plan()  # one call; empty when no op is pending
        return plan_from_keys(keys) if keys else _EMPTY_PLAN

    # -- prefix matching --------------------------------------------------------------
    def prefix_match(
        self,
        prompt: Sequence[int] | np.ndarray,
        *,
        images: Sequence[ImageSpan] = (),
        salt: int = 0,
        request_id: Hashable = "(prefix match)",
        digests: Sequence[bytes] | None = None,
        max_hit: int | None = None,
        restored_states: bool = False,
    ) -> PrefixMatch:
        """The one prefix lookup: what a new request with this prompt would hit.

        ``hit``: the longest cached prefix valid in every group; ``junction``: the longest
        valid in any one token group (``junction > hit`` means some group, typically full
        attention, already caches a longer shared prefix than a sparse group such as a
        Mamba state or a window can serve; an engine that ends a chunk exactly there gets
        that group's entry cached too, so the next request sharing the prefix hits all of
        it: vLLM's shared-prefix boundary, after Marconi); ``tables``: the hit's blocks per
        group. `add_request` adopts the match (``match=``) while no call that can evict ran
        since, so an engine that looks up and then admits hashes and matches once. No state
        changes; an empty prompt hits nothing. Raises `InvalidInput` / `InvalidSize` as
        `add_request` does (``request_id`` names the request in their messages; ``digests``
        as there). ``max_hit``: the longest hit the caller can use (a shorter prefix valid
        in every group is taken instead of a longer one; None: no limit).
        ``restored_states``: the caller (a KV connector) restores the Mamba states at the
        hit itself, so the hit need only be valid in the stateless groups (unless a state
        group alone runs deeper); ``diverged``: the hit runs past the cached states."""
        if len(prompt) == 0:
            return PrefixMatch(0, 0, [], self._epoch, None)
        req = self._new_live(request_id, prompt, images, salt, digests)
        hit, tables, junction, diverged = self._match(req, max_hit, restored_states)
        return PrefixMatch(hit, junction, tables, self._epoch, req, diverged)

    # -- queries ----------------------------------------------------------------------
    def block_table(self, request_id: Hashable, group: int | str) -> list[int]:
        """The request's block ids in ``group`` by block index; `NULL_BLOCK` where released."""
        return self._request(request_id).tables[self._group(group)].tolist()

    def num_tokens(self, request_id: Hashable) -> int:
        """Tokens with allocated slots."""
        return self._request(request_id).num_tokens

    def held_step(self, request_id: Hashable) -> Callable[[int], bool]:
        """The live request's `grow` with no core call, bound (`LiveRequest.grow_held`)."""
        return self._request(request_id).grow_held

    def committed(self, request_id: Hashable, group: int, start: int) -> np.ndarray:
        """Identities ``(n, 2)`` of a text group's committed blocks ``start..``."""
        req, t = self._request(request_id), self.policies[group].tokens_per_block
        return req.identities(t, start, max(start, req.num_committed[group]))
