"""The contract between the simulated engine and the allocators it compares.

Rationale
    The engine loop must not know which allocator it drives: uniform paging, the
    baselines and the real Jenga core all sit behind one small protocol, so every
    allocator sees the identical sequence of calls and the comparison is fair.

Approach
    ``admit``     prefix lookup for a request entering the running set; claims the hit
                  blocks and returns the number of hit tokens (< the sequence length).
    ``allocate``  make room for the first ``n`` tokens of the request's sequence;
                  all-or-nothing: on ``False`` nothing changed.
    ``release``   the request finished or was preempted: its blocks go to the prefix
                  cache (full, computed blocks) or back to free memory.
    ``trim``      after a prefill chunk: release the blocks the request's next step no
                  longer reads (left a window), as `allocate` would at the next step.
    ``snapshot``  bytes held, cached, committed, and the capacity.

    `RequestState` is the engine's view of a request, shared with allocators read-only
    (they may cache derived data, e.g. block hashes, in ``scratch``).

Limitations
    One model per allocator; no swap-out preemption (recompute only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from jenga.sim.workloads import Request


class SimError(RuntimeError):
    """The simulation cannot proceed (a request can never fit, a bad allocator name...)."""


@dataclass
class RequestState:
    """A request inside the engine.

    Invariant: ``num_computed <= len(tokens)``; ``tokens`` is the prompt followed by the
    ``num_generated`` output tokens produced so far.
    """

    request: Request
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_generated: int = 0
    hit_tokens: int = 0
    admitted: bool = False
    num_preemptions: int = 0
    finish_s: float | None = None
    ready_s: float | None = None  # closed loop: when the engine released it (else arrival)
    scratch: dict[object, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt)

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def arrival_s(self) -> float:
        return self.request.arrival_s if self.ready_s is None else self.ready_s

    @property
    def image_tokens(self) -> int:
        return self.request.image_tokens

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= self.request.prompt_len

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: keep the generated tokens, drop all computed KV."""
        self.num_computed = 0
        self.num_preemptions += 1


@dataclass(frozen=True)
class AllocatorSnapshot:
    """Bytes, at one instant.

    ``live_bytes``: charged to running requests (each block once, however shared).
    ``cached_bytes``: held only by the prefix cache (evictable).
    ``committed_bytes``: physically backed (the whole buffer for static allocators;
    mapped chunks for VMM). ``capacity_bytes``: the KV budget.
    """

    capacity_bytes: int
    committed_bytes: int
    live_bytes: int
    cached_bytes: int
    group_live_bytes: dict[str, int] = field(default_factory=dict)


class SimAllocator(Protocol):
    """What the engine calls; see the module note."""

    name: str
    use_prefix_cache: bool  # False: admit finds no hit and nothing is cached

    def admit(self, state: RequestState) -> int: ...

    def allocate(self, state: RequestState, num_tokens: int) -> bool: ...

    def release(self, state: RequestState) -> None: ...

    def trim(self, state: RequestState) -> None: ...

    def snapshot(self) -> AllocatorSnapshot: ...

    def check_invariants(self) -> None: ...
