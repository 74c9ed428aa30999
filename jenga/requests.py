"""The allocator's per-request view: images, block tables, hash chains, and what a call gave.

Rationale
    The C++ core knows blocks and owners, not requests. What a request is (its tokens,
    its images, one block table per group, how much of it is hashed) lives in Python,
    next to the policies that read it; the allocator (`jenga.allocator`) joins the two.

Approach
    `LiveRequest` holds one request's state. Per group ``g``: ``tables[g]`` (int32 block
    ids by block index, `NULL_BLOCK` where released), ``first_live[g]`` (entries below are
    released) and ``num_committed[g]`` (leading blocks offered to the hash index). Its
    methods answer the per-request questions of `allocate` (which blocks a length no
    longer needs, how far the next calls can skip the core) from the group's policy;
    they never call the core.

        tables[g]:  | NULL | NULL | b7 | b3 | b9 |      first_live[g] = 2
                      released      live blocks

    `ImageSpan` describes an image of a prompt, `Allocation` what one `allocate` gave.

Limitations
    The fast-path limits look at most `QUIET_HORIZON` tokens ahead, so a long decode
    recomputes them every 4096 tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from jenga import _core
from jenga.errors import InvalidSize
from jenga.plan import MappingPlan
from jenga.policies import Policy
from jenga.prefix import (
    HashChain,
    IntBuffer,
    TokenCount,
    digest_identities,
    image_block_hashes,
    no_identities,
)

NULL_BLOCK = -1
"""Block-table entry of a block the request released (out of the window, an old Mamba state)."""
QUIET_HORIZON = 4096  # tokens past the current length the fast-path limits look


@dataclass(frozen=True)
class ImageSpan:
    """An image of a request: ``length`` image (encoder) tokens keyed by ``content_hash``.

    ``in_text=True`` (LLaVA-style): the image's tokens sit in the prompt at positions
    ``[start, start + length)``; every group stores them, cross-attention and vision groups
    store them again as image tokens. ``in_text=False`` (encoder-side, e.g. Llama 3.2
    Vision / mllama): the prompt holds one placeholder token at ``start`` (its
    ``<|image|>``); self-attention groups store only the text, and image groups
    (cross attention) store the ``length`` encoder tokens, all or nothing, from the step
    that computes the placeholder. Either way ``[start, end)`` is the span of prompt
    positions the image occupies, and those positions are hashed as the image's key.
    """

    start: int
    length: int
    content_hash: int
    in_text: bool = True

    @property
    def end(self) -> int:
        """End of the image's prompt positions (``start + 1`` for an encoder-side image)."""
        return self.start + (self.length if self.in_text else 1)


@dataclass(frozen=True)
class BlockCopy:
    """A copy-on-write the engine performs before the step that writes ``dst``: copy
    block ``src`` of ``group`` (shared with a forked sibling, or a cached state) into
    ``dst``, which now stands at block index ``index`` of the request's table in place of
    ``src`` (``moved``: the request keeps ``src`` there and ``dst`` takes over its prefix
    cache entry, `jenga.substates`). ``retained``: blocks the allocator keeps a reference
    on until the engine reports the copy ran (`JengaAllocator.release_retained`)."""

    group: int
    index: int
    src: int
    dst: int
    retained: tuple[int, ...] = ()
    moved: bool = False


class Allocation(NamedTuple):
    """What `allocate` gave: per group (config order) the new block ids, and the plan.
    (A named tuple: built on every allocating call, it costs a fraction of a frozen
    dataclass.)

    ``released`` lists, per group, the blocks the request gave back to the cache in the
    same call (they left the sliding window / chunk, or an old Mamba state).
    ``copies``: the copy-on-writes of a forked request's shared last block
    (`jenga.fork`); their ``dst`` blocks replace table entries and are not in
    ``new_blocks``.
    """

    new_blocks: tuple[tuple[int, ...], ...]
    released: tuple[tuple[int, ...], ...]
    plan: MappingPlan
    num_tokens: int
    copies: tuple[BlockCopy, ...] = ()
    # per group the entries the call appended to the table, in order: as ``new_blocks``
    # but for a state group also its NULL (skipped) entries and the scratch states it
    # moved (`jenga.policies.StateExtension`); empty when nothing was allocated
    appended: tuple[tuple[int, ...], ...] = ()


