"""The real Jenga allocator (`jenga.allocator.JengaAllocator`, C++ core) behind the sim protocol.

Rationale
    The simulator must measure the project's allocator, not a model of it. This adapter
    only translates: engine calls become `add_request` / `append_tokens` / `cache` /
    `allocate` / `free`, and the core's `usage()` becomes byte counts. No allocation
    decision is made here.

Approach
    Two configurations of the one core, differing only in the page table
    (`jenga.pages`):

        jenga_static  one buffer of large pages of lcm(all small pages) bytes, the page-
                      layer partition of the paper's Fig. 7b (pool unit = one large page);
        jenga_vmm     2 MiB chunks; group g's large page is k chunks per range (the
                      smallest k with a tail <= epsilon), chunks are the exchange unit.

    ``jenga_vmm_group`` is ``jenga_vmm`` with the ``per_group`` layout (one range per
    group). ``jenga_static_demote`` / ``jenga_vmm_demote`` are the same two with window-release
    demotion on, for side-by-side runs; they are not in the default set.

    A third configuration is the MAX baseline of the paper's §4.4 (``max_page``): the
    same core with a static page table whose unit is the largest group block, every
    other group's block padded to it.

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
    In encoder mode the placeholder takes one slot of every self-attention group (the
    real model stores its KV too; the waste model counts only text tokens), and the
    image is committed to the prefix cache once the engine computed all of its tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from jenga.allocator import AllocationOrder, AllocatorConfig, ImageSpan, JengaAllocator
from jenga.pages import PageTable, static_page_table, vmm_page_table
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
        order: AllocationOrder = AllocationOrder.PAPER,
        *,
        demote_window_releases: bool = False,
        frugal_retry: bool = True,
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
                order,
                demote_window_releases=demote_window_releases,
                frugal_retry=frugal_retry,
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
        key = hash(tuple(state.tokens[:image]))
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


def jenga_static(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """Paper-faithful Jenga: LCM large pages in one static buffer."""
    return JengaCoreAllocator(
        "jenga_static", model, kv_bytes, static_page_table(model, strategy="lcm")
    )


def max_page(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """MAX page (paper §4.4) on the Jenga core: every group block padded to the largest."""
    return JengaCoreAllocator("max_page", model, kv_bytes, static_page_table(model, strategy="max"))


def jenga_vmm(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """Jenga on VMM: 2 MiB chunks, per-group large pages within 1 % tail."""
    return JengaCoreAllocator("jenga_vmm", model, kv_bytes, vmm_page_table(model, epsilon=0.01))


def jenga_vmm_group(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """Jenga on VMM with the ``per_group`` layout (one range per group, a block holds all
    of the group's layers): the layout paged engines use (DESIGN.md, "Which layout
    where"). A Mamba hybrid's large page is one state of every layer, not k per layer."""
    table = vmm_page_table(model, epsilon=0.01, layout="per_group")
    return JengaCoreAllocator("jenga_vmm_group", model, kv_bytes, table)


def jenga_vmm_compact(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """Jenga on VMM with the compact step order (free slots of other requests first)."""
    return JengaCoreAllocator(
        "jenga_vmm_compact",
        model,
        kv_bytes,
        vmm_page_table(model, epsilon=0.01),
        AllocationOrder.COMPACT,
    )


def jenga_static_demote(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """`jenga_static` with window-release demotion, for comparison."""
    return JengaCoreAllocator(
        "jenga_static_demote",
        model,
        kv_bytes,
        static_page_table(model, strategy="lcm"),
        demote_window_releases=True,
    )


def jenga_vmm_demote(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """`jenga_vmm` with window-release demotion, for comparison."""
    return JengaCoreAllocator(
        "jenga_vmm_demote",
        model,
        kv_bytes,
        vmm_page_table(model, epsilon=0.01),
        demote_window_releases=True,
    )


def jenga_vmm_single_pass(model: ModelSpec, kv_bytes: int) -> JengaCoreAllocator:
    """`jenga_vmm` without the frugal retry: a refused allocation is final (the paper's
    single pass), so the engine waits instead of evicting scattered cached blocks."""
    return JengaCoreAllocator(
        "jenga_vmm_single_pass",
        model,
        kv_bytes,
        vmm_page_table(model, epsilon=0.01),
        frugal_retry=False,
    )


FACTORIES: dict[str, Callable[[ModelSpec, int], JengaCoreAllocator]] = {
    "max_page": max_page,
    "jenga_static": jenga_static,
    "jenga_vmm": jenga_vmm,
    "jenga_vmm_group": jenga_vmm_group,
    "jenga_vmm_compact": jenga_vmm_compact,
    "jenga_static_demote": jenga_static_demote,
    "jenga_vmm_demote": jenga_vmm_demote,
    "jenga_vmm_single_pass": jenga_vmm_single_pass,
}
