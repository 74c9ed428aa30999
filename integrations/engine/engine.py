"""A mini serving engine: jenga-driven continuous batching over vmm KV tensors.

Rationale
    The allocator, the mapping plans and the tensors are only proven together by an
    engine that admits requests while others run, splits long prompts into chunks,
    runs out of memory and preempts, and reuses cached prefixes — and still produces
    exactly the tokens a plain per-request generation does.

Approach
    Each `step`:

    1. requests whose arrival step has come join the waiting queue;
    2. running requests (oldest first) get their next chunk: one token when decoding,
       up to the remaining token budget when prefilling. If the KV cache has no room,
       the newest running request is preempted (its KV freed, its prompt + output so
       far requeued at the front of the waiting queue, recomputed later, often from the
       prefix cache) until the allocation fits;
    3. waiting requests are admitted (prefix-cache hit from `add_request`, with the
       request's image spans, so a block's hash covers its images) while the token
       budget, the running limit and memory allow;
    4. the model's own forward (`ModelForward`, one call per request) computes every
       scheduled chunk (`PackedForward` with ``attention='flash'``); a request
       whose chunk reaches the end of its sequence samples its next token (greedy, or
       seeded sampling); a request of ``n`` samples forks into them there (they share
       the prompt's blocks); complete blocks are offered to the prefix cache; finished
       requests are freed.

    With a host tier (``EngineConfig.tier_bytes``), `integrations.engine.tier` runs CaR's
    scheduler window, prefetch rule and score events around steps 3 and 4: a request
    whose prefix the host holds is admitted while its reload copies, and the forward waits
    for each layer's copy just before that layer (``tier_overlap``; off: admission waits
    for the whole reload). ``engine.ttft``
    holds each request's seconds from arrival to its first token.

    ::

        waiting ──admit (hit, allocate)──► running ──finish──► done (blocks cached)
           ▲                                  │
           └────────── preempt (free) ────────┘

Limitations
    Greedy or plain seeded sampling (no temperature, top-k or top-p); greedy beam
    search (``beams``, see `beams`) without EOS; ``n`` samples are forked without regard
    to ``max_running``, and not with ``overlap`` or images; recompute (not
    swap) preemption; one model (any family `ModelForward` serves; images for
    LLaVA-OneVision and Mllama, see `images`).
    With ``overlap``, decode tokens of step t+1 are allocated before step t's forward
    (lengths are known; EOS is not used), so memory is committed one token early.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

import vmm
from integrations.engine.beams import BeamGroup
from integrations.engine.forward import PackedForward, Segment, flash_kernel
from integrations.engine.images import IMAGE_ADAPTERS, RequestImages
from integrations.engine.model_forward import ModelForward
from integrations.engine.tier import EngineTier
from integrations.kvcache import KVCache, KVCacheConfig
from integrations.kvcache.tier import HostTierConfig, ReloadFailed


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling limits and the KV pool."""

    token_budget: int = 64  # tokens per forward (prefill chunks + decodes)
    max_running: int = 8
    budget_bytes: int = 1 << 20
    # the most bytes `kv.set_capacity` may grow the KV cache to (None: budget_bytes)
    max_bytes: int | None = None
    chunk_bytes: int = 4096
    block_size: int = 4
    use_prefix_cache: bool = True
    overlap: bool = False  # allocate step t+1's decode tokens ahead; map them during step t
    backend: str = "host"  # "host" | "cuda" | "auto" (model must be on the backend's device)
    # "sdpa": the model's own forward per request (every family the HF cache stores);
    # "flash": the packed Llama-style forward with flash_attn_with_kvcache when flash-attn is
    # installed (CUDA, block_size % 256 == 0), else torch's FlashAttention kernel through SDPA
    # (math backend on CPU); `PackedForward.flash_kernel` says which
    attention: str = "sdpa"
    checkpoint_interval: int = 16  # tokens per recurrent-state block (prefix hits on Mamba)
    # Join the shared pool of this name (`vmm-pool start NAME`) instead of owning a pool;
    # budget_bytes is then ignored: the tenant's max (tenant_max_bytes, None: the budget).
    shared_pool: str = ""
    tenant_name: str = ""  # default: "engine-<pid>"
    tenant_min_bytes: int = 0
    tenant_max_bytes: int | None = None
    # A host tier for blocks leaving the GPU (`integrations.kvcache.tier`; None: off): its
    # bytes, replacement policy ("lru" | "score"), high-water mark of GPU use for background
    # offload; the scheduler window (CaR's) and whether reloads are prefetched by CaR's rule
    tier_bytes: int | None = None
    tier_policy: str = "lru"
    tier_high_water: float = 0.9
    tier_window: int = 4
    tier_prefetch: bool = True
    # admit a request while its reload copies; its forward waits per layer (else: the
    # whole reload is waited for before the request is admitted)
    tier_overlap: bool = True

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_running", "budget_bytes", "chunk_bytes",
                     "block_size", "checkpoint_interval", "tier_window"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be an int > 0, got {value!r}")
        if self.max_bytes is not None and (
            type(self.max_bytes) is not int or self.max_bytes < self.budget_bytes
        ):
            raise ValueError(
                f"EngineConfig.max_bytes must be None or an int >= budget_bytes "
                f"{self.budget_bytes}, got {self.max_bytes!r}"
            )
        self.host_tier()  # refuses a bad size, policy or high-water mark now
        if self.attention not in ("sdpa", "flash"):
            raise ValueError(
                f"EngineConfig.attention must be 'sdpa' or 'flash', got {self.attention!r}"
            )
        if self.backend not in ("host", "cuda", "auto"):
            raise ValueError(
                f"EngineConfig.backend must be 'host', 'cuda' or 'auto', got {self.backend!r}"
            )

    def host_tier(self) -> HostTierConfig | None:
        if self.tier_bytes is None:
            return None
        return HostTierConfig(self.tier_bytes, self.tier_policy, self.tier_high_water)