@dataclass
class LiveRequest:
    """One request as the allocator tracks it (see the module note)."""

    internal_id: int
    tokens: IntBuffer | TokenCount  # a count only when the caller names blocks
    images: tuple[ImageSpan, ...]
    salt: int
    hasher: _core.BlockHasher  # the allocator's (`jenga.prefix.BlockIdentity`)
    num_tokens: int = 0  # tokens with allocated slots (a hit counts as allocated)
    # `allocate` fast path: while num_tokens <= quiet_until and the new length <=
    # held_until, no group releases or grows (both only grow; -1: unknown)
    quiet_until: int = -1
    held_until: int = -1
    next_commit: int = 0  # `cache` below this many computed tokens commits nothing
    num_hit: int = 0
    tables: list[IntBuffer] = field(default_factory=list)  # int32 block ids per group
    first_live: list[int] = field(default_factory=list)  # entries below are NULL_BLOCK
    num_committed: list[int] = field(default_factory=list)  # leading blocks offered to index
    chains: dict[int, HashChain] = field(default_factory=dict)  # tokens_per_block -> chain
    # the caller's chained digests, one per `digest_block_size` tokens (None: hash tokens)
    digests: Sequence[bytes] | None = None
    digest_block_size: int = 0
    # prompt tokens at admission (-1: unknown; Mamba caching may stop there)
    prompt_tokens: int = -1
    # group -> block index shared with a forked sibling that the next token writes into
    # (copied on that write: `jenga.fork`)
    shared_tail: dict[int, int] = field(default_factory=dict)
    # state groups whose table ends with speculative scratch states (`MambaPolicy`)
    speculative_tails: set[int] = field(default_factory=set)

    def grow_held(self, length: int) -> bool:
        """`JengaAllocator.allocate`'s fast path as one method: True (and the request now
        has ``length`` tokens, if more) when every slot up to ``length`` is held and no
        block leaves any window; False (nothing changed) when the allocator must look."""
        if self.num_tokens <= self.quiet_until and length <= self.held_until:
            if length > self.num_tokens:
                self.num_tokens = length
            return True
        return False

    def held(self, g: int) -> int:
        """Blocks the request holds in group g (released entries are `NULL_BLOCK`)."""
        return int(np.count_nonzero(self.tables[g].view(0) != NULL_BLOCK))

    def skipped(self, g: int, policy: Policy, length: int) -> tuple[np.ndarray, int]:
        """Group g's blocks the request no longer reads at ``length`` (a state kind:
        non-NULL only) and its first live index once they are released."""
        table = self.tables[g]
        first = min(policy.first_live_block(length, self.images), len(table))
        live = table.view(self.first_live[g], first)
        release = live[live != NULL_BLOCK] if policy.holds_state else live
        return release, max(first, self.first_live[g])

    def extend_state(self, g: int, skipped: int, moved: int, num_scratch: int) -> None:
        """Append a state group's ``skipped`` NULL entries, then move the first ``moved``
        of its ``num_scratch`` scratch states (the table's tail) to the end, NULL where
        they were (`jenga.policies.StateExtension`; the allocator's new blocks follow)."""
        table = self.tables[g]
        if skipped:
            table.extend(np.full(skipped, NULL_BLOCK, dtype=np.int32))
        if moved:
            start = len(table) - skipped - num_scratch
            scratch = table.view(start, start + moved)
            ids = scratch.copy()
            scratch[:] = NULL_BLOCK
            table.extend(ids)

    def drop_released(self, g: int, first: int) -> None:
        """NULL group g's table entries below ``first`` (released) and record it."""
        if first > self.first_live[g]:
            self.tables[g].view(self.first_live[g], first)[:] = NULL_BLOCK
        self.first_live[g] = first

    def update_quiet_span(self, policies: Sequence[Policy]) -> None:
        """Set the fast-path limits from the monotone policy functions.

        ``quiet_until``: the largest length L (within the horizon) at which no group's
        `first_live_block` passes what it already released; ``held_until``: the largest
        length its tables already cover (`num_blocks` within the table). Both functions
        are nondecreasing in the length: a policy's closed form gives each limit
        (`Policy.last_length_held`, `Policy.last_length_first_live`), else a galloping
        search finds it.
        """
        cur = self.num_tokens
        quiet = held = cur + QUIET_HORIZON
        images = self.images
        for g, policy in enumerate(policies):
            n, first = len(self.tables[g]), self.first_live[g]
            if first < n:
                limit = policy.last_length_first_live(first)
                quiet = _last_length(limit, _first_live_within, (policy, images, first), cur, quiet)
            limit = policy.last_length_held(n)
            held = _last_length(limit, _blocks_within, (policy, images, n), cur, held)
        self.quiet_until, self.held_until = quiet, held

    def identities(self, tokens_per_block: int, start: int, stop: int) -> np.ndarray:
        """Identities of text blocks ``start..`` (at most ``stop``) of ``tokens_per_block``
        tokens: the caller's digests when it names blocks (fewer where they end), else
        the request's hash chain over its tokens (extended as needed)."""
        if self.digests is not None:
            t, size = tokens_per_block, self.digest_block_size
            return digest_identities(self.digests, size, t, start, stop)
        chain = self.chain(tokens_per_block)
        chain.extend(self.tokens, stop * tokens_per_block, self.images)  # type: ignore[arg-type]
        return chain.hashes[start:stop]

    def chain(self, tokens_per_block: int) -> HashChain:
        """The request's hash chain for blocks of ``tokens_per_block`` (shared by groups)."""
        chain = self.chains.get(tokens_per_block)
        if chain is None:
            chain = HashChain(self.hasher, self.salt, tokens_per_block)
            self.chains[tokens_per_block] = chain
        return chain

    def image_hashes(self, policy: Policy) -> np.ndarray:
        """Identities ``(n, 2)`` of an image group's blocks, image after image."""
        t = policy.tokens_per_block
        parts = [
            image_block_hashes(self.hasher, im.content_hash, policy.image_blocks(im), t, self.salt)  # type: ignore[attr-defined]
            for im in self.images
        ]
        return np.concatenate(parts) if parts else no_identities()


