"""The simulated serving engine: continuous batching over a trace, one allocator at a time.

Rationale
    Allocators differ in how many requests they keep running at once, which decides
    batch size, preemptions and finish time. To compare them fairly the engine must be
    the same for all. Two engines matter: today's vLLM (V1: chunked prefill mixed with
    decodes, memory taken chunk by chunk) and the vLLM 0.6.3 the Jenga paper patched
    (whole-prompt allocation at admission with a 1 % free-block watermark, prefill in
    steps of its own). Both are configurations of this one loop.

Approach
    Each step, with ``prefill="chunked"`` (vLLM V1)::

        1. running requests, oldest first: take min(remaining, budget) tokens; if the
           allocator has no room, preempt the newest running request (release its
           blocks to the cache, recompute later) and retry;
        2. if nothing was preempted, admit arrived waiting requests in order: prefix
           lookup (``admit``), then allocate the first chunk (``admission="chunked"``)
           or the whole prompt (``admission="whole-prompt"``, refused unless
           ``watermark`` of the KV memory stays unused: vLLM 0.6's ``can_allocate``);
           stop at the first that does not fit, at the budget or at ``max_num_seqs``;
        3. execute: advance computed tokens; a request whose sequence is computed emits
           its next output token; finished requests are released;
        4. record the step: memory held versus what the step's tokens needed
           (`needs.step_needed_bytes`), decode batch, simulated time.

    With ``prefill="separate"`` (vLLM 0.6 without chunked prefill, ``_schedule_default``)
    a step first tries to admit waiting requests, each charged its whole length against
    the token budget even where a prefix hit spares the compute (0.6.3's budget); if
    any was admitted the step is prefill only, else every running request decodes one
    token (preempting the newest when memory runs out).

    Simulated time comes from `GPU.step_time_s` (a documented roofline) with the step's
    attention FLOPs (`models.ComputeShape`). Allocator CPU time is the measured wall time
    of every allocator call in the step.

Limitations
    No swap preemption, no speculative decoding, one GPU; arrival times only gate
    admission (the engine jumps over idle gaps).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from jenga.sim.hardware import GPU
from jenga.sim.models import ComputeShape
from jenga.sim.needs import needed_bytes, step_needed_bytes
from jenga.sim.protocol import RequestState, SimAllocator, SimError
from jenga.sim.workloads import Trace
from jenga.specs import ModelSpec

TIMELINE_COLUMNS = (
    "step",
    "time_s",
    "batched_tokens",
    "decode_batch",
    "num_running",
    "num_waiting",
    "live_bytes",
    "needed_bytes",
    "cached_bytes",
    "committed_bytes",
    "alloc_cpu_s",
    "preemptions",
)


ADMISSIONS = ("chunked", "whole-prompt")
PREFILLS = ("chunked", "separate")


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler knobs (vLLM names; see the module note for ``admission`` and ``prefill``)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_steps: int = 2_000_000
    check_invariants_every: int = 0  # 0: never; k: after every k-th step (tests)
    admission: str = "chunked"  # "whole-prompt": vLLM 0.6 allocates the prompt at once
    prefill: str = "chunked"  # "separate": vLLM 0.6 without chunked prefill
    watermark: float = 0.01  # whole-prompt admission keeps this share free (vLLM 0.6)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0 or self.max_steps <= 0:
            raise SimError(f"engine limits must be > 0: {self}")
        if self.admission not in ADMISSIONS:
            raise SimError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.prefill not in PREFILLS:
            raise SimError(f"prefill must be one of {PREFILLS}, got {self.prefill!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise SimError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass
class RunResult:
    """Everything one allocator's run produced. ``timeline`` holds one list per column."""

    allocator: str
    timeline: dict[str, list[float]]
    group_live: dict[str, list[int]]
    prompt_tokens: int = 0
    hit_tokens: int = 0
    num_requests: int = 0
    num_preemptions: int = 0
    capacity_bytes: int = 0
    finish_s: list[float] = field(default_factory=list)
    group_kinds: dict[str, str] = field(default_factory=dict)  # group name -> layer kind


