"""The user's options (``additional_config["jenga_vmm"]``) and the KV-tensor geometry.

Rationale
    Four KV-tensor modes decide where a vLLM block id points, and nearly every part of
    the integration (layout, manager, worker tensors) branches on them. They are one
    enum, `TensorGeometry`, resolved once from the options (and, for ``geometry="auto"``,
    from the KV-cache config: `JengaVllmOptions.resolve`), so no module compares the
    option strings again.

Approach
    `JengaVllmOptions` is the public config boundary: it accepts the option strings
    users write (``"per_group"``, ``pages="vllm"``, ``kv_tensors="vmm"``), checks them in
    ``__post_init__`` (`InvalidOptions` names the bad value), and answers
    `JengaVllmOptions.tensor_geometry` and the defaults that follow from it.

Limitations
    Unknown keys are refused, never ignored (`JengaVllmOptions.from_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum

from jenga.allocator import AllocationOrder
from jenga.pages import DEFAULT_CHUNK_BYTES

from integrations.vllm.errors import InvalidOptions

OPTIONS_KEY = "jenga_vmm"
"""Key of our options inside ``VllmConfig.additional_config``."""


class TensorGeometry(StrEnum):
    """Where vLLM block ids point (the four KV-tensor modes, and "auto").

    ``SHARED_SLOTS`` (``pages="vllm"``): vLLM's own KV tensors overlay every group on one
    buffer; an allocator page is one of vLLM's block slots (`integrations.vllm.slots`).
    ``VMM_SLOTS`` (``pages="vmm"``, ``geometry="slots"``): the same block slots, over a
    VMM range laid out exactly as vLLM's buffer; a 2 MiB chunk of it is mapped while
    any mapped slot touches it (`integrations.vllm.slot_chunks`). ``PER_GROUP``
    (``pages="vmm"``, ``geometry="per_group"``): one VMM range per group, a large page
    holds whole blocks of all its layers, vLLM ids spread so page ``q`` starts at id
    ``q*M`` (`integrations.vllm.placement`). ``PER_LAYER`` (``pages="vmm"``,
    ``geometry="per_layer"``): one VMM range per layer, vLLM ids are the allocator's.
    ``AUTO`` is no geometry: `JengaVllmOptions.resolve` turns it into ``VMM_SLOTS`` or
    ``PER_GROUP`` from the KV-cache config.
    """

    SHARED_SLOTS = "shared_slots"
    VMM_SLOTS = "slots"
    PER_GROUP = "per_group"
    PER_LAYER = "per_layer"
    AUTO = "auto"

    @property
    def on_vmm_ranges(self) -> bool:
        """True for the per-group / per-layer VMM ranges (ids per group, null id =
        capacity); the slot geometries share ids across groups (null id 0)."""
        return self in (TensorGeometry.PER_GROUP, TensorGeometry.PER_LAYER)

    @property
    def slot_ids(self) -> bool:
        """True where block ids are vLLM's block slots, shared by all groups (slot 0 null)."""
        return self in (TensorGeometry.SHARED_SLOTS, TensorGeometry.VMM_SLOTS)


VMM_GEOMETRIES = (
    TensorGeometry.AUTO,
    TensorGeometry.VMM_SLOTS,
    TensorGeometry.PER_GROUP,
    TensorGeometry.PER_LAYER,
)
"""The values of `JengaVllmOptions.geometry`: where VMM pages place a group's blocks."""