@dataclass
class PrefixMatch:
    """What `JengaAllocator.prefix_match` found for a prompt, kept for `add_request`.

    ``hit``: the cached prefix a request with this prompt would claim; ``tables``: per group
    the block table it would start with; ``junction``: the longest prefix any one group
    serves (a group holding no state, where one caches). ``request`` holds the prompt's
    state built for the lookup (token ids, hash chains); `add_request` adopts it (and sets
    it to None) when ``epoch`` is still the allocator's, i.e. no call that can evict ran
    since the lookup. ``diverged``: the hit runs deeper than the state groups' cached states
    (``restored_states``: their tables hold no state at the hit, the caller restores it).
    """

    hit: int
    junction: int
    tables: list[list[int]]
    epoch: int
    request: LiveRequest | None
    diverged: bool = False


def checked_images(images: Sequence[ImageSpan], num_tokens: int) -> tuple[ImageSpan, ...]:
    """The spans as a tuple; `InvalidSize` unless non-empty, sorted, disjoint, in the prompt."""
    spans = tuple(images)
    prev_end = 0
    for im in spans:
        if im.length <= 0 or im.start < prev_end or im.end > num_tokens:
            raise InvalidSize(
                f"image span [{im.start}, {im.end}) must be non-empty, sorted, "
                f"non-overlapping and inside the {num_tokens}-token prompt"
            )
        prev_end = im.end
    return spans


