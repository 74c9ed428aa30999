"""Mamba states cached inside a checkpoint interval: prefix hits finer than a state block.

Rationale
    A Mamba group caches one state per checkpoint interval (its ``tokens_per_block``), so
    a request whose shared prefix ends inside an interval resumes from the checkpoint
    below it and recomputes the rest. An engine that ends a step at a finer boundary (vLLM's
    hash block: its "partial hash" hits in Mamba "align" mode) holds the state there once
    the step ran; kept under the name of that boundary, a later request with the prefix
    resumes from it exactly.

Approach
    ``AllocatorConfig.state_unit`` (u) turns it on: u divides every Mamba group's interval
    and is a multiple of the caller's digest block size (the identity of a block is the
    caller's digest at its last token, so the state after n tokens has one name whatever the
    interval, and a checkpoint is found by the same lookup). A Mamba group's prefix lookup
    reads every u-boundary (the allocator's one lookup, at u tokens, then `fine_mask`); the
    hit's table ends with the state found there (`fine_table`). A full-attention group with
    blocks larger than u is a fine group too (`fine_group`): its KV is append-only, so a
    block named at a u-boundary inside it holds every token below that boundary, and a hit
    there (or lower in the same block, `_cover`) takes its whole blocks, then that block.
    Other text groups keep their blocks; the hit step becomes the lcm of their block sizes
    and u.

    A state inside an interval lives in the block the request keeps writing, so the
    cache never shares it in place:

    - `JengaAllocator.cache_state` (the engine's step ends at n, inside an interval):
      the request's running state block X is named by n (prefix length n), and so is
      the attention block holding token n - 1 of a larger-block group (its later tokens
      are written after the name, which covers only the first n);
    - `JengaAllocator.move_state` (before the request's next step, which writes X in
      place): a fresh block Y takes the name, X loses it, and the engine copies X -> Y
      (`BlockCopy` with ``moved``);
    - a request whose hit ends inside an interval (or an attention block) holds the
      named block as its running state or its last block: `mark_state_tail` marks it
      copy-on-write, so its first `allocate` takes a
      fresh block in its place and the engine copies the named one into it
      (`jenga.fork.CopyOnWrite`).

    Every copy's source (and a moved name's destination) keeps one reference until the
    engine says the copy ran (`JengaAllocator.release_retained`): the source is not
    reused before it is read, the destination not evicted before it is written.

Limitations
    Only state groups and full-attention groups hit inside a block: MLA, sliding-window,
    chunked-local and image groups stay on their own block grid. An attention block
    named inside is moved like a state although its named tokens are never overwritten
    (one more copy than needed). Text identities only (the caller's digests).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np

from jenga import _core
from jenga.errors import InvalidSize
from jenga.plan import MappingPlan
from jenga.policies import FullAttentionPolicy, Policy
from jenga.requests import NULL_BLOCK, BlockCopy, LiveRequest

# attention whose KV is append-only (a block read up to any token inside it)
_APPEND_ONLY = (FullAttentionPolicy,)


def append_only(policy_type: type[Policy]) -> bool:
    """Whether a group of this policy class is append-only attention: a block holding
    the tokens up to a point inside it serves a hit there (copied on write)."""
    return policy_type in _APPEND_ONLY


def fine_group(policy: Policy, unit: int | None) -> bool:
    """Whether group ``policy`` is hit every ``unit`` tokens: a state group, or a full
    attention group with larger blocks (its KV is append-only: a block holding the
    tokens up to a unit boundary inside it serves a hit there, copied on write)."""
    if not unit or not policy.caches_blocks:
        return False
    if policy.holds_state:
        return True
    return append_only(type(policy)) and policy.tokens_per_block > unit


def check_state_unit(unit: int, policies: Sequence[Policy], digest_block_size: int | None) -> None:
    """Refuse a ``state_unit`` the groups cannot serve (`InvalidSize`, with the numbers)."""
    if digest_block_size is None or unit <= 0 or unit % digest_block_size:
        raise InvalidSize(
            f"state_unit {unit} must be a positive multiple of the identity's "
            f"digest_block_size ({digest_block_size})"
        )
    for g, policy in enumerate(policies):
        if fine_group(policy, unit) and policy.tokens_per_block % unit:
            raise InvalidSize(
                f"group {g}: state_unit {unit} does not divide its block of "
                f"{policy.tokens_per_block} tokens"
            )


def hit_unit(policy: Policy, unit: int | None) -> int:
    """The prefix step a text group allows: its block, or ``unit`` for a fine group."""
    return unit if unit and fine_group(policy, unit) else policy.tokens_per_block


def _cover(per: int, found: np.ndarray) -> np.ndarray:
    """Per unit boundary i of an attention group (``per`` units a block): the first
    boundary k >= i inside the same block whose block is cached (-1: none). Its KV is
    append-only, so a block named at k holds every token below i too."""
    rows = -(-len(found) // per)
    col = np.full(rows * per, rows * per, dtype=np.int64)
    idx = np.flatnonzero(found >= 0)
    col[idx] = idx
    nxt = np.minimum.accumulate(col.reshape(rows, per)[:, ::-1], axis=1)[:, ::-1].ravel()
    return np.where(nxt < rows * per, nxt, -1)[: len(found)]


def fine_mask(policy: Policy, found: np.ndarray, step: int, unit: int, n: int) -> np.ndarray:
    """For p = step, 2*step, ... <= n: whether a hit of p tokens is cached (a state
    after p tokens; for attention every whole block below p and a block holding p's
    tokens of its own block, named at p or after it)."""
    p = step * np.arange(1, n // step + 1, dtype=np.int64)
    if policy.holds_state:
        return found[p // unit - 1] >= 0
    per = policy.tokens_per_block // unit
    misses = np.flatnonzero(found[per - 1 :: per] < 0)
    run = int(misses[0]) if len(misses) else len(found) // per
    return (_cover(per, found)[p // unit - 1] >= 0) & (p // policy.tokens_per_block <= run)


def fine_table(policy: Policy, found: np.ndarray, unit: int, hit: int) -> list[int]:
    """A fine group's table for a hit of ``hit`` tokens: a state group's NULLs, then the
    state there; an attention group's whole blocks, then the block covering ``hit``."""
    table = [NULL_BLOCK] * policy.hit_table_length(hit)
    if not table:
        return table
    if policy.holds_state:
        table[-1] = int(found[hit // unit - 1])
        return table
    per = policy.tokens_per_block // unit
    table[: hit // policy.tokens_per_block] = found[per - 1 : hit // unit : per].tolist()
    if hit % policy.tokens_per_block:
        table[-1] = int(found[_cover(per, found)[hit // unit - 1]])
    return table


def mark_state_tail(req: LiveRequest, hit: int, policies: Sequence[Policy], unit: int) -> None:
    """Mark each state group whose hit ends inside an interval copy-on-write (its named
    state is the block the request's first step would write), and turn the `allocate`
    fast path off until that write is resolved."""
    for g, policy in enumerate(policies):
        t = policy.tokens_per_block
        if fine_group(policy, unit) and hit % t and len(req.tables[g]):
            req.shared_tail[g] = len(req.tables[g]) - 1
            req.quiet_until = req.held_until = -1
            if not policy.holds_state:  # its copy is named once the block is whole
                req.num_committed[g] = hit // t


class SubBlockStates:
    """The named running states awaiting their move, and the references kept for copies."""

    def __init__(self, core: _core.Core, policies: Sequence[Policy], unit: int) -> None:
        self.core, self.policies, self.unit = core, policies, unit
        # request id -> {group: (table index, block, tokens)} named by `commit`
        self.entries: dict[Hashable, dict[int, tuple[int, int, int]]] = {}
        self.retained: Counter[tuple[int, int]] = Counter()  # (group, block) -> refs
        # request id -> the groups its last `allocate` kept a checkpoint block in
        self.kept: dict[Hashable, tuple[int, ...]] = {}

    def _ident(self, req: LiveRequest, n: int) -> np.ndarray:
        """The identity a state (or a block named inside) after ``n`` tokens is cached by."""
        return req.identities(self.unit, n // self.unit - 1, n // self.unit)

    def commit(
        self, rid: Hashable, req: LiveRequest, n: int, states: bool | None = None
    ) -> tuple[tuple[int, int], ...]:
        """Name each fine group's running block by ``n`` tokens (see `cache_state`;
        ``states``: only the state groups, or only the attention groups)."""
        if n <= 0 or n % self.unit:
            return ()
        ident = self._ident(req, n)
        named = []
        for g, policy in enumerate(self.policies):
            t = policy.tokens_per_block
            if not fine_group(policy, self.unit) or not n % t or not len(ident):
                continue
            if states is not None and policy.holds_state is not states:
                continue  # a whole block is `cache`'s; no digest yet names nothing
            j = -(-n // t) - 1
            table = req.tables[g]
            if j >= len(table) or (x := int(table[j])) == NULL_BLOCK:
                continue
            if self.core.block_info(g, x)[2] or self.core.lookup(g, ident)[0] >= 0:
                continue  # named already, or another block holds this state
            if self.core.commit(g, [x], ident, [n]):
                self.entries.setdefault(rid, {})[g] = (j, x, n)
                named.append((g, x))
        return tuple(named)

    def checkpoint(
        self, rid: Hashable, req: LiveRequest, column: int, n: int
    ) -> tuple[tuple[int, int], ...]:
        """Name the block at ``column`` of each state group the request's last `allocate`
        kept a checkpoint block in by ``n`` tokens (see `cache_checkpoint`); a name it had
        by its own boundary goes first."""
        kept = self.kept.pop(rid, ())
        if n <= 0 or n % self.unit:
            return ()
        ident = self._ident(req, n)
        named = []
        for g in kept:
            table = req.tables[g]
            if not len(ident) or column >= len(table):
                continue
            x, found = int(table[column]), int(self.core.lookup(g, ident)[0])
            if x == NULL_BLOCK or found not in (-1, x):
                continue  # no block kept there, or another block holds this state
            if found == x:  # its own boundary is the position: `cache` named it
                named.append((g, x))
                continue
            if self.core.block_info(g, x)[2]:
                self.core.uncache_blocks(g, [x])  # named by its boundary: not its state
            if self.core.commit(g, [x], ident, [n]):
                named.append((g, x))
        return tuple(named)

    def forget(self, rid: Hashable) -> None:
        """The request left: no name awaits its move, no checkpoint block its name."""
        self.entries.pop(rid, None)
        self.kept.pop(rid, None)

    def move(self, rid: Hashable, req: LiveRequest, now: int) -> tuple[BlockCopy, ...]:
        """Hand each name `commit` gave a running block to a fresh block (see
        `move_state`); a name no block can take now (no room) is dropped."""
        copies = []
        for g, (j, x, n) in self.entries.pop(rid, {}).items():
            table = req.tables[g]
            if j >= len(table) or int(table[j]) != x or not self.core.block_info(g, x)[2]:
                continue  # released, or the name was dropped (evicted, uncached)
            ident = self._ident(req, n)
            got = self.core.allocate_blocks(g, 1, req.internal_id, now)
            self.core.uncache_blocks(g, [x])  # x stays the request's, unnamed
            if got is None:
                continue
            y = int(got[0])
            self.core.commit(g, [y], ident, [n])
            self.core.acquire(g, [x], now)
            self.retained.update(((g, x), (g, y)))
            copies.append(BlockCopy(g, j, x, y, (x, y), moved=True))
        return tuple(copies)

    def allocated(self, rid: Hashable, copies: Sequence[BlockCopy], kept: list[int] | None) -> None:
        """After an `allocate`: count the references its copies kept (`CopyOnWrite`) and
        note the groups it kept a checkpoint block in (``kept``: it was asked to)."""
        for c in copies:
            self.retained.update((c.group, b) for b in c.retained)
        if kept is not None:
            self.kept[rid] = tuple(kept)

    def release(self, group: int, blocks: Sequence[int], now: int) -> None:
        """Drop one kept reference per block (`InvalidSize` naming one not kept; nothing
        changes then)."""
        wanted = Counter((group, int(b)) for b in blocks)
        for key, n in wanted.items():
            if self.retained[key] < n:
                raise InvalidSize(
                    f"group {group} block {key[1]}: {n} retained reference(s) released, "
                    f"{self.retained[key]} held for copies"
                )
        self.retained.subtract(wanted)
        self.retained += Counter()  # drop the zero counts
        self.core.release(group, [int(b) for b in blocks], now)


class SubStateCalls:
    """`JengaAllocator`'s calls for states inside a checkpoint interval (a mixin)."""

    _states: SubBlockStates | None

    def _require_states(self) -> SubBlockStates:
        if self._states is None:
            raise InvalidSize("this allocator keeps no states inside an interval (state_unit)")
        return self._states

    def cache_state(
        self, request_id: Hashable, num_tokens: int, states: bool | None = None
    ) -> tuple[tuple[int, int], ...]:
        """Name the request's running state by ``num_tokens`` (a multiple of
        ``state_unit`` inside a checkpoint interval, where the engine's step ends), and
        the attention block holding token ``num_tokens - 1`` where a group's blocks are
        larger, so a later request with this prefix resumes there (``states``: True
        names the states only, False the attention blocks only). The engine calls
        `move_state` before the request's next step writes that state. Returns the
        (group, block) named. Raises `UnknownRequest`, `InvalidSize` (no
        ``state_unit``, more tokens than allocated)."""
        keep = self._require_states()
        req = self._allocated(request_id, "state", num_tokens)
        return keep.commit(request_id, req, num_tokens, states)

    def _allocated(self, request_id: Hashable, what: str, num_tokens: int) -> LiveRequest:
        """The live request, checked to hold ``num_tokens`` (`InvalidSize` otherwise)."""
        req = self._request(request_id)  # type: ignore[attr-defined]
        if not 0 <= num_tokens <= req.num_tokens:
            raise InvalidSize(
                f"request {request_id!r}: {what} after {num_tokens} tokens, "
                f"{req.num_tokens} allocated"
            )
        return req

    def cache_checkpoint(
        self, request_id: Hashable, column: int, num_tokens: int
    ) -> tuple[tuple[tuple[int, int], ...], MappingPlan]:
        """Name the block each state group kept at table index ``column`` (`allocate`'s
        ``checkpoint``) by ``num_tokens`` (a multiple of ``state_unit``): the engine's
        step writes the state after that many tokens there, below its running state, so
        it is never moved. Returns the (group, block) named and the plan. Raises
        `UnknownRequest`, `InvalidSize` (no ``state_unit``, more tokens than allocated)."""
        keep = self._require_states()
        req = self._allocated(request_id, "checkpoint", num_tokens)
        self._epoch += 1  # type: ignore[attr-defined]
        named = keep.checkpoint(request_id, req, column, num_tokens)
        return named, self._drain_plan()  # type: ignore[attr-defined]

    def move_state(self, request_id: Hashable) -> tuple[tuple[BlockCopy, ...], MappingPlan]:
        """Before the request's next step: each name `cache_state` gave its running state
        moves to a fresh block, filled by a copy (``moved``) the engine runs before that
        step. Returns the copies and the plan. Raises `UnknownRequest`."""
        states = self._require_states()
        req = self._request(request_id)  # type: ignore[attr-defined]
        if request_id not in states.entries:
            return (), MappingPlan()
        self._epoch += 1  # type: ignore[attr-defined]
        copies = states.move(request_id, req, self._tick())  # type: ignore[attr-defined]
        return copies, self._drain_plan()  # type: ignore[attr-defined]

    def has_named_state(self, request_id: Hashable) -> bool:
        """Whether `cache_state` named a running state of the request not moved yet."""
        return self._states is not None and request_id in self._states.entries

    def release_retained(self, group: int, blocks: Sequence[int]) -> MappingPlan:
        """The engine ran the copies: drop the references `BlockCopy.retained` kept (a
        moved name's block becomes evictable). Raises `InvalidSize` for a block not kept."""
        states = self._require_states()
        self._epoch += 1  # type: ignore[attr-defined]
        states.release(group, blocks, self._tick())  # type: ignore[attr-defined]
        return self._drain_plan()  # type: ignore[attr-defined]
