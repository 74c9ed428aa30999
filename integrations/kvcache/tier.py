"""The host tier of a `KVCache`: cached blocks offloaded to host memory and reloaded.

Rationale
    The prefix cache keeps finished requests' blocks on the GPU until the prefix-subset
    rule evicts them; a later request sharing the prefix then recomputes it. A second tier
    (CaR: HBM plus an external tier; here host memory) keeps what leaves the GPU, so the
    later request waits for a copy instead of a prefill.

Approach
    Bookkeeping is `jenga.tier.HostTable` (identities, slots, LRU or CaR's score policy);
    this module moves the bytes. A slot holds one block of every range of its group (all
    layers), in range order, in one host buffer (pinned when the pool is on CUDA).

    - Which GPU block holds which identity: recorded when `KVCache.cache` commits blocks
      (`note_cached`). After every allocator call that can evict (`after_evicting`, called
      before its plan is applied and before anything writes the blocks it handed out, so
      evicted data is still intact), the recorded identities are looked up in the prefix
      index in one call; those gone were evicted, and each is offloaded now unless the host
      already holds it: a queued background copy is taken over (cancelled and done now), a
      running one waited for. Leaving the GPU is an offload, not a drop, while the host
      tier has a slot or a victim.
    - Background offload (`background`): while the GPU pool's used units exceed the
      high-water mark, cached blocks in the order step 5 would evict them are copied out
      on the copy thread (CUDA: a copy stream), ahead of their eviction.
    - Reload (`start_reload` / `finish_reload`): the longest prefix of a prompt whose
      blocks beyond the GPU hit are all on the host is loaded into the GPU through a
      staging request the tier owns: it takes GPU blocks as any request does (the
      prefix-subset rule decides what leaves), one copy job per range in layer order (layer
      i's copy can be waited for alone, `Reload.wait_layer`), and, once every copy
      finished, commits them to the prefix cache, where the real request hits them. A
      failed copy frees the staging request (its blocks uncommitted): the request then
      recomputes from its GPU hit, never reads a half-loaded block.
    - Overlapped reload (`open_reload` / `wait_layer` / `settle`): the staging blocks are
      committed before their copies land, so the request is admitted on them and its step
      runs while they copy; every forward calls `wait_layer(i)` before it reads layer i
      (host: the copy thread's job of that range is waited for; CUDA: the compute stream
      waits for that job's event on the copy stream), so layer i's copy overlaps the
      compute of the layers before it. `settle` (after the step) waits for the rest and
      frees the staging request. A copy that failed raises `ReloadFailed` there, and
      `fail_open` takes the reload's blocks out of the prefix cache (held ones lose their
      identity): a request holding one must be recomputed.

Limitations
    Text groups (full attention, sliding window, chunked local) that share one block size;
    a model with image or recurrent-state groups is refused. Copies run one at a time on
    one thread (host) or one stream (CUDA).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jenga.errors import InvalidSize
from jenga.specs import Kind
from jenga.tier import EntryState, HostTable, Key, Tier, TierPolicy, TierRules

_TEXT_KINDS = (Kind.FULL, Kind.SLIDING_WINDOW, Kind.CHUNKED_LOCAL)
_COUNTERS = ("tier.offload.evicted", "tier.offload.background", "tier.offload.bytes",
             "tier.offload.dropped", "tier.offload.taken_over", "tier.reload.requests",
             "tier.reload.blocks", "tier.reload.tokens", "tier.reload.bytes",
             "tier.reload.failed", "tier.reload.waits", "tier.reload.opened",
             "tier.reload.layer_waits", "tier.reload.stall_us")  # fmt: skip


def host_memory_bytes() -> int:
    """Physical memory of this host (``sysconf``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class HostTierConfig:
    """The host tier: its size in bytes, replacement policy (``"lru"`` or ``"score"``),
    high-water mark of GPU use above which offload runs in the background, and whether its
    buffer is page-locked (None: when the KV cache is on CUDA)."""

    size_bytes: int
    policy: str | TierPolicy = TierPolicy.LRU
    high_water: float = 0.9
    pinned: bool | None = None
    offload_per_call: int = 64  # blocks `background` issues at most per call

    def __post_init__(self) -> None:
        size = self.size_bytes
        if type(size) is not int or size <= 0:
            raise InvalidSize(f"host tier size_bytes must be an int > 0, got {size!r}")
        if size > (memory := host_memory_bytes()):
            raise InvalidSize(f"host tier of {size} B is larger than host memory ({memory} B)")
        if type(self.offload_per_call) is not int or self.offload_per_call <= 0:
            raise InvalidSize(f"offload_per_call must be an int > 0, got {self.offload_per_call!r}")
        self.rules  # noqa: B018 (validates policy and high_water now)

    @property
    def rules(self) -> TierRules:
        return TierRules(policy=self.policy, high_water=self.high_water)  # type: ignore[arg-type]


class _Copy:
    """One copy job: a future on the host copy thread, or an event on the CUDA copy stream."""

    def __init__(self, future: Future[Any] | None = None, event: Any = None) -> None:
        self.future, self.event = future, event

    def done(self) -> bool:
        return self.future.done() if self.future is not None else bool(self.event.query())

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
        else:
            self.event.synchronize()

    def cancel(self) -> bool:
        return self.future is not None and self.future.cancel()

    def wait_compute(self, device: Any) -> None:
        """Make the compute side wait: this thread (host), or the device's current stream,
        which waits for the copy's event on the GPU without blocking this thread (CUDA)."""
        if self.future is not None:
            self.future.result()
        else:
            torch.cuda.current_stream(device).wait_event(self.event)


class ReloadFailed(RuntimeError):
    """A copy of a reload whose blocks were opened to the prefix cache failed (raised where a
    forward waits for the layer): `HostTier.fail_open` drops its blocks."""

    def __init__(self, reload: Reload, cause: BaseException) -> None:
        super().__init__(
            f"reload of {reload.tokens - reload.gpu_hit} tokens from the host failed: {cause!r}"
        )
        self.reload = reload


@dataclass
class Reload:
    """A reload in progress: ``staging`` holds the GPU blocks of ``tokens`` tokens."""

    staging: Hashable
    tokens: int
    gpu_hit: int
    keys: list[Key]
    copies: list[tuple[int, _Copy]]  # (first layer of the range, copy), in layer order
    nbytes: int
    layers: list[frozenset[int]] = field(default_factory=list)  # per copy: layers it holds
    started: float = field(default_factory=time.perf_counter)
    landed_at: float = 0.0  # host: when its last copy job ended (perf_counter)
    opened_at: float = 0.0  # when `open_reload` committed its blocks (perf_counter)
    stall_s: float = 0.0  # seconds a forward waited for this reload's layers (opened)
    dropped: list[list[int]] = field(default_factory=list)  # failed open: blocks per group

    def in_flight_after_open_s(self) -> float:
        """Host: how long its copies still ran after it was opened (the request's step
        ran meanwhile; without overlap it would have waited all of it)."""
        return max(0.0, self.landed_at - self.opened_at)

    def done(self) -> bool:
        return all(c.done() for _, c in self.copies)

    def _of_layer(self, layer: int) -> list[_Copy]:
        return [c for held, (_, c) in zip(self.layers, self.copies, strict=True) if layer in held]

    def wait_layer(self, layer: int) -> None:
        """Wait for the copies that hold ``layer`` only (layer i's copy overlaps the
        compute of the layers before it)."""
        for copy in self._of_layer(layer):
            copy.wait()


class HostTier:
    """The second tier of one `KVCache` (``kv``), built by the cache from its config."""

    def __init__(self, kv: Any, config: HostTierConfig) -> None:
        self.kv, self.config = kv, config
        self.table = HostTable(1, config.rules)  # replaced below once the slots are known
        groups = kv.model.groups
        odd = [g.name for g in groups if g.spec.kind not in _TEXT_KINDS or g.spec.model != "target"]
        if odd:
            raise InvalidSize(f"the host tier keeps text groups only; {odd} are not")
        sizes = {g.spec.block_size for g in groups}
        if len(sizes) != 1:
            raise InvalidSize(
                f"the host tier needs one block size, the groups have {sorted(sizes)}"
            )
        self.tokens_per_block = sizes.pop()
        self._units = [  # per group: (layer, range) in range order
            [(geo.layer_ids[i * geo.layers_per_block // geo.tensors_per_layer], rng)
             for i, rng in enumerate(kv.ranges[geo.index])]
            for geo in kv.geometries
        ]  # fmt: skip
        self._unit_layers = [  # per group, per range: the layers whose K/V it holds
            [frozenset(layer for layer in geo.layer_ids for t in range(geo.tensors_per_layer)
                       if geo.range_index(layer, t) == i) for i in range(len(units))]
            for geo, units in zip(kv.geometries, self._units, strict=True)
        ]  # fmt: skip
        self.slot_bytes = max(
            len(u) * geo.small_page_bytes for u, geo in zip(self._units, kv.geometries, strict=True)
        )
        slots = config.size_bytes // self.slot_bytes
        if slots == 0:
            raise InvalidSize(
                f"a host tier of {config.size_bytes} B holds no block: one block of every "
                f"range of a group takes {self.slot_bytes} B"
            )
        self.table = HostTable(slots, config.rules)
        self.device = kv.layer_view(kv.geometries[0].layer_ids[0]).device
        cuda = self.device.type == "cuda"
        pinned = cuda if config.pinned is None else config.pinned
        self.buffer = torch.empty(slots * self.slot_bytes, dtype=torch.uint8, pin_memory=pinned)
        self._bytes = [  # per group, per range: the whole range as bytes (zero-copy)
            [rng.tensor((geo.range_bytes,), torch.uint8, 0) for rng in kv.ranges[geo.index]]
            for geo in kv.geometries
        ]
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._thread = None if cuda else ThreadPoolExecutor(1, thread_name_prefix="kv-tier")
        self._gpu: list[dict[int, bytes]] = [{} for _ in groups]  # block -> identity
        self._recorded: dict[Hashable, list[int]] = {}  # committed blocks seen per group
        self._inflight: dict[Key, _Copy] = {}
        self._open: list[Reload] = []  # reloads committed before their copies landed
        self._seen_evictions = kv.allocator.evicted_blocks()
        self._next_staging = 0
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.copy_seconds = 0.0  # time inside reload copy jobs (bandwidth)

    # ---- copies ------------------------------------------------------------------------
    def _submit(self, job: Callable[[], None]) -> _Copy:
        if self._thread is not None:
            return _Copy(future=self._thread.submit(job))
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            job()
            event = torch.cuda.Event()
            event.record(self._stream)
        return _Copy(event=event)

    def _run_now(self, job: Callable[[], None]) -> None:
        """Run a copy to completion now: on this thread (host), or on the copy stream."""
        if self._thread is not None:
            job()
        else:
            self._submit(job).wait()

    def _host(self, slot: int, i: int, size: int) -> torch.Tensor:
        start = slot * self.slot_bytes + i * size
        return self.buffer[start : start + size]

    def _gpu_bytes(self, g: int, i: int, block: int) -> torch.Tensor:
        geo = self.kv.geometries[g]
        start = geo.block_offset(block)
        return self._bytes[g][i][start : start + geo.small_page_bytes]

    def _offload_job(self, g: int, block: int, slot: int) -> Callable[[], None]:
        size = self.kv.geometries[g].small_page_bytes
        blocking = self._stream is None

        def job() -> None:
            for i in range(len(self._units[g])):
                self._host(slot, i, size).copy_(
                    self._gpu_bytes(g, i, block), non_blocking=not blocking
                )

        return job

    def _load_unit(self, g: int, i: int, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy range ``i`` of group ``g`` of every (GPU block, host slot) pair to the GPU."""
        size = self.kv.geometries[g].small_page_bytes
        start = time.perf_counter()
        for block, slot in pairs:
            self._gpu_bytes(g, i, block).copy_(self._host(slot, i, size), non_blocking=True)
        self.copy_seconds += time.perf_counter() - start

    # ---- offload -----------------------------------------------------------------------
    def note_cached(self, request_id: Hashable) -> None:
        """Record the identities of the blocks ``request_id`` committed since the last call."""
        alloc = self.kv.allocator
        done = self._recorded.setdefault(request_id, [0] * len(self._gpu))
        for g, known in enumerate(self._gpu):
            ids = alloc.committed(request_id, g, done[g])
            if not len(ids):
                continue
            table = np.asarray(alloc.block_table(request_id, g)[done[g] : done[g] + len(ids)])
            held = alloc.lookup(g, ids) == table  # a duplicate of an indexed block is not
            for block, ident in zip(table[held].tolist(), ids[held], strict=True):
                known[block] = ident.tobytes()
            done[g] += len(ids)

    def forget(self, request_id: Hashable) -> None:
        self._recorded.pop(request_id, None)

    def after_evicting(self) -> None:
        """Offload every recorded block the last allocator call evicted (its data is still
        intact: call before the call's plan is applied or its blocks are written)."""
        evicted = self.kv.allocator.evicted_blocks()
        if evicted == self._seen_evictions:
            return
        self._seen_evictions = evicted
        for g, known in enumerate(self._gpu):
            if not known:
                continue
            blocks = np.fromiter(known, dtype=np.int32, count=len(known))
            ids = np.frombuffer(b"".join(known.values()), dtype=np.uint64).reshape(-1, 2)
            gone = self.kv.allocator.lookup(g, ids) != blocks
            for block in blocks[gone].tolist():
                self._save(g, block, (g, known.pop(block)))

    def _save(self, g: int, block: int, key: Key) -> None:
        entry = self.table.get(key)
        if entry is not None and entry.state is EntryState.OFFLOADING:
            copy = self._inflight.pop(key)
            if copy.cancel():  # queued, not started: do it now, while the data is intact
                self.counters["tier.offload.taken_over"] += 1
                self._run_now(self._offload_job(g, block, entry.slot))
            else:
                copy.wait()
            self._finish(key, None)
            return
        if entry is not None:
            return  # resident already: it was on both tiers, it is on the host now
        slot = self.table.reserve(key)
        if slot is None:
            self.counters["tier.offload.dropped"] += 1
            return
        self._run_now(self._offload_job(g, block, slot))
        self.table.complete(key)
        self.counters["tier.offload.evicted"] += 1
        self.counters["tier.offload.bytes"] += self.slot_bytes

    def _finish(self, key: Key, copy: _Copy | None) -> None:
        try:
            if copy is not None:
                copy.wait()
        except Exception:
            self.table.drop(key)  # the copy failed: nothing of it is ever read
            self.counters["tier.offload.dropped"] += 1
            return
        self.table.complete(key)
        self.counters["tier.offload.bytes"] += self.slot_bytes

    def poll(self, wait: bool = False) -> None:
        """Complete the background offloads that finished (``wait``: all of them)."""
        for key, copy in list(self._inflight.items()):
            if wait or copy.done():
                del self._inflight[key]
                self._finish(key, copy)

    def background(self) -> int:
        """Above the high-water mark, start offloading cached blocks (step 5's eviction
        order) that the host does not hold; returns how many were started."""
        self.poll()
        use = self.kv.allocator.usage()
        if use.used_units <= self.config.high_water * use.total_units:
            return 0
        started = 0
        for g, known in enumerate(self._gpu):
            for block in self.kv.allocator.eviction_order(g):
                ident = known.get(block)
                if ident is None or (g, ident) in self._inflight or self.table.get((g, ident)):
                    continue
                if started >= self.config.offload_per_call:
                    return started
                slot = self.table.reserve((g, ident))
                if slot is None:
                    return started
                self._inflight[(g, ident)] = self._submit(self._offload_job(g, block, slot))
                self.counters["tier.offload.background"] += 1
                started += 1
        return started

    # ---- reload ------------------------------------------------------------------------
    def keys(self, prompt: Sequence[int]) -> tuple[int, list[list[Key]]]:
        """The GPU prefix hit of ``prompt`` and, per group, its complete blocks' keys (the
        last token is never part of a hit)."""
        match = self.kv.allocator.prefix_match(prompt)
        n = (len(prompt) - 1) // self.tokens_per_block
        ids = match.request.identities(self.tokens_per_block, 0, n) if n else np.empty((0, 2))
        return match.hit, [[(g, i.tobytes()) for i in ids] for g in range(len(self._gpu))]

    def host_extension(self, prompt: Sequence[int]) -> tuple[int, int]:
        """(GPU hit, longest prefix the GPU and the host hold together) in tokens."""
        hit, tokens, _ = self._extension(prompt)
        return hit, tokens

    def _extension(self, prompt: Sequence[int]) -> tuple[int, int, list[list[Key]]]:
        hit, keys = self.keys(prompt)
        t = self.tokens_per_block
        j = hit // t
        while j < len(keys[0]) and all(self._readable(k[j]) for k in keys):
            j += 1
        return hit, max(hit, j * t), keys

    def _readable(self, key: Key) -> bool:
        entry = self.table.get(key)
        if entry is None:
            return False
        if entry.state is EntryState.OFFLOADING:  # a hit on a block mid-offload: wait for it
            self.counters["tier.reload.waits"] += 1
            self._finish(key, self._inflight.pop(key))
            return self.table.get(key) is not None
        return True

    def start_reload(self, prompt: Sequence[int]) -> Reload | None:
        """Start loading the host-held blocks of ``prompt`` beyond its GPU hit into GPU
        blocks of a staging request; None when the host adds nothing or the GPU has no room."""
        hit, tokens, keys = self._extension(prompt)
        if tokens <= hit:
            return None
        t = self.tokens_per_block
        picked = [k for per_group in keys for k in per_group[hit // t : tokens // t]]
        self.table.pin(picked)  # before the staging allocation offloads (and replaces)
        staging = ("kv-tier-reload", self._next_staging)
        self._next_staging += 1
        kv = self.kv
        gpu_hit = kv.add_request(staging, list(prompt[: tokens + 1]))
        if gpu_hit >= tokens or kv.allocate(staging, tokens - gpu_hit) is None:
            kv.free(staging)
            self.table.unpin(picked)
            return None
        jobs = []
        nbytes = 0
        for g, units in enumerate(self._units):
            table = kv.block_table(staging, g)
            pairs = [
                (table[j], self.table.get(keys[g][j]).slot)  # type: ignore[union-attr]
                for j in range(gpu_hit // t, tokens // t)
                if table[j] >= 0
            ]
            for i, (layer, _) in enumerate(units):
                jobs.append((layer, g, i, pairs))
                nbytes += len(pairs) * kv.geometries[g].small_page_bytes
        job = Reload(staging, tokens, gpu_hit, picked, [], nbytes)
        for layer, g, i, pairs in sorted(jobs, key=lambda job: job[0]):
            copy = self._submit(functools.partial(self._timed_load, job, g, i, pairs))
            job.copies.append((layer, copy))
            job.layers.append(self._unit_layers[g][i])
        self.counters["tier.reload.requests"] += 1
        return job

    def _timed_load(self, job: Reload, g: int, i: int, pairs: Sequence) -> None:
        self._load_unit(g, i, pairs)
        job.landed_at = time.perf_counter()

    def finish_reload(self, reload: Reload) -> bool:
        """Wait for ``reload``'s copies; commit its blocks to the prefix cache (True), or,
        when a copy failed, free its staging request with nothing committed (False). The
        staging request stays live until `release` (so the blocks stay for the request)."""
        try:
            for _, copy in reload.copies:
                copy.wait()
        except Exception:
            for _, copy in reload.copies:  # the rest must finish before the blocks go
                with contextlib.suppress(Exception):
                    copy.wait()
            self.table.unpin(reload.keys)
            self.kv.free(reload.staging)
            self.counters["tier.reload.failed"] += 1
            return False
        self.kv.cache(reload.staging, reload.tokens)
        self._landed(reload)
        return True

    def _landed(self, reload: Reload) -> None:
        for key in reload.keys:
            self.table.touch(key)
        self.table.unpin(reload.keys)
        self.counters["tier.reload.blocks"] += len(reload.keys)
        self.counters["tier.reload.tokens"] += reload.tokens - reload.gpu_hit
        self.counters["tier.reload.bytes"] += reload.nbytes

    # ---- reload overlapped with the request's own step ------------------------------------
    def open_reload(self, reload: Reload) -> None:
        """Commit ``reload``'s blocks to the prefix cache now, before its copies land, so its
        request is admitted on them and its step starts at once: every forward calls
        `wait_layer` before it reads a layer, so layer i's copy overlaps the compute of
        the layers before it. `settle` (after the step) finishes it."""
        reload.opened_at = time.perf_counter()
        self.kv.cache(reload.staging, reload.tokens)
        self._open.append(reload)
        self.counters["tier.reload.opened"] += 1

    def wait_layer(self, layer: int) -> None:
        """Before a forward reads ``layer``: wait for that layer's copies of every open
        reload (CUDA: the compute stream waits for their events); `ReloadFailed` when one
        failed (nothing of it may be read: `fail_open`)."""
        for job in self._open:
            copies = job._of_layer(layer)
            if all(c.done() for c in copies):
                if self._stream is None:
                    self._raise_failed(job, copies)
                continue
            start = time.perf_counter()
            self.counters["tier.reload.layer_waits"] += 1
            try:
                for copy in copies:
                    copy.wait_compute(self.device)
            except Exception as e:
                raise ReloadFailed(job, e) from e
            finally:
                job.stall_s += time.perf_counter() - start
                self.counters["tier.reload.stall_us"] += int(1e6 * (time.perf_counter() - start))

    @staticmethod
    def _raise_failed(job: Reload, copies: list[_Copy]) -> None:
        for copy in copies:
            assert copy.future is not None
            error = copy.future.exception()
            if error is not None:
                raise ReloadFailed(job, error)

    def open_reloads(self) -> list[Reload]:
        return list(self._open)

    def settle(self) -> list[Reload]:
        """After a step: wait for every open reload's copies; those that landed are final
        (their host entries touched and unpinned). Returns the failed ones, dropped with
        `fail_open`."""
        failed = []
        for job in list(self._open):
            try:
                for _, copy in job.copies:
                    copy.wait()
            except Exception:
                failed.append(job)
                self.fail_open(job)
                continue
            self._open.remove(job)
            self._landed(job)
            self.kv.free(job.staging)
        return failed

    def fail_open(self, reload: Reload) -> list[list[int]]:
        """Drop an open reload whose copy failed: wait for its other copies, take its
        reloaded blocks out of the prefix cache (`uncache_blocks`: cached ones turn free,
        held ones lose their identity) and unpin its host entries. Returns the dropped
        blocks per group: a request holding one must recompute."""
        for _, copy in reload.copies:  # the rest must finish before the blocks go
            with contextlib.suppress(Exception):
                copy.wait()
        if reload in self._open:
            self._open.remove(reload)
        t = self.tokens_per_block
        span = slice(reload.gpu_hit // t, reload.tokens // t)
        dropped = [
            [b for b in self.kv.block_table(reload.staging, g)[span] if b >= 0]
            for g in range(len(self._gpu))
        ]
        for g, blocks in enumerate(dropped):
            for block in blocks:
                self._gpu[g].pop(block, None)
            self.kv.uncache_blocks(g, blocks)
        self.table.unpin(reload.keys)
        self.kv.free(reload.staging)
        self.counters["tier.reload.failed"] += 1
        reload.dropped = dropped
        return dropped

    def release(self, reload: Reload) -> None:
        """Free a finished reload's staging request (its blocks stay cached); an open
        reload's is freed by `settle` or `fail_open`."""
        if reload not in self._open:
            self.kv.free(reload.staging)

    # ---- queries -----------------------------------------------------------------------
    def tier_of(self, key: Key) -> Tier | None:
        g, ident = key
        ids = np.frombuffer(ident, dtype=np.uint64).reshape(1, 2)
        return self.table.tier(key, bool(self.kv.allocator.lookup(g, ids)[0] >= 0))

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update(self.table.counters)
        out["tier.host.entries.current"] = len(self.table)
        out["tier.host.slots"] = self.table.num_slots
        out["tier.offload.inflight.current"] = len(self._inflight)
        return out

    def check_invariants(self) -> None:
        self.table.check_invariants()
        for key in self._inflight:
            entry = self.table.get(key)
            assert entry is not None and entry.state is EntryState.OFFLOADING, key

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.settle()
        for key, copy in list(self._inflight.items()):
            with contextlib.suppress(Exception):
                copy.wait()
            del self._inflight[key]
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self._stream is not None:
            self._stream.synchronize()