_PACKED_TYPES = frozenset({"llama", "mistral"})


def _engine_spec(model: Any, cfg: EngineConfig, itemsize: int) -> Any:
    """The decoder's groups of the model's jenga spec (an encoder's cache, LLaVA-OneVision's
    vision embeddings, is recomputed per request, see `images`); refuses image groups of a
    model whose images the engine cannot feed."""
    import dataclasses

    from jenga.hf import HfOptions, model_spec_from_config
    from jenga.specs import Kind

    from integrations.hf.cache import config_dict

    options = HfOptions(
        block_size=cfg.block_size, dtype_bytes=itemsize, conv_full_kernel=True,
        mamba_checkpoint_interval=cfg.checkpoint_interval,
    )  # fmt: skip
    text = model.config.get_text_config(decoder=True)
    spec = model_spec_from_config(config_dict(model.config, text), options=options)
    image_groups = [
        g.name
        for g in spec.groups
        if g.spec.model != "target" or g.spec.kind in (Kind.CROSS_ATTENTION, Kind.VISION_EMBEDDING)
    ]
    if image_groups and model.config.model_type not in IMAGE_ADAPTERS:
        raise ValueError(
            f"{model.config.model_type!r} has image caches {image_groups}; the mini engine "
            f"feeds the images of {sorted(IMAGE_ADAPTERS)} only"
        )
    groups = tuple(g for g in spec.groups if g.spec.model == "target")
    return dataclasses.replace(spec, groups=groups)


