"""Mapping plans: a batch of map / unmap / remap / share ops applied all-or-nothing.

Rationale
---------
One allocator step changes many slots at once (grow requests, evict a large page and
hand its chunks to another layer type). If the backend fails half-way (OOM, EINVAL, the
VMA limit), the pool, the ranges and the allocator's view of them must still agree, so a
plan either completes or leaves everything exactly as it found it.

Approach
--------
::

    ops:    [ map A[0:4] | remap B[2]->C[0] | unmap A[7] | share C[0]->D[5] ]
    done:     undo_0       undo_1             undo_2       (op 3 fails, undoes itself)
    rollback: undo_2, undo_1, undo_0   then counters restored, plans.rolled_back += 1

Each op is one atomic public `VirtualRange` method (validate, one batched backend call,
update tables). After it succeeds, its inverse is pushed on an undo log: map -> unmap
(and release the chunks it had to create), unmap -> map the same handles back (their
data is intact: unmapped chunks are never released during a plan), remap -> remap back,
share -> unmap the copy. On failure the log runs in reverse; event counters are then
restored from a snapshot taken at the start, so `stats()` reads as before. Counters,
snapshots and the broken mark all go through the pool's `ChunkLedger` (`vmm.ledger`).

Limitations
-----------
Rollback retries each undo step (they are atomic) a few times; if one still fails the
pool is marked broken (every later call raises `BackendError`), since its state can no
longer be vouched for. Ops run in order: an op may depend on an earlier one (remap into
a slot an earlier op unmapped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vmm.errors import MappingError

if TYPE_CHECKING:
    from vmm.ledger import ChunkLedger, PoolHandle
    from vmm.range import VirtualRange

Undo = Callable[[], None]


@dataclass(frozen=True)
class PlanOp:
    """One op of a plan. `src` is None for map/unmap (which act on `dst`)."""

    kind: str  # "map" | "unmap" | "remap" | "share"
    dst: VirtualRange
    dst_slots: tuple[int, ...]
    src: VirtualRange | None = None
    src_slots: tuple[int, ...] = ()


class MappingPlan:
    """An ordered batch of slot ops over ranges of one pool, applied atomically.

    Build with the chaining methods, then `apply()` (or `pool.apply(plan)`)::

        MappingPlan().unmap(swa, [4, 5]).remap(swa, [6], full, [9]).map(full, [10, 11]).apply()
    """

    def __init__(self) -> None:
        self.ops: list[PlanOp] = []

    def __len__(self) -> int:
        return len(self.ops)

    def map(self, rng: VirtualRange, slots: Sequence[int]) -> MappingPlan:
        """Map free (or new) chunks at `slots` of `rng`."""
        self.ops.append(PlanOp("map", rng, tuple(slots)))
        return self

    def unmap(self, rng: VirtualRange, slots: Sequence[int]) -> MappingPlan:
        """Unmap `slots` of `rng`; chunks mapped nowhere else become free."""
        self.ops.append(PlanOp("unmap", rng, tuple(slots)))
        return self

    def remap(
        self,
        src: VirtualRange,
        src_slots: Sequence[int],
        dst: VirtualRange,
        dst_slots: Sequence[int],
    ) -> MappingPlan:
        """Move the chunks at `src_slots` of `src` to `dst_slots` of `dst` (no copy)."""
        self._check_pair("remap", src_slots, dst_slots)
        self.ops.append(PlanOp("remap", dst, tuple(dst_slots), src, tuple(src_slots)))
        return self

    def share(
        self,
        src: VirtualRange,
        src_slots: Sequence[int],
        dst: VirtualRange,
        dst_slots: Sequence[int],
    ) -> MappingPlan:
        """Also map the chunks at `src_slots` of `src` at `dst_slots` of `dst` (no copy)."""
        self._check_pair("share", src_slots, dst_slots)
        self.ops.append(PlanOp("share", dst, tuple(dst_slots), src, tuple(src_slots)))
        return self

    @staticmethod
    def _check_pair(kind: str, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
        if len(src_slots) != len(dst_slots):
            raise MappingError(f"{kind}: {len(src_slots)} source slots, {len(dst_slots)} targets")

    def apply(self, pool: PoolHandle | None = None) -> list[list[int]]:
        """Run every op in order; on any error undo the done ones and re-raise.

        Returns, per op, the handles it touched (new chunks for map, freed-or-still-shared
        chunks for unmap, moved/shared chunks for remap/share)."""
        if not self.ops:
            return []
        pool = self.ops[0].dst.pool if pool is None else pool
        for op in self.ops:
            if op.dst.pool is not pool or (op.src is not None and op.src.pool is not pool):
                raise MappingError(f"plan op {op.kind} touches a range of another pool")
        with pool.ledger.lock:  # one critical section: no other thread sees a half plan
            return _apply(self.ops, pool.ledger)


def _apply(ops: list[PlanOp], ledger: ChunkLedger) -> list[list[int]]:
    """`MappingPlan.apply` under the pool's lock."""
    ledger.check_usable()
    counters = ledger.counters()
    undo_log: list[Undo] = []
    results: list[list[int]] = []
    try:
        for op in ops:
            handles, undo_steps = _run(op)
            results.append(handles)
            undo_log.extend(reversed(undo_steps))
    except BaseException:
        _roll_back(ledger, undo_log)
        ledger.restore_counters(counters)
        ledger.count("plans.rolled_back")
        raise
    ledger.count("plans.applied")
    return results


def _run(op: PlanOp) -> tuple[list[int], list[Undo]]:
    """Run one op atomically; return its handles and its inverse as atomic steps."""
    dst, slots = op.dst, op.dst_slots
    if op.kind == "map":
        handles, num_created = dst.map_new(slots)
        created = handles[len(handles) - num_created :]
        steps: list[Undo] = [lambda: _unshare(dst, slots)]
        if created:
            steps.append(lambda: dst.pool.ledger.forget_created(created))
        return handles, steps
    if op.kind == "unmap":
        handles = dst.unmap(slots)
        return handles, [lambda: dst.map_handles(slots, handles)]
    src = op.src
    assert src is not None
    src_slots = op.src_slots
    if op.kind == "remap":
        handles = src.mapped_handles(src_slots, "remap")
        dst.remap_from(src, src_slots, slots)
        return handles, [lambda: src.remap_from(dst, slots, src_slots)]
    if op.kind == "share":
        handles = src.mapped_handles(src_slots, "share")
        dst.share_from(src, src_slots, slots)
        return handles, [lambda: _unshare(dst, slots)]
    raise MappingError(f"unknown plan op {op.kind!r}")


def _unshare(dst: VirtualRange, slots: Sequence[int]) -> None:
    """Unmap `slots` (the inverse of a map or a share)."""
    dst.unmap(slots)


#: Tries per undo step: each step is atomic, so a transient failure (ENOMEM) is retried.
UNDO_ATTEMPTS = 3


def _roll_back(ledger: ChunkLedger, undo_log: list[Undo]) -> None:
    """Run the undo log in reverse; a step that keeps failing marks the pool broken.

    Every step is atomic on its own (one range method), so retrying one is safe."""
    for undo in reversed(undo_log):
        for attempt in range(1, UNDO_ATTEMPTS + 1):
            try:
                undo()
                break
            except Exception as exc:
                if attempt < UNDO_ATTEMPTS:
                    continue
                raise ledger.mark_broken(
                    f"rollback of a mapping plan failed {attempt} times: {exc}"
                ) from exc
