"""A serving engine with a GPU prefix cache and an optional host tier, timing every TTFT.

Rationale
    CaR's claims are about time to first token: a request whose history is cached
    somewhere skips recomputing it, and the question is what the reload costs, when it
    starts, and what the cache keeps. That needs per-request queueing, per-block
    residency and the transfers on the link, which the allocator comparison engine
    (`jenga.sim.engine`, one allocator per run, no tiers) does not model. This engine is
    a vLLM V1-style scheduler over one block pool of a full-attention model, with the
    host tier of `jenga.sim.tiers` beside it.

Approach
    Blocks are ``block_size`` tokens, keyed by a hash chain over the tokens (two requests
    share a block exactly when their sequences agree up to its end). A GPU block is held
    by requests (``ref``) or cached (``ref == 0``, in `evictable`, least recently used
    first; a finished request's blocks enter tail first so its prefix outlives its tail).

    Each step (chunked prefill, token budget, decodes and chunks of running requests
    first, then the waiting queue in order)::

        finish transfers  ->  window / scores  ->  prefetch  ->  schedule  ->  execute
                                                                               -> offload

    * admission (by default only when the whole sequence and one more token fit, as in
      vLLM 0.x, which CaR extends) matches the prompt's leading blocks on either tier;
      host blocks get GPU blocks and a reload (H2D); the request runs once the reload
      allows: ``start + T_load`` when whole, or layer by layer
      ``start + max(T_load / L, T_load - (L - 1) / L x T_compute)`` (layer i's copy
      overlaps layer i-1's compute; T_compute is the first chunk's prefill time);
    * GPU memory is taken from free blocks, then by evicting cached blocks: a block whose
      copy is on the host is dropped; otherwise (CaR) it is offloaded now, the step
      waiting for the copy, or dropped (no tier, or write-through whose copy is gone);
    * above the high-water mark, cached blocks are offloaded in the background (D2H, off
      the critical path) and freed when their copy ends; one hit while the copy is in
      flight keeps the GPU copy (the block is then on both tiers);
    * window: the first ``window`` arrived waiting requests. Entering it adds 1 to the
      score of each of the request's prompt blocks, admission 1 more, completion takes
      both back (CaR's +1 / +1 / -2); with ``window_priority`` the window is reordered
      by CaR's classes (history on the GPU, no history, history on the host);
    * prefetch (CaR): a windowed request whose prefix is partly on the host is reloaded
      ahead when ``min_i TPOT x remaining_i <= T_transfer`` over running requests (the
      first slot frees about when the copy ends; output lengths known, as a perfect
      length predictor), one windowed request per running request that close to its end;
    * write-through (vLLM's CPU offloading): every block is copied to the host as soon as
      it is computed; reloads are whole before the step, no window, no prefetch.

    Step time: `GPU.step_time_s` (the simulator's roofline) plus any wait for a
    synchronous offload. TTFT: end of the step that emits the first token minus arrival.

Limitations
    Full-attention models only; one GPU; CaR's sparsification is not modelled; a reload
    in flight delays only its request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from jenga.sim.hardware import GPU
from jenga.sim.models import ComputeShape
from jenga.sim.protocol import SimError
from jenga.sim.tiers import HostTier, TierConfig
from jenga.sim.workloads import Request, Trace
from jenga.specs import Kind, ModelSpec

BlockKey = Hashable


@dataclass(frozen=True)
class TierEngineConfig:
    """Scheduler knobs (vLLM names) and the cache under test."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_steps: int = 2_000_000
    prefix_cache: bool = True
    tier: TierConfig | None = None
    # admit only when the whole prompt fits now (vLLM 0.x, which CaR extends); False:
    # vLLM V1, which admits a first chunk and may preempt the request a few steps later
    whole_prompt_admission: bool = True
    check_invariants_every: int = 0  # 0: never; k: after every k-th step (tests)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0 or self.max_steps <= 0:
            raise SimError(f"engine limits must be > 0: {self}")
        if self.tier is not None and not self.prefix_cache:
            raise SimError("a host tier needs the prefix cache (prefix_cache=True)")