def _last_length(
    limit: int | None, pred: Callable[..., bool], args: tuple[Any, ...], cur: int, hi: int
) -> int:
    """min(``hi``, the last length >= ``cur - 1`` a nondecreasing-in-length condition
    holds at): the policy's closed form ``limit`` when it has one, else a galloping
    search of ``pred(*args, length)`` over ``[cur, hi]`` (the partial is built only
    then: this runs on every allocation that moves a window)."""
    if limit is None:
        return min(hi, _last_true(functools.partial(pred, *args), cur, hi))
    return min(hi, limit if limit >= cur else cur - 1)


def _last_true(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest L in [lo, hi] with ``pred(L)`` for a predicate true then false;
    ``lo - 1`` when ``pred(lo)`` is already false."""
    if not pred(lo):
        return lo - 1
    step = 1
    good = lo
    while good < hi:  # gallop, then bisect the last step
        probe = min(good + step, hi)
        if not pred(probe):
            bad = probe
            while bad - good > 1:
                mid = (good + bad) // 2
                if pred(mid):
                    good = mid
                else:
                    bad = mid
            return good
        good, step = probe, step * 2
    return good


def _first_live_within(policy: Policy, images: Sequence[ImageSpan], first: int, L: int) -> bool:
    return policy.first_live_block(L, images) <= first


def _blocks_within(policy: Policy, images: Sequence[ImageSpan], n: int, L: int) -> bool:
    return policy.num_blocks(L, images) <= n


def live_refcounts(
    requests: Mapping[Hashable, LiveRequest], g: int, holds_state: bool
) -> dict[int, int]:
    """Per block of group g, how many live tables hold it (`check_invariants`); asserts
    that entries below ``first_live`` are NULL and live ones are not (a state kind may
    have NULL checkpoints inside one step's span)."""
    refs: dict[int, int] = {}
    for rid, req in requests.items():
        table = req.tables[g].tolist()
        assert all(b == NULL_BLOCK for b in table[: req.first_live[g]]), (
            f"request {rid!r} group {g}: live entry below first_live {req.first_live[g]}"
        )
        for b in table[req.first_live[g] :]:
            if b == NULL_BLOCK and holds_state:
                continue  # a checkpoint inside one step's span, never held
            assert b != NULL_BLOCK, f"request {rid!r} group {g}: hole in live blocks"
            refs[b] = refs.get(b, 0) + 1
    return refs


def release_length(request_id: Hashable, num_tokens: int, release_upto: int | None) -> int:
    """The length whose out-of-window blocks a call releases: ``release_upto`` capped at
    the request's ``num_tokens`` (all of them when None)."""
    if release_upto is None:
        return num_tokens
    if release_upto < 0:
        raise InvalidSize(f"request {request_id!r}: release_upto must be >= 0, got {release_upto}")
    return min(release_upto, num_tokens)


def check_live_tables(
    requests: Mapping[Hashable, LiveRequest],
    policies: Sequence[Policy],
    core: _core.Core,
    retained: Mapping[tuple[int, int], int] | None = None,
) -> None:
    """`JengaAllocator.check_invariants`' expensive half: every live request's table entries
    are USED blocks, with per-block reference counts equal to the live tables holding them
    plus the references ``retained`` for pending copies (``{(group, block): count}``)."""
    for g, policy in enumerate(policies):
        refs = live_refcounts(requests, g, policy.holds_state)
        for (rg, b), n in (retained or {}).items():
            if rg == g:
                refs[b] = refs.get(b, 0) + n
        for b, n in refs.items():
            state, refcount = core.block_info(g, b)[:2]
            assert state == 1 and refcount == n, (
                f"group {g} block {b}: {n} live tables hold it, core says state {state} "
                f"refcount {refcount}"
            )
        used = core.group_counts(g)[3]
        assert used == len(refs), (
            f"group {g}: core has {used} used blocks, live tables hold {len(refs)}"
        )