@dataclass
class EngineRequest:
    request_id: Hashable
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose K/V is in the cache
    num_preemptions: int = 0
    images: RequestImages | None = None  # prepared image inputs, dropped when finished
    num_hit_tokens: int = 0  # prefix-cache hit of the latest admission
    # sampling: None is greedy; `n` > 1: samples forked once the prompt is computed
    generator: torch.Generator | None = None
    n: int = 1
    seed: int = 0
    beam: BeamGroup | None = None  # the beam group this request is a beam of
    order: int = 0  # `add_request` order

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class MiniEngine:
    """Continuous batching over a `KVCache` built from the model's config."""

    def __init__(self, model: Any, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.model = model
        dtype = next(model.parameters()).dtype
        spec = _engine_spec(model, cfg, torch.empty((), dtype=dtype).element_size())
        use_flash = cfg.attention == "flash"
        if use_flash and flash_kernel() == "flash_attn" and cfg.block_size % 256:
            raise ValueError(
                f"flash-attn paged KV needs block_size % 256 == 0, got {cfg.block_size}"
            )
        if use_flash and model.config.model_type not in _PACKED_TYPES:
            raise ValueError(
                f"attention='flash' runs the packed Llama-style forward: model_type "
                f"{model.config.model_type!r} is not one of {sorted(_PACKED_TYPES)}"
            )
        self.pool = _make_pool(cfg)
        self.kv = KVCache(
            spec,
            self.pool,
            KVCacheConfig(
                dtype=dtype, kv_split=use_flash, max_bytes=cfg.max_bytes, tier=cfg.host_tier()
            ),
        )
        try:
            self.gate = _shared_gate(self.kv, self.pool)
            self.forward: Any = (
                PackedForward(model, self.kv, use_flash=True)
                if use_flash
                else ModelForward(model, self.kv)
            )
        except BaseException:
            self.kv.close()
            self.pool.close()
            raise
        self._interval = getattr(self.forward, "checkpoint_interval", None)
        self.tier: EngineTier | None = None
        if self.kv.tier is not None and cfg.use_prefix_cache:
            self.tier = EngineTier(
                self, self.kv.tier, cfg.tier_window, cfg.tier_prefetch, cfg.tier_overlap
            )
        self.ttft: dict[Hashable, float] = {}  # seconds from arrival to the first token
        self._arrived: dict[Hashable, float] = {}
        self.pending: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.done: dict[Hashable, EngineRequest] = {}
        self.step_index = 0
        self._ahead: dict[Hashable, int] = {}  # tokens allocated ahead (overlap)
        self._added = 0
        self.stats = {"steps": 0, "preemptions": 0, "prefix.hit_tokens": 0, "tokens.computed": 0,
                      "running.max": 0}  # fmt: skip

    def add_request(
        self,
        request_id: Hashable,
        prompt: Sequence[int],
        max_new_tokens: int,
        arrival_step: int = 0,
        images: Mapping[str, Any] | None = None,
        *,
        n: int = 1,
        seed: int | None = None,
        beams: int = 1,
    ) -> None:
        """Queue a request. `images`: the processor's image inputs for this one prompt
        (``pixel_values`` and what the model takes with them, batch 1); their features are
        computed now, once, and their content keys the request's prefix blocks.
        ``seed``: sample (softmax of the logits, ``torch.multinomial`` with a generator
        seeded ``seed``) instead of greedy. ``n`` > 1 (needs a seed): parallel sampling,
        samples ``(request_id, i)``, sample i seeded ``seed + i``, forked from sample 0
        once the prompt is computed (they share its blocks, `KVCache.fork`).
        ``beams`` > 1: greedy beam search of that width (`integrations.engine.beams`);
        results ``(request_id, i)``, the i-th best sequence, as transformers'
        ``generate(num_beams=beams, num_return_sequences=beams)`` orders them."""
        prompt = self._checked_request(request_id, prompt, max_new_tokens, arrival_step)
        self._check_samples(request_id, n, seed, images)
        self._check_beams(request_id, beams, n, seed, images)
        rid = (request_id, 0) if n > 1 else request_id
        self._added += 1
        group = BeamGroup(request_id, beams, max_new_tokens, self._added) if beams > 1 else None
        if group is not None:
            rid = group.beams[0]
        req = EngineRequest(rid, prompt, max_new_tokens, arrival_step, n=n, beam=group)
        req.order = self._added
        if seed is not None:
            req.seed, req.generator = seed, torch.Generator().manual_seed(seed)
        if images:
            adapter = IMAGE_ADAPTERS.get(self.model.config.model_type)
            if adapter is None or not isinstance(self.forward, ModelForward):
                raise ValueError(
                    f"request {request_id!r} has images; the engine feeds images to "
                    f"{sorted(IMAGE_ADAPTERS)} with attention='sdpa', not "
                    f"{self.model.config.model_type!r} with attention={self.config.attention!r}"
                )
            req.images = adapter(self.model, request_id, req.prompt, images)
        self.pending.append(req)

    def _checked_request(
        self, request_id: Hashable, prompt: Sequence[int], max_new_tokens: int, arrival: int
    ) -> list[int]:
        """The prompt as a list of ints, or ValueError / TypeError naming what `run` would
        refuse later (a refused request leaves the engine serving the others)."""
        try:
            hash(request_id)
        except TypeError:
            raise TypeError(f"request id {request_id!r} is not hashable") from None
        known = (*self.pending, *self.waiting, *self.running)
        if request_id in self.done or any(r.request_id == request_id for r in known):
            raise ValueError(f"request {request_id!r} was already added")
        for name, value, low in (
            ("max_new_tokens", max_new_tokens, 1),
            ("arrival_step", arrival, 0),
        ):
            if type(value) is not int or value < low:
                raise ValueError(
                    f"request {request_id!r}: {name} must be an int >= {low}, got {value!r}"
                )
        ids = list(prompt) if not isinstance(prompt, (str, bytes)) else []
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt must hold >= 1 token id")
        vocab = int(self.model.config.get_text_config().vocab_size)
        for at, t in enumerate(ids):
            try:
                ids[at] = operator.index(t) if not isinstance(t, bool) else -1
            except TypeError:
                ids[at] = -1
            if not 0 <= ids[at] < vocab:
                raise ValueError(
                    f"request {request_id!r}: prompt[{at}] is {t!r}, token ids must be ints "
                    f"in [0, {vocab})"
                )
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if limit is not None and len(ids) + max_new_tokens > limit:
            raise ValueError(
                f"request {request_id!r}: {len(ids)} prompt + {max_new_tokens} new tokens "
                f"exceed the model's {limit} positions"
            )
        return ids

    def _check_samples(self, request_id: Hashable, n: int, seed: int | None, images: Any) -> None:
        """`ValueError` unless ``n`` samples of this request can be served."""
        if type(n) is not int or n <= 0:
            raise ValueError(f"request {request_id!r}: n must be an int > 0, got {n!r}")
        if n == 1:
            return
        if seed is None:
            raise ValueError(
                f"request {request_id!r}: n={n} samples need a seed (greedy ones agree)"
            )
        why = (
            "overlap=True allocates a decode token before the fork" if self.config.overlap
            else "requests with images" if images
            else ""
        )  # fmt: skip
        if why:
            raise ValueError(f"request {request_id!r}: n={n} samples are not served with {why}")

    def _check_beams(
        self, request_id: Hashable, beams: int, n: int, seed: int | None, images: Any
    ) -> None:
        """`ValueError` unless a beam search of width ``beams`` can be served."""
        if type(beams) is not int or beams <= 0:
            raise ValueError(f"request {request_id!r}: beams must be an int > 0, got {beams!r}")
        if beams == 1:
            return
        cfg = self.config
        why = (
            f"n={n} samples" if n > 1
            else f"seed={seed} (beam sampling is not served)" if seed is not None
            else f"max_running={cfg.max_running} (every beam must run at once)"
            if beams > cfg.max_running
            else "overlap=True (a decode token is allocated before the beams are chosen)"
            if cfg.overlap
            else "images" if images
            else ""
        )  # fmt: skip
        if why:
            raise ValueError(f"request {request_id!r}: beams={beams} are not served with {why}")

    # ---- scheduling ------------------------------------------------------------------------
    def _arrivals(self) -> None:
        arrived = [r for r in self.pending if r.arrival_step <= self.step_index]
        self.pending = [r for r in self.pending if r.arrival_step > self.step_index]
        self.waiting.extend(arrived)
        now = time.perf_counter()
        for r in arrived:
            self._arrived.setdefault(r.request_id, now)

    def _preempt_newest(self) -> EngineRequest:
        return self._requeue(self.running.pop())

    def _requeue(self, victim: EngineRequest) -> EngineRequest:
        """Free a request taken out of ``running``; it is recomputed from the queue front."""
        if victim.beam is not None:  # its logits are recomputed with its KV
            victim.beam.logits.pop(victim.request_id, None)
        self._ahead.pop(victim.request_id, None)
        self.kv.free(victim.request_id)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.stats["preemptions"] += 1
        return victim

    def _preempt_waiting_beam(self) -> bool:
        """Nothing ran and the head of the queue does not fit: free the newest beam that
        waits for its group (not the head's group) and queue it behind the head, so one
        group completes at a time instead of each holding the memory another needs."""
        head = self.waiting[0]
        head_order = head.beam.order if head.beam is not None else head.order
        for at in range(len(self.running) - 1, -1, -1):
            victim = self.running[at]
            if victim.beam is None or victim.beam.order <= head_order:
                continue  # only a group added after the head makes way for it
            del self.running[at]
            victim.beam.logits.pop(victim.request_id, None)
            self.kv.free(victim.request_id)
            victim.num_computed = 0
            victim.num_preemptions += 1
            self.waiting.insert(1, victim)
            self.stats["preemptions"] += 1
            return True
        return False

    def _segment_tokens(self, start: int, end: int, budget: int) -> int:
        """Tokens of the next segment: the budget's share, cut at the next state
        checkpoint (a recurrent state is only known where a forward ends)."""
        n = min(end - start, budget)
        if self._interval is not None:
            n = min(n, self._interval - start % self._interval)
        return n

    def _schedule_running(self, budget: int) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_computed == len(req.sequence):  # a beam waiting for its group
                i += 1
                continue
            n = self._segment_tokens(req.num_computed, len(req.sequence), budget)
            if self._ahead.get(req.request_id) == n:
                del self._ahead[req.request_id]  # allocated (and mapped) last step
            elif self._allocate(req.request_id, n) is None:
                if self._preempt_newest() is req:
                    continue  # the request itself was the newest: it waits
                continue  # retry the same request with more room
            segments.append(Segment(req.request_id, req.num_computed, req.num_computed + n))
            budget -= n
            i += 1
        return segments, budget

    def _admit(self, budget: int) -> list[Segment]:
        segments: list[Segment] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            req = self.waiting[0] if self.tier is None else self.tier.pick()
            if req is None:
                break  # every window request waits for its reload
            if self.tier is not None:
                self.tier.before_admit(req)
            seq = req.sequence
            spans = req.images.spans if req.images is not None else ()
            hit = self.kv.add_request(
                req.request_id, seq, images=spans, use_cache=self.config.use_prefix_cache
            )
            n = self._segment_tokens(hit, len(seq), budget)
            admitted = self._allocate(req.request_id, n) is not None
            if self.tier is not None:
                self.tier.after_admit(req, hit, admitted)
            if not admitted:
                self.kv.free(req.request_id)
                if self.tier is not None and not self.running and self.tier.drop_reloads():
                    continue  # other requests' reloads held the room: they are cached now
                break
            self.waiting.remove(req)
            self.stats["prefix.hit_tokens"] += hit
            req.num_computed = req.num_hit_tokens = hit
            self.running.append(req)
            segments.append(Segment(req.request_id, hit, hit + n))
            budget -= n
        return segments

    def _allocate(self, request_id: Hashable, n: int) -> Any:
        """`kv.allocate`, or None ("no room") when a shared pool cannot lend the chunks."""
        if self.gate is None:
            return self.kv.allocate(request_id, n)
        if not self.gate.allow(request_id, n):
            return None
        try:
            return self.kv.allocate(request_id, n)
        finally:
            self.gate.done()

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> int:
        """One scheduling + forward step; returns the number of segments computed."""
        if self.gate is None:
            return self._step()
        with self.gate.lock:  # an owner's reclaim evicts cached pages only between steps
            computed = self._step()
            self.kv.sync()
            self.gate.after_step()
        return computed

    def _step(self) -> int:
        self.kv.sync()  # the worker's maps for this step are done (a stall if not)
        started = time.perf_counter()
        self._arrivals()
        if self.tier is not None:
            self.tier.before_schedule()
        segments, budget = self._schedule_running(self.config.token_budget)
        segments += self._admit(budget)
        while not segments and self.waiting and self._preempt_waiting_beam():
            segments = self._admit(budget)
        self.step_index += 1
        self.stats["steps"] += 1
        if not segments:
            if self.tier is not None:
                self._settle_reloads([])
            return 0
        self.stats["running.max"] = max(self.stats["running.max"], len(self.running))
        by_id = {r.request_id: r for r in self.running}
        slots = self.forward.prepare(segments)
        if self.config.overlap:
            self._allocate_ahead(segments, by_id)
        segments, tokens, logits = self._forward(segments, by_id, slots)
        self.stats["tokens.computed"] += len(tokens)
        for seg, row in zip(segments, logits, strict=True):
            self._after_forward(by_id[seg.request_id], seg, row)
        groups = {id(r.beam): r.beam for r in self.running if r.beam is not None}
        for group in groups.values():
            if group.ready:
                self._beam_step(group)
        self.running = [r for r in self.running if not r.finished]
        if self.tier is not None:
            self.tier.on_step(time.perf_counter() - started)
        return len(segments)

    def _forward(self, segments: list[Segment], by_id: dict, slots: Any) -> tuple:
        """The step's forward: (segments, tokens, logits). A reload copy that failed while
        the forward waited for its layer requeues every request holding its blocks, and
        the forward runs again without them (their K/V writes are rewritten alike)."""
        while segments:
            tokens = [t for s in segments for t in by_id[s.request_id].sequence[s.start : s.stop]]
            images = {r.request_id: r.images for r in self.running if r.images is not None}
            try:
                logits = self.forward(segments, tokens, slots, *([images] if images else []))
            except ReloadFailed as failed:
                assert self.tier is not None
                segments, slots = self._without_holders(
                    segments, slots, self.tier.fail(failed.reload)
                )
                continue
            if self.tier is None:
                return segments, tokens, logits
            kept = self._settle_reloads(segments)
            rows = [row for seg, row in zip(segments, logits, strict=True) if seg in kept]
            tokens = [t for s in kept for t in by_id[s.request_id].sequence[s.start : s.stop]]
            return kept, tokens, rows
        return [], [], []

    def _settle_reloads(self, segments: list[Segment]) -> list[Segment]:
        """Finish the open reloads after the forward; the segments of requests holding a
        failed one's blocks are dropped (the requests requeued)."""
        assert self.tier is not None
        for dropped in self.tier.settle():
            segments, _ = self._without_holders(segments, {}, dropped)
        return segments

    def _without_holders(
        self, segments: list[Segment], slots: Any, dropped: list[list[int]]
    ) -> tuple[list[Segment], Any]:
        """Requeue the running requests that hold a block of ``dropped`` (per group);
        returns the other segments and their prepared slots."""
        bad = [set(blocks) for blocks in dropped]
        holders = {
            r.request_id
            for r in self.running
            if any(bad[g] & set(self.kv.block_table(r.request_id, g)) for g in range(len(bad)))
        }
        for req in [r for r in self.running if r.request_id in holders]:
            self.running.remove(req)
            self._requeue(req)
        kept = [(i, s) for i, s in enumerate(segments) if s.request_id not in holders]
        if isinstance(self.forward, PackedForward):  # its slots are keyed by segment index
            new = {old: i for i, (old, _) in enumerate(kept)}
            slots = {(new[k[0]], *k[1:]): v for k, v in slots.items() if k[0] in new}
        return [s for _, s in kept], slots

    def _allocate_ahead(self, segments: list[Segment], by_id: dict) -> None:
        """Allocate next step's decode token of every request that samples now and goes on;
        map-only plans run on the overlap worker during this step's forward."""
        for seg in segments:
            req = by_id[seg.request_id]
            decodes_next = (
                seg.stop == len(req.sequence) and len(req.output) + 1 < req.max_new_tokens
            )
            if decodes_next and self.kv.allocate_ahead(req.request_id, 1) is not None:
                self._ahead[req.request_id] = 1
        self.kv.launch_ahead()

    def _after_forward(self, req: EngineRequest, seg: Segment, logits: torch.Tensor) -> None:
        req.num_computed = seg.stop
        samples = [req]
        if req.beam is not None:
            if seg.stop == len(req.sequence):
                req.beam.stash(req.request_id, logits)
            if self.config.use_prefix_cache:
                self.kv.cache(req.request_id, req.num_computed)
            return
        if seg.stop == len(req.sequence):
            samples += self._fork_samples(req)
            for sample in samples:
                token = _sample(logits, sample.generator)
                sample.output.append(token)
                if len(sample.output) == 1:
                    at = self._arrived.get(sample.request_id, self._arrived.get(req.request_id))
                    self.ttft[sample.request_id] = time.perf_counter() - (at or 0.0)
                self.kv.append_tokens(sample.request_id, [token])
        for sample in samples:
            if self.config.use_prefix_cache:
                self.kv.cache(sample.request_id, sample.num_computed)
            if sample.finished:
                if self.tier is not None:
                    self.tier.on_finished(sample)
                self.kv.free(sample.request_id)
                sample.images = None
                self.done[sample.request_id] = sample

    def _fork_samples(self, req: EngineRequest) -> list[EngineRequest]:
        """Samples 1..n-1 of a request whose prompt is computed: forks of it (its blocks
        shared), each with its own generator; they run from the next step on."""
        if req.n == 1:
            return []
        if self.config.use_prefix_cache:
            self.kv.cache(req.request_id, req.num_computed)  # the samples inherit it
        base = cast(tuple, req.request_id)[0]  # samples are (request_id, i)
        kids = [
            EngineRequest((base, i), list(req.prompt), req.max_new_tokens, req.arrival_step,
                          num_computed=req.num_computed, seed=req.seed + i,
                          generator=torch.Generator().manual_seed(req.seed + i))
            for i in range(1, req.n)
        ]  # fmt: skip
        self.kv.fork(req.request_id, [k.request_id for k in kids])
        req.n = 1
        self.running.extend(kids)
        return kids

    def _beam_step(self, group: BeamGroup) -> None:
        """Choose the next beams (`BeamGroup.select`) and remap them: the first new beam
        that continues an old one takes its request over, the others fork it (its blocks
        shared), an old beam no new one continues is freed; after the last token every
        beam is done, results ``(request_id, i)`` best first."""
        by_id = {r.request_id: r for r in self.running}
        old = [by_id[b] for b in group.beams]
        choice = group.select()
        outputs = [[*old[s].output, t] for s, t in zip(choice.sources, choice.tokens, strict=True)]
        at = next(i for i, r in enumerate(self.running) if r.beam is group)
        self.running = [r for r in self.running if r.beam is not group]
        if len(outputs[0]) >= group.max_new_tokens:
            for beam in old:
                self.kv.free(beam.request_id)
            for i, out in enumerate(outputs):
                first = old[0]
                self.done[(group.request_id, i)] = EngineRequest(
                    (group.request_id, i), first.prompt, first.max_new_tokens,
                    first.arrival_step, output=out,
                )  # fmt: skip
            return
        taken: set[int] = set()
        new: list[EngineRequest] = []
        kids: dict[int, list[Hashable]] = {}
        for s, out in zip(choice.sources, outputs, strict=True):
            src = old[s]
            if s in taken:
                beam = EngineRequest(
                    group.new_id(), src.prompt, src.max_new_tokens, src.arrival_step,
                    num_computed=src.num_computed, beam=group, order=src.order,
                )  # fmt: skip
                kids.setdefault(s, []).append(beam.request_id)
            else:
                taken.add(s)
                beam = src
            beam.output = out
            new.append(beam)
        for s, ids in kids.items():
            self.kv.fork(old[s].request_id, ids)
        for s, beam in enumerate(old):
            if s not in taken:
                self.kv.free(beam.request_id)
        for beam, token in zip(new, choice.tokens, strict=True):
            self.kv.append_tokens(beam.request_id, [token])
        group.beams = [b.request_id for b in new]
        self.running[at:at] = new  # the group keeps its place in the preemption order

    def run(self, max_steps: int = 10_000) -> dict[Hashable, list[int]]:
        """Step until every request finished; returns each request's generated tokens."""
        while self.pending or self.waiting or self.running:
            if self.stats["steps"] >= max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
            computed = self.step()
            stuck = all(r.num_computed == len(r.sequence) for r in self.running)  # beams wait
            if not computed and stuck and not self.pending and self.waiting:
                usage = self.kv.allocator.usage()
                raise vmm.OutOfMemory(
                    f"request {self.waiting[0].request_id!r} does not fit in the KV cache "
                    f"alone ({usage.free_units} of {usage.total_units} chunks free)",
                    free=usage.free_units,
                    total=usage.total_units,
                )
        return {rid: r.output for rid, r in self.done.items()}

    def close(self) -> None:
        self.kv.sync()
        if self.tier is not None:
            self.tier.close()
        self.kv.close()
        self.pool.close()


def _sample(logits: torch.Tensor, generator: torch.Generator | None) -> int:
    """Greedy without a generator; else a draw from the softmax of the fp32 logits (what
    transformers' sampling does with no logits processor)."""
    if generator is None:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().reshape(1, -1), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _make_pool(cfg: EngineConfig) -> vmm.ChunkPool:
    """The engine's own pool, or a tenant's pool on the shared pool `cfg.shared_pool`."""
    if cfg.shared_pool:
        import os

        if cfg.overlap:
            raise ValueError("overlap=True is not supported on a shared pool (shared_pool=...)")

        from vmm.shared import join_pool

        name = cfg.tenant_name or f"engine-{os.getpid()}"
        backend = join_pool(
            cfg.shared_pool, name, min_bytes=cfg.tenant_min_bytes, max_bytes=cfg.tenant_max_bytes
        )
        if backend.granularity != cfg.chunk_bytes:
            backend.close()
            raise ValueError(
                f"shared pool {cfg.shared_pool!r} lends {backend.granularity}-byte chunks, "
                f"the engine is configured for chunk_bytes={cfg.chunk_bytes}"
            )
        return vmm.ChunkPool(backend, backend.tenant.max_bytes)
    if cfg.backend == "host":
        own = vmm.get_backend("host", granularity=cfg.chunk_bytes)
    else:
        own = vmm.get_backend(cfg.backend)
    return vmm.ChunkPool(own, cfg.budget_bytes)


def _shared_gate(kv: KVCache, pool: vmm.ChunkPool) -> Any:
    tenant = getattr(pool.backend, "tenant", None)
    if tenant is None:
        return None
    from integrations.kvcache.shared_pool import SharedPoolGate

    return SharedPoolGate(kv, tenant)