@dataclass
class GpuBlock:
    ref: int = 0
    valid_s: float = 0.0  # when its data is on the GPU (a reload's end)
    offload_end: float | None = None  # a background offload started for it


@dataclass
class TierRequest:
    """A request inside the engine; ``held`` are its keyed GPU blocks, in sequence order."""

    request: Request
    keys: tuple[BlockKey, ...]
    ready_s: float
    block_size: int
    num_computed: int = 0
    num_generated: int = 0
    held: list[BlockKey] = field(default_factory=list)
    anon: int = 0  # unkeyed GPU blocks (the partial tail, blocks not yet computed)
    run_after_s: float = 0.0  # a reload in flight: not scheduled before
    prefetch_span: tuple[float, float] | None = None  # its prefetches' (first start, last end)
    prefetched_host_blocks: int = 0
    score_added: int = 0
    in_window: bool = False
    admitted: bool = False
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def seq_len(self) -> int:
        return self.request.prompt_len + self.num_generated

    @property
    def prompt_keys(self) -> tuple[BlockKey, ...]:
        """Keys of the prompt blocks a hit may cover (the last prompt token is computed)."""
        return self.keys[: (self.request.prompt_len - 1) // self.block_size]


def block_keys(tokens: tuple[int, ...], block_size: int) -> tuple[BlockKey, ...]:
    """One key per full block: a hash chain, equal exactly when the prefixes are equal."""
    keys: list[BlockKey] = []
    prev: int = 0
    for i in range(len(tokens) // block_size):
        prev = hash((prev, tokens[i * block_size : (i + 1) * block_size]))
        keys.append(prev)
    return tuple(keys)


@dataclass
class TierStats:
    """What one run did; ``ttft_s`` in request order of first tokens."""

    ttft_s: list[float] = field(default_factory=list)
    ttft_by_request: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    reload_bytes: int = 0
    offload_bytes: int = 0
    lost_blocks: int = 0  # cached blocks no tier holds any more (dropped or evicted last)
    host_evicted_blocks: int = 0
    offload_wait_s: float = 0.0  # steps waiting for synchronous offloads
    prefetches: int = 0
    preemptions: int = 0
    steps: int = 0
    sim_time_s: float = 0.0


class TierEngine:
    """Runs one trace; see the module note."""

    def __init__(self, model: ModelSpec, gpu: GPU, kv_bytes: int, config: TierEngineConfig):
        kinds = {g.spec.kind for g in model.groups}
        if kinds != {Kind.FULL} or any(g.spec.token_fraction != (1, 1) for g in model.groups):
            raise SimError(f"the tier engine models full-attention models only; {model.name}")
        self.model, self.gpu, self.config = model, gpu, config
        self.shape = ComputeShape.of(model)
        self.block_size = model.groups[0].spec.block_size
        self.block_bytes = model.bytes_per_token * self.block_size
        self.num_blocks = kv_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise SimError(f"{kv_bytes} bytes of KV memory hold no {self.block_bytes}-byte block")
        self.num_layers = model.num_model_layers
        self.tier = config.tier
        self.gpu_blocks: dict[BlockKey, GpuBlock] = {}
        self.evictable: dict[BlockKey, None] = {}  # ref == 0, least recently used first
        self.num_anon = 0
        self.score: dict[BlockKey, int] = {}
        self.host: HostTier | None = None
        if self.tier is not None:
            self.host = HostTier(self.tier.host_bytes, self.tier.policy, self._score_of)
        self.h2d_free_s = 0.0
        self.d2h_free_s = 0.0
        self.reloads: list[tuple[float, list[BlockKey]]] = []  # (end, pinned host keys)
        self.offloads: list[tuple[float, BlockKey]] = []  # background offloads in flight
        self.stats = TierStats()
        self._stall_s = 0.0
        self._last_step_s = 0.0

    # --- blocks ---------------------------------------------------------------------------

    def _score_of(self, key: BlockKey) -> int:
        return self.score.get(key, 0)

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self.gpu_blocks) - self.num_anon

    def _claim(self, key: BlockKey) -> GpuBlock:
        block = self.gpu_blocks[key]
        block.ref += 1
        self.evictable.pop(key, None)
        return block

    def _unclaim(self, keys: list[BlockKey]) -> None:
        """Drop one reference to each; the tail becomes the first to evict."""
        for key in reversed(keys):
            block = self.gpu_blocks[key]
            block.ref -= 1
            if block.ref == 0:
                self.evictable[key] = None

    def _take(self, n: int, now: float) -> bool:
        """Make ``n`` blocks free (evicting cached ones); all or nothing."""
        if self.num_free + len(self.evictable) < n:
            return False
        while self.num_free < n:
            self._evict(next(iter(self.evictable)), now)
        return True

    def _take_keeping(
        self, gpu_keys: list[BlockKey], host_keys: list[BlockKey], n: int, now: float
    ) -> bool:
        """Claim ``gpu_keys`` and take ``n`` blocks, the evictions sparing the matched
        blocks on both tiers (offloads may evict host entries); on failure claim nothing."""
        for key in gpu_keys:
            self._claim(key)
        self._pin(host_keys, 1)
        try:
            if self._take(n, now):
                return True
            self._unclaim(gpu_keys)
            return False
        finally:
            self._pin(host_keys, -1)

    def _pin(self, keys: list[BlockKey], delta: int) -> None:
        if self.host is not None:
            for key in keys:
                self.host.entries[key].pins += delta

    def _evict(self, key: BlockKey, now: float) -> None:
        """A cached block leaves the GPU: dropped, or offloaded (the step waits for it)."""
        del self.evictable[key]
        block = self.gpu_blocks.pop(key)
        if self.host is None or self.tier is None:
            self.stats.lost_blocks += 1
            return
        entry = self.host.get(key)
        if entry is not None:  # its copy exists or is on the link: wait for the copy's end
            self._stall_s = max(self._stall_s, entry.ready_s - now)
            return
        if self.tier.write_through or block.offload_end is not None:
            self.stats.lost_blocks += 1  # its host copy was evicted: gone
            return
        end = self._copy_to_host(key, now)
        if end is None:
            self.stats.lost_blocks += 1
        else:
            self._stall_s = max(self._stall_s, end - now)

    def _copy_to_host(self, key: BlockKey, now: float) -> float | None:
        """Start a D2H copy of ``key`` into the host tier; its end, or None if no room."""
        assert self.host is not None and self.tier is not None
        start = max(now, self.d2h_free_s)
        end = start + self.tier.link.transfer_s(self.block_bytes)
        evicted = self.host.insert(key, self.block_bytes, end)
        if evicted is None:
            return None
        self.d2h_free_s = end
        self.stats.offload_bytes += self.block_bytes
        self.stats.host_evicted_blocks += len(evicted)
        self.stats.lost_blocks += sum(1 for k in evicted if k not in self.gpu_blocks)
        return end

    def _reload(self, keys: list[BlockKey], now: float) -> tuple[float, float]:
        """GPU blocks for host-resident ``keys`` (already taken), one H2D copy: (start, end)."""
        assert self.host is not None and self.tier is not None
        entries = [self.host.entries[k] for k in keys]
        start = max([now, self.h2d_free_s, *(e.ready_s for e in entries)])
        end = start + self.tier.link.transfer_s(self.block_bytes * len(keys))
        self.h2d_free_s = end
        for key, entry in zip(keys, entries, strict=True):
            entry.pins += 1
            self.host.touch(key)
            self.gpu_blocks[key] = GpuBlock(ref=1, valid_s=end)
        self.reloads.append((end, list(keys)))
        self.stats.reload_bytes += self.block_bytes * len(keys)
        return start, end

    def _match(self, state: TierRequest, first: int) -> tuple[list[BlockKey], list[BlockKey]]:
        """The prompt blocks from block ``first`` on that are cached, up to the first that
        is not: (those on the GPU, those on the host only), each in sequence order."""
        on_gpu: list[BlockKey] = []
        on_host: list[BlockKey] = []
        for key in state.prompt_keys[first:]:
            if key in self.gpu_blocks:
                on_gpu.append(key)
            elif self.host is not None and key in self.host:
                on_host.append(key)
            else:
                break
        return on_gpu, on_host

    def _hold(
        self, state: TierRequest, gpu_keys: list[BlockKey], host_keys: list[BlockKey]
    ) -> None:
        """Append the matched blocks to ``state.held`` in sequence order."""
        first = len(state.held)
        state.held += state.prompt_keys[first : first + len(gpu_keys) + len(host_keys)]

    # --- admission, prefetch, release -------------------------------------------------------

    def _admit(self, state: TierRequest, budget: int, now: float) -> int:
        """Claim the request's cached prefix and its first chunk; tokens scheduled or 0."""
        gpu_keys: list[BlockKey] = []
        host_keys: list[BlockKey] = []
        prefetched = len(state.held)
        if self.config.prefix_cache:
            gpu_keys, host_keys = self._match(state, prefetched)
        matched = prefetched + len(gpu_keys) + len(host_keys)
        n_new = min(state.seq_len - matched * self.block_size, budget)
        anon = -(-(matched * self.block_size + n_new) // self.block_size) - matched
        if self.config.whole_prompt_admission:
            anon = max(anon, -(-(state.seq_len + 1) // self.block_size) - matched)
        if not self._take_keeping(gpu_keys, host_keys, len(host_keys) + anon, now):
            return 0
        run_after = max([0.0, *(self.gpu_blocks[k].valid_s for k in gpu_keys)])
        spans = [] if state.prefetch_span is None else [state.prefetch_span]
        if host_keys:
            spans.append(self._reload(host_keys, now))
        for start, end in spans:
            run_after = max(run_after, self._run_after(start, end, n_new, matched))
        state.prefetch_span = None
        self._hold(state, gpu_keys, host_keys)
        state.anon += anon
        self.num_anon += anon
        state.num_computed = matched * self.block_size
        state.run_after_s = max(state.run_after_s, run_after)
        if not state.admitted:
            state.admitted = True
            self.stats.prompt_tokens += state.request.prompt_len
            from_host = state.prefetched_host_blocks + len(host_keys)
            self.stats.gpu_hit_tokens += (matched - from_host) * self.block_size
            self.stats.host_hit_tokens += from_host * self.block_size
            self._add_score(state, 1)
        return n_new

    def _run_after(self, start: float, end: float, n_new: int, matched: int) -> float:
        """When a request whose reload spans ``[start, end]`` can run its first chunk."""
        assert self.tier is not None
        if not self.tier.pipelined:
            return end
        first = matched * self.block_size
        attention = self.shape.attention_flops(self.model, first, first + n_new, 0)
        compute = self.gpu.step_time_s(self.model.weight_bytes, 0, n_new, attention)
        load = end - start
        overlap = (self.num_layers - 1) / self.num_layers * compute
        return start + max(load / self.num_layers, load - overlap)

    def _add_score(self, state: TierRequest, delta: int) -> None:
        if self.tier is None or self.tier.policy != "score":
            return
        state.score_added += delta
        assert self.host is not None
        for key in state.prompt_keys:
            value = self.score.get(key, 0) + delta
            if value:
                self.score[key] = value
            else:
                self.score.pop(key, None)
            self.host.rescore(key)

    def _release(self, state: TierRequest) -> None:
        self._unclaim(state.held)
        state.held = []
        self.num_anon -= state.anon
        state.anon = 0

    def _maybe_prefetch(
        self, window: list[TierRequest], running: list[TierRequest], now: float
    ) -> None:
        """CaR's rule: reload a windowed request's host prefix when a running request will
        finish within the transfer time (``TPOT x remaining <= T_transfer``); one windowed
        request per such finishing request, in window order."""
        tier = self.tier
        if tier is None or not tier.prefetch or not self.config.prefix_cache:
            return
        left_s = [self._last_step_s * (s.request.output_len - s.num_generated) for s in running]
        slots = -sum(1 for s in window if s.prefetch_span is not None)
        for state in window:
            gpu_keys, host_keys = self._match(state, len(state.held))
            if not host_keys:
                continue
            transfer_s = tier.link.transfer_s(self.block_bytes * len(host_keys))
            due = sum(1 for t in left_s if t <= transfer_s) if running else 1
            if slots + due <= 0:
                continue
            if not self._take_keeping(gpu_keys, host_keys, len(host_keys), now):
                return
            start, end = self._reload(host_keys, now)
            self._hold(state, gpu_keys, host_keys)
            span = state.prefetch_span
            state.prefetch_span = (start, end) if span is None else (span[0], end)
            state.prefetched_host_blocks += len(host_keys)
            self.stats.prefetches += 1
            slots -= 1

    def _maybe_prioritize(self, waiting: deque[TierRequest], window: list[TierRequest]) -> None:
        """CaR's classes: reorder the window (the queue's first requests) in place."""
        if self.tier is None or not self.tier.window_priority:
            return
        window.sort(key=self._priority_class)  # stable: arrival order within a class
        for i, state in enumerate(window):
            waiting[i] = state

    def _priority_class(self, state: TierRequest) -> int:
        """0: every cached block of its prompt is on the GPU (prefetched or not); 1: no
        cached history; 2: some of it must come from the host."""
        on_gpu, on_host = self._match(state, len(state.held))
        if on_host:
            return 2
        return 0 if state.held or on_gpu else 1

    def _update_window(self, waiting: deque[TierRequest], now: float) -> list[TierRequest]:
        if self.tier is None:
            return []
        window: list[TierRequest] = []
        for state in waiting:
            if state.ready_s > now or len(window) == self.tier.window:
                break
            window.append(state)
            if not state.in_window:
                state.in_window = True
                self._add_score(state, 1)
        return window

    # --- transfers ----------------------------------------------------------------------------

    def _finish_transfers(self, now: float) -> None:
        """Unpin finished reloads; free GPU copies of finished background offloads."""
        assert self.host is not None
        done = [r for r in self.reloads if r[0] <= now]
        self.reloads = [r for r in self.reloads if r[0] > now]
        for _, keys in done:
            for key in keys:
                entry = self.host.get(key)
                if entry is not None:
                    entry.pins -= 1
        landed = [o for o in self.offloads if o[0] <= now]
        self.offloads = [o for o in self.offloads if o[0] > now]
        for _, key in landed:
            block = self.gpu_blocks.get(key)
            if block is not None and block.ref == 0 and key in self.host:
                del self.evictable[key]
                del self.gpu_blocks[key]
            if block is not None:
                block.offload_end = None

    def _maybe_offload(self, now: float) -> None:
        """Above the high-water mark, offload cached blocks in the background (CaR)."""
        tier = self.tier
        if tier is None or tier.write_through or self.host is None:
            return
        in_flight = len(self.offloads)
        excess = (
            self.num_blocks - self.num_free - in_flight - int(tier.high_water * self.num_blocks)
        )
        for key in list(self.evictable):
            if excess <= 0:
                break
            block = self.gpu_blocks[key]
            if block.offload_end is not None:
                continue
            if key in self.host and self.host.entries[key].ready_s <= now:
                del self.evictable[key]
                del self.gpu_blocks[key]
            else:
                end = self.host.entries[key].ready_s if key in self.host else None
                end = end if end is not None else self._copy_to_host(key, now)
                if end is None:
                    break  # the host tier is pinned full
                block.offload_end = end
                self.offloads.append((end, key))
            excess -= 1

    def _write_through(self, key: BlockKey, now: float) -> None:
        tier, host = self.tier, self.host
        if tier is not None and tier.write_through and host is not None and key not in host:
            self._copy_to_host(key, now)

    # --- scheduling and execution -----------------------------------------------------------

    def _preempt(self, victim: TierRequest, waiting: deque[TierRequest]) -> None:
        """Preemption by recompute: the blocks go back to the cache, the request waits."""
        self._release(victim)
        victim.num_computed, victim.run_after_s = 0, 0.0
        waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _schedule_running(
        self, running: list[TierRequest], waiting: deque[TierRequest], budget: int, now: float
    ) -> tuple[list[tuple[TierRequest, int]], int]:
        scheduled: list[tuple[TierRequest, int]] = []
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            if s.run_after_s > now:  # its reload is still on the link
                i += 1
                continue
            n = min(s.seq_len - s.num_computed, budget)
            need = -(-(s.num_computed + n) // self.block_size) - len(s.held) - s.anon
            while need > 0 and not self._take(need, now):
                victim = running.pop()
                self._preempt(victim, waiting)
                if victim is s:
                    break
            else:
                if need > 0:
                    s.anon += need
                    self.num_anon += need
                scheduled.append((s, n))
                budget -= n
                i += 1
        return scheduled, budget

    def _schedule(
        self, running: list[TierRequest], waiting: deque[TierRequest], now: float
    ) -> list[tuple[TierRequest, int]]:
        scheduled, budget = self._schedule_running(
            running, waiting, self.config.max_num_batched_tokens, now
        )
        while (
            waiting
            and budget > 0
            and len(running) < self.config.max_num_seqs
            and waiting[0].ready_s <= now
        ):
            s = waiting[0]
            n = self._admit(s, budget, now)
            if n == 0:
                break
            waiting.popleft()
            running.append(s)
            if s.run_after_s <= now:
                scheduled.append((s, n))
                budget -= n
        return scheduled

    def _key_blocks(self, state: TierRequest, now: float) -> None:
        """Blocks the step completed become cacheable (an equal cached block is shared)."""
        if not self.config.prefix_cache:
            return
        full = min(state.num_computed // self.block_size, len(state.keys))
        for idx in range(len(state.held), full):
            key = state.keys[idx]
            state.anon -= 1
            self.num_anon -= 1
            if key in self.gpu_blocks:
                self._claim(key)
            else:
                self.gpu_blocks[key] = GpuBlock(ref=1, valid_s=now)
                self._write_through(key, now)
            state.held.append(key)

    def _execute(
        self, scheduled: list[tuple[TierRequest, int]], running: list[TierRequest], now: float
    ) -> list[TierRequest]:
        finished = []
        for s, n in scheduled:
            s.num_computed += n
            self._key_blocks(s, now)
            if s.num_computed < s.seq_len:
                continue
            s.num_generated += 1
            if s.first_token_s is None:
                s.first_token_s = now
                self.stats.ttft_s.append(now - s.ready_s)
                self.stats.ttft_by_request[s.request.req_id] = now - s.ready_s
            if s.num_generated == s.request.output_len:
                s.finish_s = now
                finished.append(s)
        for s in finished:
            running.remove(s)
            self._add_score(s, -s.score_added)
            self._release(s)
        return finished

    def _step_time(self, scheduled: list[tuple[TierRequest, int]]) -> float:
        kv_read, attention, tokens = 0, 0.0, 0
        for s, n in scheduled:
            kv_read += (s.num_computed + n) * self.model.bytes_per_token
            attention += self.shape.attention_flops(
                self.model, s.num_computed, s.num_computed + n, 0
            )
            tokens += n
        return self.gpu.step_time_s(self.model.weight_bytes, kv_read, tokens, attention)

    def _next_event(
        self, running: list[TierRequest], waiting: deque[TierRequest], now: float
    ) -> float:
        """Nothing could run: the time of the next event that may change that."""
        times = [s.run_after_s for s in running if s.run_after_s > now]
        if waiting and waiting[0].ready_s > now:
            times.append(waiting[0].ready_s)
        times += [end for end, _ in self.reloads if end > now]
        times += [end for end, _ in self.offloads if end > now]
        if times:
            return min(times)
        prefetched = [s for s in waiting if s.held]
        if prefetched:  # prefetches hold the memory the queue head needs: give it back
            for s in prefetched:
                self._release(s)
                s.prefetch_span, s.prefetched_host_blocks = None, 0
            return now
        head = waiting[0]
        raise SimError(
            f"request {head.request.req_id} ({head.seq_len} tokens, "
            f"{-(-head.seq_len // self.block_size)} blocks) does not fit in "
            f"{self.num_blocks} blocks of KV memory"
        )

    def run(self, trace: Trace) -> TierStats:
        """Serve every request of ``trace``; returns the run's `TierStats`."""
        for r in trace.requests:
            if r.prompt_len + r.output_len - 1 > self.model.max_model_len:
                raise SimError(
                    f"request {r.req_id}: {r.prompt_len} prompt + {r.output_len} output tokens "
                    f"exceed {self.model.name}'s max_model_len {self.model.max_model_len} (+1)"
                )
        states = [self._state(r) for r in sorted(trace.requests, key=lambda r: r.arrival_s)]
        waiting = self._block_followups(states)
        running: list[TierRequest] = []
        now = 0.0
        while waiting or running:
            self._stall_s = 0.0
            if self.host is not None:
                self._finish_transfers(now)
            window = self._update_window(waiting, now)
            self._maybe_prioritize(waiting, window)
            self._maybe_prefetch(window, running, now)
            scheduled = self._schedule(running, waiting, now)
            if not scheduled:
                now = self._next_event(running, waiting, now)
                continue
            step_s = self._step_time(scheduled) + self._stall_s
            self.stats.offload_wait_s += self._stall_s
            now += step_s
            self._last_step_s = step_s
            finished = self._execute(scheduled, running, now)
            self._release_followups(finished, waiting)
            self._maybe_offload(now)
            self.stats.steps += 1
            self._maybe_check(states)
            if self.stats.steps >= self.config.max_steps:
                raise SimError(f"no finish after {self.stats.steps} steps")
        self.stats.sim_time_s = now
        return self.stats

    def _state(self, r: Request) -> TierRequest:
        keys = block_keys(r.prompt + r.output, self.block_size) if self.config.prefix_cache else ()
        return TierRequest(r, keys, r.arrival_s, self.block_size)

    def _block_followups(self, states: list[TierRequest]) -> deque[TierRequest]:
        """The initial queue; closed-loop follow-ups wait for their predecessor."""
        ids = {s.request.req_id for s in states}
        self._followups: dict[str, list[TierRequest]] = {}
        for s in states:
            if s.request.after:
                if s.request.after not in ids:
                    raise SimError(
                        f"request {s.request.req_id} follows unknown {s.request.after!r}"
                    )
                self._followups.setdefault(s.request.after, []).append(s)
        return deque(s for s in states if not s.request.after)

    def _release_followups(self, finished: list[TierRequest], waiting: deque[TierRequest]) -> None:
        """Queue the follow-ups of finished requests, ``think_s`` after they finished."""
        for parent in finished:
            for child in self._followups.pop(parent.request.req_id, []):
                assert parent.finish_s is not None
                child.ready_s = parent.finish_s + child.request.think_s
                at = next((i for i, w in enumerate(waiting) if w.ready_s > child.ready_s), None)
                waiting.insert(len(waiting) if at is None else at, child)

    def _maybe_check(self, states: list[TierRequest]) -> None:
        every = self.config.check_invariants_every
        if every and self.stats.steps % every == 0:
            self.check_invariants(states)

    def check_invariants(self, states: list[TierRequest]) -> None:
        """Block counts add up; references match holders; scores match the queue."""
        if self.num_free < 0:
            raise AssertionError(f"{self.num_free} free blocks of {self.num_blocks}")
        refs: dict[BlockKey, int] = {}
        for s in states:
            for key in s.held:
                refs[key] = refs.get(key, 0) + 1
        if self.num_anon != sum(s.anon for s in states):
            raise AssertionError(f"{self.num_anon} unkeyed blocks, holders have another count")
        for key, block in self.gpu_blocks.items():
            if block.ref != refs.get(key, 0) or (block.ref == 0) != (key in self.evictable):
                raise AssertionError(f"GPU block {key!r}: ref {block.ref}, holders {refs.get(key)}")
        if self.evictable.keys() - self.gpu_blocks.keys():
            raise AssertionError("an evictable block is not on the GPU")
        if any(v < 0 for v in self.score.values()):
            raise AssertionError(f"negative score: {min(self.score.values())}")
        if self.host is not None:
            self.host.check_invariants()