class Engine:
    """Runs one trace through one allocator; see the module note."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPU,
        allocator: SimAllocator,
        config: EngineConfig,
        on_step: Callable[[int, int], None] | None = None,
    ) -> None:
        self.model, self.gpu, self.alloc, self.config = model, gpu, allocator, config
        self.shape = ComputeShape.of(model)
        self._on_step = on_step
        self._alloc_s = 0.0
        self._preempted_in_step = 0
        # the waiting head whose admission failed; not retried until memory is released
        # (vLLM's failed allocate_slots leaves no trace, so a retry would only repeat it)
        self._refused: RequestState | None = None

    # --- timed allocator calls ----------------------------------------------------------

    def _admit(self, s: RequestState) -> int:
        t0 = time.perf_counter()
        try:
            return self.alloc.admit(s)
        finally:
            self._alloc_s += time.perf_counter() - t0

    def _allocate(self, s: RequestState, n: int) -> bool:
        t0 = time.perf_counter()
        try:
            return self.alloc.allocate(s, n)
        finally:
            self._alloc_s += time.perf_counter() - t0

    def _trim(self, s: RequestState) -> None:
        self._refused = None
        t0 = time.perf_counter()
        try:
            self.alloc.trim(s)
        finally:
            self._alloc_s += time.perf_counter() - t0

    def _release(self, s: RequestState) -> None:
        self._refused = None
        t0 = time.perf_counter()
        try:
            self.alloc.release(s)
        finally:
            self._alloc_s += time.perf_counter() - t0

    # --- scheduling ---------------------------------------------------------------------

    def _schedule_running(
        self, running: list[RequestState], waiting: deque[RequestState], budget: int
    ) -> tuple[list[tuple[RequestState, int]], int]:
        scheduled: list[tuple[RequestState, int]] = []
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            n_new = min(len(s.tokens) - s.num_computed, budget)
            while not self._allocate(s, s.num_computed + n_new):
                victim = running.pop()
                self._release(victim)
                victim.reset_for_recompute()
                waiting.appendleft(victim)
                self._preempted_in_step += 1
                if victim is s:
                    break
            else:
                scheduled.append((s, n_new))
                budget -= n_new
                i += 1
        return scheduled, budget

    def _admit_waiting(
        self,
        running: list[RequestState],
        waiting: deque[RequestState],
        budget: int,
        now: float,
        result: RunResult,
    ) -> list[tuple[RequestState, int]]:
        scheduled: list[tuple[RequestState, int]] = []
        while (
            waiting
            and budget > 0
            and len(running) < self.config.max_num_seqs
            and waiting[0].arrival_s <= now
            and waiting[0] is not self._refused
        ):
            s = waiting[0]
            if self.config.prefill == "separate" and len(s.tokens) > budget:
                break  # the whole prompt is charged, cached or not (see `_charge`)
            hit = self._admit(s)
            n_new = min(len(s.tokens) - hit, budget)
            if not self._try_admit(s, hit, n_new):
                self._release(s)
                s.num_computed = 0
                self._refused = s if n_new == len(s.tokens) - hit else None
                break
            if not s.admitted:
                s.admitted, s.hit_tokens = True, hit
                result.hit_tokens += hit
                result.prompt_tokens += s.request.prompt_len
            waiting.popleft()
            running.append(s)
            scheduled.append((s, n_new))
            budget -= self._charge(s, n_new)
        return scheduled

    def _charge(self, s: RequestState, n_new: int) -> int:
        """Token budget an admitted request takes. vLLM 0.6.3 without chunked prefill
        charges a waiting request its whole length, prefix hit or not (`_schedule_prefills`:
        ``assert num_new_tokens == num_prompt_tokens``; cached tokens left the budget only
        with V1), so one step prefills at most ``max_num_batched_tokens`` prompt tokens.
        Chunked prefill charges the tokens it computes."""
        return len(s.tokens) if self.config.prefill == "separate" else n_new

    def _try_admit(self, s: RequestState, hit: int, n_new: int) -> bool:
        """Allocate an admitted request's first chunk or whole prompt (see the module note)."""
        whole = len(s.tokens)
        if self.config.prefill == "separate" and hit + n_new < whole:
            return False  # the whole prompt must fit in this step's token budget
        if self.config.admission == "chunked":
            return self._allocate(s, hit + n_new)
        if not self._allocate(s, whole):
            return False
        snap = self.alloc.snapshot()
        return snap.capacity_bytes - snap.live_bytes >= self.config.watermark * snap.capacity_bytes

    # --- execution ----------------------------------------------------------------------

    def _execute(
        self, scheduled: list[tuple[RequestState, int]], running: list[RequestState], now: float
    ) -> tuple[int, list[RequestState], int]:
        """Advance the scheduled requests; returns (decode batch, finished, needed bytes).

        Needed: what each scheduled request's tokens read or wrote this step; after a
        prefill chunk (which then trims its window) and for running requests the step
        skipped, what the request keeps for its next step (the snapshot is post-step).
        """
        decode_batch = 0
        finished = []
        needed = 0
        for s, n in scheduled:
            if n == 1 and s.num_generated >= 1 and s.num_computed == len(s.tokens) - 1:
                decode_batch += 1
            step_need = step_needed_bytes(
                self.model, s.num_computed, s.num_computed + n, s.image_tokens, s.prompt_done
            )
            s.num_computed += n
            if s.num_computed == len(s.tokens):
                s.tokens.append(s.request.output[s.num_generated])
                s.num_generated += 1
                if s.num_generated == s.request.output_len:
                    s.finish_s = now
                    finished.append(s)
                    continue
            if n > 1:  # a prefill chunk: free what left its window now, not next step
                self._trim(s)
                step_need = self._kept(s)
            needed += step_need
        for s in finished:
            running.remove(s)
            self._release(s)
        busy = {id(s) for s, _ in scheduled}
        needed += sum(self._kept(s) for s in running if id(s) not in busy)
        return decode_batch, finished, needed

    def _kept(self, s: RequestState) -> int:
        return needed_bytes(self.model, s.num_computed, s.image_tokens, s.prompt_done)

    def _schedule(
        self,
        running: list[RequestState],
        waiting: deque[RequestState],
        now: float,
        result: RunResult,
    ) -> list[tuple[RequestState, int]]:
        """The step's (request, new tokens) pairs under the configured prefill mode."""
        budget = self.config.max_num_batched_tokens
        if self.config.prefill == "separate":
            prefills = self._admit_waiting(running, waiting, budget, now, result)
            if prefills:
                return prefills
            return self._schedule_running(running, waiting, budget)[0]
        scheduled, budget = self._schedule_running(running, waiting, budget)
        if not self._preempted_in_step:
            scheduled += self._admit_waiting(running, waiting, budget, now, result)
        return scheduled

    def _step_time(self, scheduled: list[tuple[RequestState, int]], tokens: int) -> float:
        """Simulated seconds of the step: KV bytes its attention reads, FLOPs it computes."""
        kv_read, attention = 0, 0.0
        for s, n in scheduled:
            first, end = s.num_computed, s.num_computed + n
            kv_read += step_needed_bytes(self.model, first, end, s.image_tokens, s.prompt_done)
            attention += self.shape.attention_flops(self.model, first, end, s.image_tokens)
        return self.gpu.step_time_s(self.model.weight_bytes, kv_read, tokens, attention)

    def _record(self, result: RunResult, row: dict[str, float]) -> None:
        snap = self.alloc.snapshot()
        row.update(
            live_bytes=snap.live_bytes,
            cached_bytes=snap.cached_bytes,
            committed_bytes=snap.committed_bytes,
        )
        for col in TIMELINE_COLUMNS:
            result.timeline[col].append(row[col])
        for name, live in snap.group_live_bytes.items():
            result.group_live.setdefault(name, []).append(live)
        result.capacity_bytes = snap.capacity_bytes

    def run(self, trace: Trace) -> RunResult:
        """Serve every request of ``trace``; raises SimError if one can never fit."""
        self._check_lengths(trace)
        states = [RequestState(r) for r in sorted(trace.requests, key=lambda r: r.arrival_s)]
        waiting = self._block_followups(states)
        running: list[RequestState] = []
        result = RunResult(
            self.alloc.name, {c: [] for c in TIMELINE_COLUMNS}, {}, num_requests=len(states)
        )
        result.group_kinds = {g.name: str(g.spec.kind) for g in self.model.groups}
        now, step, done = 0.0, 0, 0
        while waiting or running:
            if not running and waiting[0].arrival_s > now:
                now = waiting[0].arrival_s
            self._alloc_s, self._preempted_in_step = 0.0, 0
            scheduled = self._schedule(running, waiting, now, result)
            if not scheduled:
                self._raise_stuck(running, waiting)
                continue
            tokens = sum(n for _, n in scheduled)
            now += self._step_time(scheduled, tokens)
            decode_batch, finished, step_needed = self._execute(scheduled, running, now)
            self._release_followups(finished, waiting)
            done += len(finished)
            result.finish_s.extend(s.finish_s for s in finished if s.finish_s is not None)
            result.num_preemptions += self._preempted_in_step
            self._record(
                result,
                {
                    "step": step,
                    "time_s": now,
                    "batched_tokens": tokens,
                    "decode_batch": decode_batch,
                    "num_running": len(running),
                    "num_waiting": len(waiting),
                    "needed_bytes": step_needed,
                    "alloc_cpu_s": self._alloc_s,
                    "preemptions": self._preempted_in_step,
                },
            )
            step += 1
            self._maybe_check(step)
            if self._on_step is not None:
                self._on_step(done, len(states))
            if step >= self.config.max_steps:
                raise SimError(f"{self.alloc.name}: no finish after {step} steps")
        return result

    def _block_followups(self, states: list[RequestState]) -> deque[RequestState]:
        """The initial waiting queue; closed-loop follow-ups wait for their predecessor."""
        ids = {s.req_id for s in states}
        self._followups: dict[str, list[RequestState]] = {}
        for s in states:
            if s.request.after:
                if s.request.after not in ids:
                    raise SimError(f"request {s.req_id} follows unknown {s.request.after!r}")
                self._followups.setdefault(s.request.after, []).append(s)
        return deque(s for s in states if not s.request.after)

    def _release_followups(
        self, finished: list[RequestState], waiting: deque[RequestState]
    ) -> None:
        """Queue the follow-ups of finished requests, ``think_s`` after they finished."""
        for parent in finished:
            for child in self._followups.pop(parent.req_id, []):
                assert parent.finish_s is not None
                child.ready_s = parent.finish_s + child.request.think_s
                at = next((i for i, w in enumerate(waiting) if w.arrival_s > child.arrival_s), None)
                waiting.insert(len(waiting) if at is None else at, child)

    def _check_lengths(self, trace: Trace) -> None:
        limit = self.model.max_model_len
        separate = self.config.prefill == "separate"
        for r in trace.requests:
            if separate and r.prompt_len + r.output_len - 1 > self.config.max_num_batched_tokens:
                raise SimError(
                    f"request {r.req_id}: {r.prompt_len} + {r.output_len} tokens exceed "
                    f"max_num_batched_tokens {self.config.max_num_batched_tokens}, which must "
                    "hold a whole prompt when prefill is separate"
                )
            if r.prompt_len + r.output_len - 1 > limit:  # the last output is never computed
                raise SimError(
                    f"request {r.req_id}: {r.prompt_len} prompt + {r.output_len} output tokens "
                    f"exceed {self.model.name}'s max_model_len {limit} (+1)"
                )

    def _maybe_check(self, step: int) -> None:
        every = self.config.check_invariants_every
        if every and step % every == 0:
            self.alloc.check_invariants()

    def _raise_stuck(self, running: list[RequestState], waiting: deque[RequestState]) -> None:
        if running:
            return
        s = waiting[0]
        need = needed_bytes(self.model, len(s.tokens), s.image_tokens)
        raise SimError(
            f"{self.alloc.name}: request {s.req_id} ({len(s.tokens)} tokens, needs "
            f"{need / 2**30:.2f} GiB at least) does not fit in "
            f"{self.alloc.snapshot().capacity_bytes / 2**30:.2f} GiB of KV memory"
        )
