"""The real Jenga allocator (`jenga.allocator.JengaAllocator`, C++ core) behind the sim protocol.

Rationale
    The simulator must measure the project's allocator, not a model of it. This adapter
    only translates: engine calls become `add_request` / `append_tokens` / `cache` /
    `allocate` / `free`, and the core's `usage()` becomes byte counts. No allocation
    decision is made here.

Approach
    Configurations of the one core, each a page table (`jenga.pages`) and a rules value
    (`jenga.config.AllocationRules`), one row of `VARIANTS`:

        jenga_static  one buffer of large pages of lcm(all small pages) bytes, the page-
                      layer partition of the paper's Fig. 7b (pool unit = one large page);
        jenga_vmm     2 MiB chunks; group g's large page is k chunks per range (the
                      smallest k with a tail <= epsilon), chunks are the exchange unit.

    ``jenga_vmm_group`` is ``jenga_vmm`` with the ``per_group`` layout (one range per
    group); ``jenga_vmm_group_pinned`` adds the rules the vLLM integration sets on such
    pages (pinned order, LRU-fair, window releases demoted and reused).
    ``jenga_vmm_compact`` / ``jenga_static_compact`` (compact step order),
    ``jenga_static_demote`` / ``jenga_vmm_demote`` (window-release demotion on) and
    ``jenga_vmm_single_pass`` (no frugal retry) vary the rules, for side-by-side runs.

    The MAX baseline of the paper's §4.4 (``max_page``) is the same core with a static
    page table whose unit is the largest group block, every other group's block padded
    to it.

    Bytes: a block is charged its share of a large page (``large page bytes /
    blocks per large page``: its real bytes plus its share of a VMM tail or of MAX
    padding); live = blocks owned by requests, cached = evictable blocks. Committed =
    the whole buffer in static modes; mapped units (chunks) x unit bytes in VMM mode.

Images
    The engine's sequence is ``image tokens + text tokens``. For a LLaVA-style model
    (no cross attention) the image tokens are in the text stream: the core gets that
    sequence with an in-text `ImageSpan` over them. For a model with cross attention
    (Llama 3.2 Vision / mllama) the self-attention layers never see the image: the core
    gets ``[placeholder] + text`` (the placeholder is the prompt's ``<|image|>`` token)
    and an encoder-side span (``in_text=False``) of ``image_tokens`` encoder tokens, so
    cross-attention groups store exactly the image and self-attention groups only the
    text. Engine position ``n`` maps to core length ``0`` (n = 0), ``1`` while the
    image is being computed, ``1 + n - image_tokens`` after it (`_core_length`).

Limitations
    Mamba groups keep every checkpoint a step computes (``mamba_step_end_only=False``, the
    rows' setting); vLLM's "align" mode writes a state only where a step ends, which
    ``mamba_step_end_only=True`` models (no row uses it; docs/reproduction.md, "Why two
    Jenga rows lose").
    In encoder mode the placeholder takes one slot of every self-attention group (the
    real model stores its KV too; the waste model counts only text tokens), and the
    image is committed to the prefix cache once the engine computed all of its tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jenga.allocator import JengaAllocator
from jenga.config import AllocationOrder, AllocationRules, AllocatorConfig
from jenga.pages import PageTable, static_page_table, vmm_page_table
from jenga.prefix import content_hash
from jenga.requests import ImageSpan
from jenga.sim.needs import role_of
from jenga.sim.protocol import AllocatorSnapshot, RequestState
from jenga.specs import ModelSpec


class JengaCoreAllocator:
    """`SimAllocator` over one `JengaAllocator`; see the module note."""

    def __init__(
        self,
        name: str,
        model: ModelSpec,
        kv_bytes: int,
        table: PageTable,
        rules: AllocationRules | None = None,
        *,
        mamba_step_end_only: bool = False,
    ) -> None:
        self.name = name
        self.use_prefix_cache = True  # False: no lookups, nothing committed (--no-prefix-cache)
        self.table = table
        self._unit_bytes = table.unit_bytes
        self._total_units = kv_bytes // table.unit_bytes
        self.core = JengaAllocator(
            AllocatorConfig.from_page_table(
                model,
                table,
                self._total_units,
                rules or AllocationRules(),
                mamba_step_end_only=mamba_step_end_only,
            )
        )
        # bytes a block is charged: its share of a large page (padding and tails included)
        self._page_bytes = [table.group(g.name).large_page_total_bytes for g in model.groups]
        self._blocks_per_page = [table.group(g.name).blocks_per_large_page for g in model.groups]
        self._group_names = [g.name for g in model.groups]
        self._known_tokens: dict[str, int] = {}
        # images outside the text stream: the model has cross attention (role "text")
        self.encoder_images = any(role_of(g.spec, model) == "text" for g in model.groups)

    def _images(self, state: RequestState) -> tuple[ImageSpan, ...]:
        image = state.image_tokens
        if not image:
            return ()
        key = content_hash(state.tokens[:image])  # 128 bits, as the block identity
        return (ImageSpan(0, image, key, in_text=not self.encoder_images),)

    def _encoder_offset(self, state: RequestState) -> int:
        """Engine positions minus core positions after the image (0 unless encoder-side)."""
        return state.image_tokens - 1 if self.encoder_images and state.image_tokens else 0

    def _core_length(self, state: RequestState, n: int, computed: bool = False) -> int:
        """Core tokens for the first ``n`` engine tokens (allocated, or ``computed``)."""
        offset = self._encoder_offset(state)
        if not offset or n == 0:
            return n
        if n < state.image_tokens:  # the image is in progress: its placeholder needs a slot
            return 0 if computed else 1
        return n - offset

    def _core_prompt(self, state: RequestState) -> list[int]:
        offset = self._encoder_offset(state)
        return state.tokens[offset:] if offset else state.tokens

    def _sync_tokens(self, state: RequestState) -> None:
        """Tell the core the generated tokens that are computed (only those get hashed)."""
        known = self._known_tokens[state.req_id]
        if state.num_computed > known:
            self.core.append_tokens(state.req_id, state.tokens[known : state.num_computed])
            self._known_tokens[state.req_id] = state.num_computed

    def _commit(self, state: RequestState) -> None:
        self._sync_tokens(state)
        if not self.use_prefix_cache:
            return
        computed = self._core_length(state, state.num_computed, computed=True)
        self.core.cache(state.req_id, min(computed, self.core.num_tokens(state.req_id)))

    def admit(self, state: RequestState) -> int:
        prompt = self._core_prompt(state)
        hit = self.core.add_request(
            state.req_id, prompt, images=self._images(state), use_cache=self.use_prefix_cache
        )
        self._known_tokens[state.req_id] = len(state.tokens)
        state.num_computed = hit + self._encoder_offset(state) if hit else 0
        return state.num_computed

    def allocate(self, state: RequestState, num_tokens: int) -> bool:
        self._commit(state)
        delta = self._core_length(state, num_tokens) - self.core.num_tokens(state.req_id)
        if delta <= 0:
            return True
        return self.core.allocate(state.req_id, delta) is not None

    def trim(self, state: RequestState) -> None:
        self._commit(state)
        self.core.release_skipped(state.req_id)

    def release(self, state: RequestState) -> None:
        self._commit(state)
        self.core.free(state.req_id)
        del self._known_tokens[state.req_id]

    def snapshot(self) -> AllocatorSnapshot:
        use = self.core.usage()
        live = [self._charged(g, n) for g, n in enumerate(use.used_blocks)]
        cached = sum(self._charged(g, n) for g, n in enumerate(use.cached_blocks))
        units = use.used_units if self.table.mode == "vmm" else use.total_units
        return AllocatorSnapshot(
            capacity_bytes=use.total_units * self._unit_bytes,
            committed_bytes=units * self._unit_bytes,
            live_bytes=sum(live),
            cached_bytes=cached,
            group_live_bytes=dict(zip(self._group_names, live, strict=True)),
        )

    def _charged(self, group: int, num_blocks: int) -> int:
        return num_blocks * self._page_bytes[group] // self._blocks_per_page[group]

    def check_invariants(self) -> None:
        self.core.check_invariants(expensive=True)


def _lcm_table(model: ModelSpec) -> PageTable:
    return static_page_table(model, strategy="lcm")


def _max_table(model: ModelSpec) -> PageTable:
    return static_page_table(model, strategy="max")


def _vmm_table(model: ModelSpec) -> PageTable:
    return vmm_page_table(model, epsilon=0.01)  # 2 MiB chunks, tails within 1 %


def _vmm_group_table(model: ModelSpec) -> PageTable:
    # one range per group, a block holds all of its layers: what paged engines use
    # (DESIGN.md, "Which layout where"); a Mamba large page is one state of every layer
    return vmm_page_table(model, epsilon=0.01, layout="per_group")


# name -> (page table, rules): every simulator row of the real core
VARIANTS: dict[str, tuple[Callable[[ModelSpec], PageTable], AllocationRules]] = {
    "max_page": (_max_table, AllocationRules()),  # every group block padded to the largest
    "jenga_static": (_lcm_table, AllocationRules()),  # paper-faithful: LCM pages, one buffer
    "jenga_vmm": (_vmm_table, AllocationRules()),
    "jenga_vmm_group": (_vmm_group_table, AllocationRules()),
    # per-group pages with the rules the vLLM integration sets on them (docs/vllm.md):
    # pinned order with its LRU-fair step, window releases demoted and reused
    "jenga_vmm_group_pinned": (
        _vmm_group_table,
        AllocationRules(
            order=AllocationOrder.PINNED,
            pinned_lru_fair=True,
            demote_window_releases=True,
            reuse_window_releases=True,
        ),
    ),
    "jenga_vmm_compact": (_vmm_table, AllocationRules(order=AllocationOrder.COMPACT)),
    # the paper's LCM pages in compact order: what the LCM geometry costs without the
    # paper's request association (docs/reproduction.md, "Why two Jenga rows lose")
    "jenga_static_compact": (_lcm_table, AllocationRules(order=AllocationOrder.COMPACT)),
    "jenga_static_demote": (_lcm_table, AllocationRules(demote_window_releases=True)),
    "jenga_vmm_demote": (_vmm_table, AllocationRules(demote_window_releases=True)),
    # a refused allocation is final (the paper's single pass): the engine waits instead of
    # evicting scattered cached blocks
    "jenga_vmm_single_pass": (_vmm_table, AllocationRules(frugal_retry=False)),
}


def _build(name: str, model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    table, rules = VARIANTS[name]
    return JengaCoreAllocator(name, model, kv_bytes, table(model), rules)


FACTORIES: dict[str, Callable[[ModelSpec, int], JengaCoreAllocator]] = {
    name: functools.partial(_build, name) for name in VARIANTS
}
