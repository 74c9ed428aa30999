"""Forking a live request into samples or beams that share its blocks, copy-on-write.

Rationale
    Parallel sampling and beam search run k sequences over one prompt (PagedAttention
    §4.4). Their prompt's cache is the same bytes k times; only the tokens they generate
    differ. Sharing the blocks by reference, and copying a block only when two holders
    would write different tokens into it, stores the prompt once.

Approach
    `JengaAllocator.fork` registers each child as a copy of the parent's `LiveRequest`
    (tokens, block tables, hash chains, commit marks) and takes one reference on every
    live block of every group for it (`Core.acquire`, as a prefix hit does), so the
    expensive invariant "refcount == live tables holding the block" holds unchanged.
    Freeing a child drops its references like any request's.

    A complete block is never written again, so sharing it is free. The block the next
    token writes into, when the request already holds it, is written by every holder:
    it is marked (`LiveRequest.shared_tail`, on the parent and on each child), and the
    holder's next `allocate` that still finds it shared (refcount > 1) takes a fresh
    block in the same all-or-nothing core call, drops its reference on the shared one,
    and reports a `BlockCopy` (group, index, src, dst) the engine performs before that
    step. The last holder to write finds refcount 1 and keeps the block: k + 1 holders
    that all write make k copies.

        parent  | b0 | b1 | b2 (3 of 4 tokens) |          refcount b0, b1, b2: 3
        child   | b0 | b1 | b2 |                        (parent + 2 children)
        child'  | b0 | b1 | b2 |
        child allocates 1 token:  | b0 | b1 | b7 |  copy b2 -> b7, refcount b2: 2

    Per layer kind:

    - full attention: every block shared; the partly filled last block is copied on
      write (none when the fork is at a block boundary);
    - sliding window, chunked local: the live blocks are shared, the released ones are
      NULL in every copy; each holder releases its own references as its window moves;
      the partly filled last block is copied on write;
    - Mamba: the live state (the last block, updated in place until the next checkpoint)
      is one state per sequence: copied once per holder on its first step, like a
      partial block. At a checkpoint boundary the checkpoint is only read (the next
      state is a new block anyway) and is shared;
    - cross attention, vision embeddings: written only while the prompt is prefilled:
      shared, never copied.

Limitations
    Fork once the parent's last step is computed: a block that step still writes would be
    copied before its bytes exist. A request whose identities come from the caller
    (``digest_block_size``) gets a snapshot of the parent's digest list; the caller
    passes each child's own digests to `JengaAllocator.cache`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from jenga import _core
from jenga.errors import DuplicateRequest, InvalidSize
from jenga.policies import Policy
from jenga.prefix import IntBuffer, TokenCount
from jenga.requests import NULL_BLOCK, BlockCopy, LiveRequest


def checked_children(
    parent_id: Hashable, child_ids: Iterable[Hashable], live: Mapping[Hashable, object]
) -> list[Hashable]:
    """The child ids as a list; `InvalidSize` when there is none, `DuplicateRequest` when
    one is live (the parent included) or repeated."""
    children = list(child_ids)
    if not children:
        raise InvalidSize(f"fork of request {parent_id!r}: needs k > 0 child ids, got 0")
    seen: set[Hashable] = set()
    for at, cid in enumerate(children):
        if cid in live or cid in seen:
            what = "is already live" if cid in live else "is repeated"
            raise DuplicateRequest(
                f"fork of request {parent_id!r}: child id {cid!r} (#{at} of {len(children)}) {what}"
            )
        seen.add(cid)
    return children


def mark_shared_tail(req: LiveRequest, policies: Sequence[Policy]) -> None:
    """Mark, per group, the held block the next token writes into (copied on write), and
    turn the `allocate` fast path off until that write is resolved."""
    length = req.num_tokens
    for g, policy in enumerate(policies):
        if policy.reads_images:
            continue
        # the scratch states after a Mamba running state are each holder's own
        j = policy.num_blocks(length + 1, req.images) - 1 - policy.scratch_blocks()
        table = req.tables[g]
        if req.first_live[g] <= j < len(table) and table[j] != NULL_BLOCK:
            req.shared_tail[g] = j
    req.quiet_until = req.held_until = -1


def forked(parent: LiveRequest, internal_id: int) -> LiveRequest:
    """An independent copy of ``parent`` (its tables, tokens, chains) under a new owner id."""
    tokens = parent.tokens
    if isinstance(tokens, TokenCount):
        tokens_copy: IntBuffer | TokenCount = TokenCount(len(tokens))
    else:
        tokens_copy = IntBuffer.adopt(tokens.view().copy())
    return dataclasses.replace(
        parent,
        internal_id=internal_id,
        tokens=tokens_copy,
        tables=[IntBuffer.adopt(t.view().copy()) for t in parent.tables],
        first_live=list(parent.first_live),
        num_committed=list(parent.num_committed),
        chains={t: chain.copy() for t, chain in parent.chains.items()},
        digests=None if parent.digests is None else list(parent.digests),
        shared_tail=dict(parent.shared_tail),
        speculative_tails=set(parent.speculative_tails),
    )


def share_blocks(core: _core.Core, req: LiveRequest, now: int) -> None:
    """Take one reference on every live block of ``req`` (a new holder of them)."""
    for g, table in enumerate(req.tables):
        live = table.view(req.first_live[g])
        core.acquire(g, live[live != NULL_BLOCK], now)


class CopyOnWrite:
    """The copies one `allocate` of ``req`` performs: per marked group whose block is
    still shared, one more block to take (``counts``) and the shared block's reference to
    drop (``releases``); `apply` puts the new blocks in the table. A marked block no
    longer shared is unmarked at once (its holder writes it in place), unless it is named
    in the prefix cache (a state hit inside a checkpoint interval, `jenga.substates`):
    that one is copied too and its reference kept until the copy ran (``retained``)."""

    __slots__ = ("counts", "releases", "sources")

    def __init__(
        self,
        req: LiveRequest,
        core: _core.Core,
        counts: list[int],
        releases: list[np.ndarray],
    ) -> None:
        self.counts, self.releases = counts, releases
        self.sources: list[tuple[int, int, int, bool]] = []  # (group, index, src, named)
        if not req.shared_tail:
            return
        self.counts, self.releases = list(counts), list(releases)
        for g, j in sorted(req.shared_tail.items()):
            src = req.tables[g][j]
            _, refcount, named = core.block_info(g, src)[:3]
            if refcount <= 1 and not named:
                del req.shared_tail[g]
                continue
            self.counts[g] += 1
            if not named:  # a named block (a cached state) keeps its reference: retained
                self.releases[g] = np.append(releases[g], np.int32(src)).astype(np.int32)
            self.sources.append((g, j, src, bool(named)))

    def __bool__(self) -> bool:
        return bool(self.sources)

    def apply(
        self, req: LiveRequest, got: Sequence[np.ndarray]
    ) -> tuple[list[np.ndarray], tuple[BlockCopy, ...]]:
        """Per group the blocks that extend the table (the copies' blocks taken out), and
        the copies, each destination written at its index in ``req``'s table."""
        if not self.sources:
            return list(got), ()
        out = list(got)
        copies = []
        for g, j, src, named in self.sources:
            dst = int(out[g][0])
            out[g] = out[g][1:]
            req.tables[g].view()[j] = dst
            del req.shared_tail[g]
            copies.append(BlockCopy(g, j, src, dst, (src,) if named else ()))
        return out, tuple(copies)
