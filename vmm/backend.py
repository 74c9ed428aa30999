"""The backend contract: the only surface the rest of `vmm` uses to touch memory.

Rationale
---------
The CUDA driver's VMM API and Linux's memfd + mmap have the same shape: physical
memory comes in granularity-sized chunks, virtual address space is reserved
separately at no physical cost, and a chunk is made visible by mapping it at a
granularity-aligned address. Writing that shape down once lets the chunk pool,
virtual ranges, mapping plans and tensors be shared code, tested on the host backend
on any Linux machine, while each backend stays a thin layer of syscalls/driver calls.

Approach
--------
Every method below states its preconditions; a backend *checks* the cheap ones and
raises the errors of `vmm.errors` with the numbers in the message. Every call is
all-or-nothing: a batched call that fails part-way undoes what it did before raising,
so callers (mapping plans) only ever roll back whole calls.

    handle   an int naming one physical chunk of `granularity` bytes
    va       an int virtual address, aligned to `granularity`
    slot     one granularity-sized piece of a reservation

Sharing between processes (optional): `export_handles` describes chunks as file
descriptors + byte offsets (`SharedChunks`) that another process receives over a Unix
socket (SCM_RIGHTS) and passes to its own backend's `import_handles`. Releasing an
imported handle drops this process's reference only; the memory returns to the device
when the exporter releases it too (the CUDA rule for `cuMemImportFromShareableHandle`).

Limitations
-----------
Single device per backend instance. The zero chunk is optional (`zero_handle` None
when a backend cannot provide one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vmm.errors import BackendError


@dataclass(frozen=True)
class SharedChunks:
    """Chunks exported for another process: chunk i lives in ``fds[where[i][0]]`` at byte
    offset ``where[i][1]``. Host: one memfd for all chunks; CUDA: one POSIX fd per chunk
    (offset 0). The fds are new descriptors: whoever holds this closes them (after sending
    them, or after `import_handles`)."""

    fds: tuple[int, ...]
    where: tuple[tuple[int, int], ...]


class ViewFactory(Protocol):
    """Builds zero-copy DLPack capsules over one reservation (see `Backend.view_factory`)."""

    def capsule(
        self,
        offset: int,
        shape: Sequence[int],
        strides: Sequence[int],
        code: int,
        bits: int,
        lanes: int,
    ) -> object:
        """A "dltensor" capsule of `shape`/`strides` (elements; empty = contiguous) at byte
        `offset`; raises if the viewed span leaves the reservation."""
        ...


class Backend(ABC):
    """Thin wrapper over one device's virtual-memory primitives.

    Invariants every implementation keeps:
      * `granularity` is a power of two and never changes.
      * A handle returned by `create` is zero-filled and backed by physical memory
        (populated up front, not on first touch, so the hot path never faults it in).
      * A slot is in exactly one of three states: unmapped (access faults), zero-backed
        (reads return zeros, writes fault) or mapped read-write to one handle.
      * One handle may be mapped at several slots (sharing); writes through one address
        are visible through every other.
    """

    #: "host" or "cuda"
    name: str
    #: "cpu" or "cuda:N" — where tensors over this backend's memory live.
    device: str

    @property
    @abstractmethod
    def granularity(self) -> int:
        """Chunk size in bytes; every size, offset and address below is a multiple."""

    # ---- physical chunks ----------------------------------------------------------
    @abstractmethod
    def create(self, count: int) -> list[int]:
        """Create `count` >= 1 zero-filled physical chunks.

        Raises OutOfMemory if the device/OS cannot provide them; then none were created.
        """

    @abstractmethod
    def release(self, handles: Sequence[int]) -> None:
        """Return chunks to the device/OS. Precondition: none of them is mapped anywhere."""

    # ---- virtual address space ----------------------------------------------------
    @abstractmethod
    def reserve(self, size: int, *, zero: bool = False) -> int:
        """Reserve `size` bytes (a multiple of granularity, > 0) of VA; no physical cost.

        Every slot of a fresh reservation is unmapped, or zero-backed with `zero` (needs
        `zero_handle`). The returned address is aligned to max(granularity, 2 MiB).
        """

    @abstractmethod
    def free_reservation(self, va: int, size: int) -> None:
        """Give back a whole reservation. Precondition: none of its slots is mapped."""

    # ---- mapping ------------------------------------------------------------------
    @abstractmethod
    def map(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        """Map `handles[i]` read-write at slot `vas[i]`, for every i, in one batch.

        Preconditions: equal lengths; each va aligned and inside a reservation; each
        target slot unmapped or zero-backed. Runs of adjacent slots are coalesced
        (one `cuMemSetAccess` per contiguous run on CUDA; one mmap per run of adjacent
        slots over adjacent memfd offsets on host). All-or-nothing.
        """

    @abstractmethod
    def unmap(self, vas: Sequence[int], *, to_zero: bool = False) -> None:
        """Unmap the chunks at slots `vas` (each must be mapped read-write).

        With `to_zero`, the slots become zero-backed instead of unmapped (needs
        `zero_handle`). The reservation never gets a hole. All-or-nothing.
        """

    @property
    @abstractmethod
    def zero_handle(self) -> int | None:
        """Opaque id of the shared read-only zero chunk, or None if this backend has none.

        Only its presence matters to callers (they ask for zero-backed slots through
        `reserve(zero=True)` / `unmap(to_zero=True)`); the host backend's zero chunk is the
        kernel's zero page behind an anonymous read-only mapping, so its id is a sentinel.
        """

    # ---- tensors --------------------------------------------------------------------
    def view_factory(self, va: int, size: int) -> ViewFactory | None:
        """An object that builds DLPack capsules over the reservation at `va`, or None.

        Backends that can build the capsule natively (C++) return one: host, whose capsule's
        deleter keeps the reservation's address range reserved while a tensor lives, without
        calling Python; CUDA, whose capsules name CUDA device memory and keep nothing
        reserved (the factory is retired when the reservation is freed). With None,
        `vmm.tensor` uses `__cuda_array_interface__`.
        """
        return None

    # ---- sharing between processes (optional) --------------------------------------
    def export_handles(self, handles: Sequence[int]) -> SharedChunks:
        """Describe created chunks for another process (nothing changes here)."""
        raise BackendError(f"the {self.name} backend cannot export chunks", op="export")

    def import_handles(self, shared: SharedChunks) -> list[int]:
        """Adopt chunks another process exported; returns local handles (all or nothing).
        `release` of them drops this process's reference only."""
        raise BackendError(f"the {self.name} backend cannot import chunks", op="import")

    # ---- accounting / lifetime ----------------------------------------------------
    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Backend gauges under the dotted scheme of `vmm.stats` (e.g. `vmas.current`).

        Only state, no event counters, so a rolled-back plan leaves them unchanged.
        """

    @abstractmethod
    def close(self) -> None:
        """Unmap everything, free reservations, release chunks. Idempotent."""