@dataclass(frozen=True)
class JengaVllmOptions:
    """What the user may set under ``additional_config={"jenga_vmm": {...}}``.

    ``pages``: where a block id points. "vllm" (the default with ``kv_tensors="torch"``):
    vLLM's own KV tensors, in which every group overlays the same buffer and block id
    ``b`` is the same bytes in every group, so ids are vLLM's shared block slots (1 ..
    ``num_blocks - 1``, 0 = null) and a group's large page is one slot; memory moves
    between groups block by block, as in vLLM, and jenga adds request-aware allocation
    and the prefix-subset evictor. "vmm" (required by ``kv_tensors="vmm"``): VMM ranges
    placed per ``geometry``, each group with its unpadded page in large pages of ``k``
    chunks. "auto" picks by ``kv_tensors``. `tensor_geometry` is the result.
    ``junctions``: report the shared-prefix boundary to the scheduler
    (`JengaKVCacheManager.get_computed_blocks`) so Mamba states get cached where
    siblings' prompts diverge.
    ``geometry`` (VMM pages): "slots" (vLLM's block slots over one VMM range laid out as
    vLLM's buffer: memory moves between groups block by block and a chunk is mapped
    while a mapped slot touches it), "per_group" (one range per KV-cache group, a large
    page holds whole blocks of all the group's layers), "per_layer" (one range per
    layer, a large page is ``k`` chunks of each; per-layer contiguous tensors) or "auto"
    (the default): "slots" where every group's unpadded block fills vLLM's slot exactly
    (vLLM's overlay wastes nothing there) and no ``shared_pool`` is set, "per_group"
    otherwise (pages of different sizes, e.g. Mamba states beside attention, which
    vLLM pads to one slot). `build_layout` resolves it (`resolve`); a string is turned
    into its `TensorGeometry`. "slots" with ``shared_pool`` is refused: the pool's
    capacity is counted in chunks, the slot geometry's allocator in slots.
    ``chunk_bytes``: the exchange unit between groups (CUDA: the 2 MiB granularity).
    ``epsilon``: the waste (tail, padding) a large page may carry; None: 0.01 per_layer
    (whose VMM tensor path needs 0-tail groups), 0.05 per_group (any tail works).
    ``reuse_window_releases``: blocks that left a sliding window / local chunk are cached
    in a lower tier and the group reuses those stranded in pages it still pins before
    mapping or evicting a page (`jenga.config.AllocationRules`); None: on with per_group
    VMM pages (a page holds many blocks there), off otherwise. ``pack_window_blocks``
    (with window-release reuse): the window blocks a request keeps fill released slots on
    the pages live blocks pin most (`jenga.config.AllocationRules`); off by default: it
    lifts the Ministral sweep cells that lost on running but costs second-wave hits on
    sliding-window MLA and two Ministral 256 MiB cells (docs/vllm-geometry.md).
    ``order``: "compact" (steps 1, 4, 2, 3, 5), "pinned" (compact plus step 5 on pinned
    pages before step 3) or "paper" (`jenga.allocator`); None: "pinned" with per_group VMM
    pages, where its pinned step is LRU-fair (it takes a cached block of a page live
    blocks pin only when no wholly evictable page is less recently used:
    `AllocationRules.pinned_lru_fair`), "compact" otherwise. Compact keeps other
    prompts' cached pages alive where the paper order evicts whole pages before using
    free slots in other requests' pages; pinned keeps pages evictable and more requests
    running under memory pressure (measured in `docs/vllm.md`). ``kv_tensors``:
    "vmm" makes the worker plugin put the KV cache on VMM ranges
    (`integrations.vllm.plugin`); "torch" leaves vLLM's. ``shared_pool``: with
    ``kv_tensors="vmm"``, draw the chunks from the shared pool of that name (`vmm-pool
    start NAME`, docs/multi-tenant.md) as tenant ``tenant_name`` with byte limits
    ``tenant_min_bytes`` / ``tenant_max_bytes`` instead of a private pool (host backend).
    The scheduler maps only the chunks the owner guarantees (``tenant_min_bytes``, which
    must then be > 0) until `JengaKVCacheManager.set_capacity` hands it more.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    epsilon: float | None = None
    geometry: TensorGeometry = TensorGeometry.AUTO
    reuse_window_releases: bool | None = None
    order: str | None = None
    kv_tensors: str = "torch"
    pages: str = "auto"
    junctions: bool = True
    pack_window_blocks: bool = False
    shared_pool: str = ""
    tenant_name: str = ""
    tenant_min_bytes: int = 0
    tenant_max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.shared_pool and self.kv_tensors != "vmm":
            raise InvalidOptions("shared_pool needs kv_tensors='vmm' (chunks come from the pool)")
        if self.shared_pool and self.tenant_min_bytes <= 0:
            raise InvalidOptions(
                f"shared_pool needs tenant_min_bytes > 0, got {self.tenant_min_bytes}: the "
                "scheduler maps only the chunks the owner guarantees"
            )
        if self.kv_tensors not in ("torch", "vmm"):
            raise InvalidOptions(f"kv_tensors must be 'torch' or 'vmm', got {self.kv_tensors!r}")
        if self.pages not in ("auto", "vllm", "vmm"):
            raise InvalidOptions(f"pages must be 'auto', 'vllm' or 'vmm', got {self.pages!r}")
        if self.kv_tensors == "vmm" and self.pages == "vllm":
            raise InvalidOptions(
                "pages='vllm' places blocks in vLLM's own shared KV tensors; "
                "kv_tensors='vmm' needs pages='vmm' (or 'auto')"
            )
        if self.chunk_bytes <= 0:
            raise InvalidOptions(f"chunk_bytes must be > 0, got {self.chunk_bytes}")
        if self.epsilon is not None and not 0.0 <= self.epsilon < 1.0:
            raise InvalidOptions(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.geometry not in VMM_GEOMETRIES:
            names = tuple(str(g) for g in VMM_GEOMETRIES)
            raise InvalidOptions(f"geometry must be one of {names}, got {self.geometry!r}")
        object.__setattr__(self, "geometry", TensorGeometry(self.geometry))
        if self.shared_pool and self.geometry is TensorGeometry.VMM_SLOTS:
            raise InvalidOptions(
                f"geometry='slots' cannot draw from shared_pool {self.shared_pool!r}: the "
                "pool's capacity is counted in chunks, the slot allocator's in block slots; "
                "use geometry='per_group' (or 'auto', which picks it with a shared pool)"
            )
        if self.order is not None and self.order not in tuple(AllocationOrder):
            raise InvalidOptions(
                f"order must be one of {[str(o) for o in AllocationOrder]}, got {self.order!r}"
            )

    @property
    def vmm_pages(self) -> bool:
        """Whether block ids point into VMM ranges (`pages`, "auto" resolved by
        `kv_tensors`)."""
        return self.pages == "vmm" or (self.pages == "auto" and self.vmm_tensors)

    @property
    def tensor_geometry(self) -> TensorGeometry:
        """Where block ids point: `pages` and `geometry`; raises `InvalidOptions` on VMM
        pages while `geometry` is still "auto" (`resolve` it first)."""
        if not self.vmm_pages:
            return TensorGeometry.SHARED_SLOTS
        if self.geometry is TensorGeometry.AUTO:
            raise InvalidOptions(
                "geometry='auto' is resolved from the KV-cache config (build_layout / "
                "JengaVllmOptions.resolve) before the geometry is known"
            )
        return self.geometry

    def resolve(self, uniform_slots: bool) -> JengaVllmOptions:
        """These options with ``geometry="auto"`` decided: "slots" when
        ``uniform_slots`` (every group's unpadded block is vLLM's slot) and no
        `shared_pool`, else "per_group"; other values are kept."""
        if self.geometry is not TensorGeometry.AUTO:
            return self
        slots = uniform_slots and not self.shared_pool
        geometry = TensorGeometry.VMM_SLOTS if slots else TensorGeometry.PER_GROUP
        return replace(self, geometry=geometry)

    @property
    def vmm_tensors(self) -> bool:
        """Whether the worker puts the KV cache on VMM ranges (``kv_tensors="vmm"``)."""
        return self.kv_tensors == "vmm"

    @property
    def page_epsilon(self) -> float:
        """`epsilon`, or the geometry's default when None."""
        if self.epsilon is not None:
            return self.epsilon
        return 0.05 if self.geometry is TensorGeometry.PER_GROUP else 0.01

    @property
    def per_group_vmm(self) -> bool:
        """VMM pages in one range per group (the geometry several defaults follow)."""
        return self.tensor_geometry is TensorGeometry.PER_GROUP

    @property
    def window_reuse(self) -> bool:
        """`reuse_window_releases`, or its default (per_group VMM pages) when None."""
        if self.reuse_window_releases is not None:
            return self.reuse_window_releases
        return self.per_group_vmm

    @property
    def allocation_order(self) -> str:
        """`order`, or its default when None: "pinned" on per_group VMM pages, else
        "compact"."""
        if self.order is not None:
            return self.order
        return "pinned" if self.per_group_vmm else "compact"

    @classmethod
    def from_dict(cls, values: dict[str, object] | None) -> JengaVllmOptions:
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidOptions(f"unknown jenga_vmm option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_vllm_config(cls, vllm_config: object) -> JengaVllmOptions:
        extra = getattr(vllm_config, "additional_config", None) or {}
        return cls.from_dict(extra.get(OPTIONS_KEY) if isinstance(extra, dict) else None)
