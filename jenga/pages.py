"""Page math: how big a group's large page is, what it holds, and what it wastes.

Rationale
    Jenga's two-level allocator cuts memory into *large pages* and each large page into
    one group's *small pages* (one block of one layer, or of all of a group's layers).
    On a static buffer (the paper), one large page size must fit every group, hence
    ``lcm(p_1 .. p_n)``. On CUDA VMM, physical memory moves between groups in chunks
    (2 MiB), so each group needs only ``lcm(p_g, chunk)`` per virtual range, and no
    cross-group LCM is needed. This module computes both, plus the paper's MAX and GCD
    alternatives (§4.4), as plain integers for the allocator, simulator and docs.

Approach
    A `PageTable` has one `GroupPages` row per KV group. Every row, in every mode,
    satisfies (the "row identity", checked by `GroupPages.__post_init__`)::

        chunks_per_range * unit_bytes == blocks_per_large_page * small_page_bytes + tail_bytes
        units_per_large_page == chunks_per_range * num_ranges

    vmm mode, per_layer layout (block b of group g at offset b * p_g of each range)::

        range of layer 0:  | chunk | chunk | ... k chunks ... |   <- one large page
                           | p | p | p | ... blocks ... |tail|
        range of layer 1:  | same offsets, same chunk count  |
        ...                (a large page is mapped in all num_ranges ranges at once)

    k is the smallest chunk count whose tail is <= epsilon of the page (epsilon = 0: the
    exact LCM, k = lcm(p, C) / C), capped by `max_chunks_per_range`.

    static modes use one buffer (num_ranges = 1) with the page-layer partition of the
    paper's Fig. 7b: a small page holds one block of *all* of its group's layers, so
    groups with different layer counts still share one large page size.

Limitations
    Pure arithmetic: no allocation happens here. Waste figures are per large page
    (tail or padding); request-level fragmentation (partly used large pages) is the
    allocator's and the simulator's to measure. The static GCD strategy is listed for
    comparison only: a small page made of GCD units is not contiguous, so unmodified
    kernels cannot read it (paper §4.4).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jenga.policies import policy_for
from jenga.specs import KVGroup, LayerSpec, ModelSpec, SpecError

DEFAULT_CHUNK_BYTES = 2 << 20


def capacity_units(budget_bytes: int, unit_bytes: int) -> int:
    """Units (chunks under VMM) a KV budget of ``budget_bytes`` buys: ``budget // unit``.

    The one derivation of capacity: the KV cache, the mini engine, the HF cache, the vLLM
    plugin and a shared-pool tenant all size the allocator through it, and the allocator
    owns the count from then on (`JengaAllocator.set_total_units` moves it). Raises
    SpecError when the budget buys no unit.
    """
    _check_positive(budget_bytes=budget_bytes, unit_bytes=unit_bytes)
    units = budget_bytes // unit_bytes
    if units <= 0:
        raise SpecError(f"a budget of {budget_bytes} B buys no {unit_bytes}-byte unit")
    return units


STATIC_STRATEGIES = ("lcm", "max", "gcd")
VMM_LAYOUTS = ("per_layer", "per_group")
_STATIC_MODE_OF_STRATEGY = {"lcm": "static", "max": "max", "gcd": "gcd"}


@dataclass(frozen=True)
class GroupPages:
    """One group's page geometry (all sizes in bytes, per virtual range).

    `chunks_per_range` is the number of pool units one large page takes in each range:
    chunks in vmm mode; in static modes the buffer is the only range, so it equals
    `units_per_large_page` (1 for lcm/max, ``p / gcd`` for gcd).
    """

    group: str
    small_page_bytes: int  # one block of one layer (vmm, per range) / of all layers (static)
    num_ranges: int  # virtual ranges of the group (= layers, x2 when K and V are split)
    chunks_per_range: int  # k: pool units one large page takes in each range
    blocks_per_large_page: int
    units_per_large_page: int  # pool units one large page costs: chunks (vmm) / 1 (static)
    tail_bytes: int  # unused bytes per range in one large page
    kind: str = ""
    layers_per_small_page: int = 1  # 1 in vmm (per_layer); the group's layers in static
    lcm_chunks_per_range: int = 0  # k of the exact LCM (vmm); 0 in static modes
    within_epsilon: bool = True  # False when a cap forced a tail above epsilon

    def __post_init__(self) -> None:
        if min(self.small_page_bytes, self.num_ranges, self.chunks_per_range) <= 0:
            raise SpecError(f"group {self.group!r}: non-positive page geometry {self}")
        if self.blocks_per_large_page <= 0:
            raise SpecError(
                f"group {self.group!r}: a large page holds {self.blocks_per_large_page} blocks"
            )
        if self.tail_bytes < 0:
            raise SpecError(f"group {self.group!r}: negative tail {self.tail_bytes} B")
        if self.units_per_large_page != self.chunks_per_range * self.num_ranges:
            raise SpecError(
                f"group {self.group!r}: units_per_large_page {self.units_per_large_page} != "
                f"chunks_per_range {self.chunks_per_range} x num_ranges {self.num_ranges}"
            )

    @property
    def large_page_bytes(self) -> int:
        """One large page in one range: blocks * small page + tail."""
        return self.blocks_per_large_page * self.small_page_bytes + self.tail_bytes

    @property
    def large_page_total_bytes(self) -> int:
        """One large page over all of the group's ranges (what mapping it commits)."""
        return self.large_page_bytes * self.num_ranges

    @property
    def tail_fraction(self) -> float:
        return self.tail_bytes / self.large_page_bytes


@dataclass(frozen=True)
class PageTable:
    """Large-page geometry of every group of a model, in one mode.

    Invariant: ``g.chunks_per_range * unit_bytes == g.large_page_bytes`` for every row.
    """

    mode: str  # "vmm" | "static" | "max" | "gcd"
    unit_bytes: int  # chunk bytes (vmm) or the pool unit of the static buffer
    groups: tuple[GroupPages, ...]
    model_name: str = ""
    epsilon: float = 0.0  # vmm: the tail tolerance the table was built with
    kv_split: bool = False  # vmm: K and V in separate ranges
    layout: str = "per_layer"  # vmm: "per_layer" | "per_group"; static: "page_layer"

    def __post_init__(self) -> None:
        if self.unit_bytes <= 0:
            raise SpecError(f"unit_bytes must be > 0, got {self.unit_bytes}")
        for g in self.groups:
            if g.chunks_per_range * self.unit_bytes != g.large_page_bytes:
                raise SpecError(
                    f"group {g.group!r}: {g.chunks_per_range} units x {self.unit_bytes} B != "
                    f"large page {g.large_page_bytes} B"
                )

    def group(self, name: str) -> GroupPages:
        for g in self.groups:
            if g.group == name:
                return g
        raise KeyError(
            f"page table has no group {name!r}; groups: {[g.group for g in self.groups]}"
        )

    def waste_fraction(
        self, group: str | None = None, *, large_pages: Mapping[str, int] | None = None
    ) -> float:
        """Share of large-page bytes lost to tails (vmm) or padding (max).

        `group` alone: that group's tail over its large page. Otherwise over the whole
        table, with `large_pages[name]` large pages of each group (default one each),
        weighted by their bytes over all ranges.
        """
        if group is not None:
            return self.group(group).tail_fraction
        counts = large_pages if large_pages is not None else {g.group: 1 for g in self.groups}
        unknown = set(counts) - {g.group for g in self.groups}
        if unknown:
            raise KeyError(f"waste_fraction: unknown groups {sorted(unknown)}")
        negative = {name: n for name, n in counts.items() if n < 0}
        if negative:
            raise SpecError(f"waste_fraction: negative large page counts {negative}")
        total = sum(counts.get(g.group, 0) * g.large_page_total_bytes for g in self.groups)
        if total == 0:
            return 0.0
        tails = sum(counts.get(g.group, 0) * g.tail_bytes * g.num_ranges for g in self.groups)
        return tails / total

    def report(self) -> str:
        """A readable fixed-width table of the page geometry."""
        header = (
            f"page table '{self.model_name}' mode={self.mode} unit={format_bytes(self.unit_bytes)}"
        )
        header += f" layout={self.layout}"
        if self.mode == "vmm":
            header += f" epsilon={self.epsilon:g} kv_split={self.kv_split}"
        columns = ("group", "kind", "ranges", "small page", "k", "lcm k", "blocks", "units", "tail")
        rows = [columns] + [_report_row(g) for g in self.groups]
        widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
        lines = [header]
        for r in rows:
            lines.append(
                "  ".join(
                    cell.rjust(w) if i > 1 else cell.ljust(w)
                    for i, (cell, w) in enumerate(zip(r, widths, strict=True))
                )
            )
        lines.append(f"waste (one large page per group): {self.waste_fraction():.3%}")
        return "\n".join(lines)


def _report_row(g: GroupPages) -> tuple[str, ...]:
    tail = f"{format_bytes(g.tail_bytes)} ({g.tail_fraction:.2%})"
    if not g.within_epsilon:
        tail += " >eps"
    lcm_k = str(g.lcm_chunks_per_range) if g.lcm_chunks_per_range else "-"
    return (
        g.group, g.kind, str(g.num_ranges), format_bytes(g.small_page_bytes),
        str(g.chunks_per_range), lcm_k, str(g.blocks_per_large_page),
        str(g.units_per_large_page), tail,
    )  # fmt: skip


def format_bytes(n: int) -> str:
    """Exact-when-possible binary units: 573440 -> '560 KiB', 1536 -> '1.5 KiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.4g} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- vmm mode


def chunks_for_page(
    small_page_bytes: int,
    chunk_bytes: int,
    *,
    epsilon: float = 0.0,
    max_chunks: int | None = None,
) -> tuple[int, bool]:
    """(k, within_epsilon): the smallest k with tail(k) <= epsilon * k * chunk.

    tail(k) = k*C mod p, with at least one block (k*C >= p). k never exceeds the exact
    LCM's ``lcm(p, C) / C`` (tail 0 there, and nowhere below it), nor ``p / (epsilon*C)``
    (from there on the tail, always < p, is within epsilon), so the scan is short. With
    `max_chunks` below the answer, the k <= max_chunks with the smallest tail fraction is
    returned, flagged.
    """
    _check_positive(small_page_bytes=small_page_bytes, chunk_bytes=chunk_bytes)
    if not 0.0 <= epsilon < 1.0:
        raise SpecError(f"epsilon must be in [0, 1), got {epsilon}")
    lcm_k = math.lcm(small_page_bytes, chunk_bytes) // chunk_bytes
    min_k = -(-small_page_bytes // chunk_bytes)  # one block must fit
    cap = lcm_k if max_chunks is None else min(lcm_k, max_chunks)
    if cap < min_k:
        raise SpecError(
            f"small page {small_page_bytes} B needs {min_k} chunks of {chunk_bytes} B, cap is {cap}"
        )
    if epsilon == 0.0 and lcm_k <= cap:
        return lcm_k, True
    last = (
        cap
        if epsilon == 0.0
        else min(cap, max(min_k, math.ceil(small_page_bytes / (epsilon * chunk_bytes))))
    )
    best_k, best_fraction = min_k, 1.0
    for k in range(min_k, last + 1):
        fraction = (k * chunk_bytes % small_page_bytes) / (k * chunk_bytes)
        if fraction <= epsilon:
            return k, True
        if fraction < best_fraction:
            best_k, best_fraction = k, fraction
    return best_k, False


def vmm_page_table(
    model: ModelSpec,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    epsilon: float = 0.01,
    kv_split: bool = False,
    max_chunks_per_range: int | None = None,
    budget_bytes: int | None = None,
    layout: str = "per_layer",
) -> PageTable:
    """Per-group large pages of k chunks per range.

    `layout`: "per_layer" (a range per layer, block b at ``b * p`` in each) or
    "per_group" (one range per group; a block holds all of the group's layers, the
    page-layer partition on VMM). `kv_split`: K and V of attention layers live in two
    ranges, halving the per-range small page and doubling the ranges. `budget_bytes`:
    the pool; a group whose one large page (all ranges) exceeds it raises SpecError.
    """
    _check_positive(chunk_bytes=chunk_bytes)
    if layout not in VMM_LAYOUTS:
        raise SpecError(f"unknown layout {layout!r}; choose from {VMM_LAYOUTS}")
    rows = tuple(
        _vmm_group_pages(g, chunk_bytes, epsilon, kv_split, max_chunks_per_range, layout)
        for g in model.groups
    )
    table = PageTable("vmm", chunk_bytes, rows, model.name, epsilon, kv_split, layout)
    _check_budget(table, budget_bytes)
    return table


def _vmm_group_pages(
    group: KVGroup,
    chunk_bytes: int,
    epsilon: float,
    kv_split: bool,
    max_chunks: int | None,
    layout: str,
) -> GroupPages:
    spec = group.spec
    split = spec.num_kv_tensors if kv_split else 1
    layers_per_block = group.num_layers if layout == "per_group" else 1
    small = spec.page_bytes * layers_per_block // split
    k, within = chunks_for_page(small, chunk_bytes, epsilon=epsilon, max_chunks=max_chunks)
    blocks = k * chunk_bytes // small
    num_ranges = group.num_layers * split // layers_per_block
    return GroupPages(
        group=group.name,
        small_page_bytes=small,
        num_ranges=num_ranges,
        chunks_per_range=k,
        blocks_per_large_page=blocks,
        units_per_large_page=k * num_ranges,
        tail_bytes=k * chunk_bytes - blocks * small,
        kind=str(spec.kind),
        layers_per_small_page=layers_per_block,
        lcm_chunks_per_range=math.lcm(small, chunk_bytes) // chunk_bytes,
        within_epsilon=within,
    )


# ------------------------------------------------------------------------ static modes


def static_unit_bytes(small_pages: Sequence[int], strategy: str = "lcm") -> int:
    """The large page of a static buffer: lcm, max or gcd of the small pages.

    Paper example: ``static_unit_bytes([256, 384]) == 768``.
    """
    if strategy not in STATIC_STRATEGIES:
        raise SpecError(f"unknown static strategy {strategy!r}; choose from {STATIC_STRATEGIES}")
    if not small_pages:
        raise SpecError("static_unit_bytes needs at least one small page")
    for p in small_pages:
        _check_positive(small_page_bytes=p)
    if strategy == "lcm":
        return math.lcm(*small_pages)
    if strategy == "max":
        return max(small_pages)
    return math.gcd(*small_pages)


def static_page_table(
    model: ModelSpec,
    *,
    strategy: str = "lcm",
    budget_bytes: int | None = None,
    unit_bytes: int | None = None,
) -> PageTable:
    """One static buffer, page-layer partition (paper Fig. 7b).

    Small page of group g = one block of all of g's cache-storing layers. lcm: large
    page = lcm of the small pages, holding ``lcm / p_g`` of g's. max: every small page
    padded to the largest (tail = padding), or to ``unit_bytes`` when the buffer's slot
    is given (an engine's own padded block, e.g. vLLM's). gcd: a small page costs
    ``p_g / gcd`` units.
    """
    smalls = [g.spec.page_bytes * g.num_layers for g in model.groups]
    unit = static_unit_bytes(smalls, strategy)
    if unit_bytes is not None:
        if strategy != "max":
            raise SpecError(f"unit_bytes applies to the 'max' strategy only, not {strategy!r}")
        for g, small in zip(model.groups, smalls, strict=True):
            if small > unit_bytes:
                raise SpecError(
                    f"group {g.name!r}: one block of its {g.num_layers} layers is {small} B, "
                    f"more than the {unit_bytes} B slot"
                )
        unit = unit_bytes
    rows = tuple(
        _static_group_pages(g, small, unit, strategy)
        for g, small in zip(model.groups, smalls, strict=True)
    )
    mode = _STATIC_MODE_OF_STRATEGY[strategy]
    table = PageTable(mode, unit, rows, model.name, layout="page_layer")
    _check_budget(table, budget_bytes)
    return table


def _static_group_pages(group: KVGroup, small: int, unit: int, strategy: str) -> GroupPages:
    if strategy == "gcd":
        units, blocks, tail = small // unit, 1, 0
    elif strategy == "max":
        units, blocks, tail = 1, 1, unit - small
    else:
        units, blocks, tail = 1, unit // small, 0
    return GroupPages(
        group=group.name,
        small_page_bytes=small,
        num_ranges=1,
        chunks_per_range=units,
        blocks_per_large_page=blocks,
        units_per_large_page=units,
        tail_bytes=tail,
        kind=str(group.spec.kind),
        layers_per_small_page=group.num_layers,
    )


# ---------------------------------------------------------------------------- checks


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if value <= 0:
            raise SpecError(f"{name} must be > 0, got {value}")


def _check_budget(table: PageTable, budget_bytes: int | None) -> None:
    if budget_bytes is None:
        return
    _check_positive(budget_bytes=budget_bytes)
    for g in table.groups:
        need = g.units_per_large_page * table.unit_bytes
        if need > budget_bytes:
            raise SpecError(
                f"group {g.group!r}: one large page needs {g.units_per_large_page} units "
                f"of {table.unit_bytes} B = {need} B, budget is {budget_bytes} B"
            )


# --------------------------------------------------------------- uniform baseline


def tokens_needed(spec: LayerSpec, length: int) -> int:
    """Tokens of a `length`-token request an attention layer must still hold.

    The layer kind's policy decides (`jenga.policies.Policy.kept_tokens`): full: all
    (times token_fraction); sliding window: the last `window`; chunked local: the tokens
    of the current chunk. State and image kinds (Mamba, cross attention, vision) hold no
    per-text-token cache and raise SpecError.
    """
    if length < 0:
        raise SpecError(f"length must be >= 0, got {length}")
    policy = policy_for(spec)
    if policy.holds_state or policy.reads_images:
        raise SpecError(f"tokens_needed is defined for text attention kinds, not {spec.kind}")
    return policy.kept_tokens(length)


def uniform_paged_waste(model: ModelSpec, length: int) -> float:
    """Share of a uniform paged cache (every layer stores every token, PagedAttention)
    that a `length`-token request does not need. Gemma 2 at 8K: 21 of 42 layers keep
    4096 of 8192 tokens -> 25 %; Ministral at 128K: 27 of 36 keep 32K -> 56.25 %."""
    if length <= 0:
        raise SpecError(f"length must be > 0, got {length}")
    stored = sum(g.num_layers * g.spec.bytes_per_token * length for g in model.groups)
    needed = sum(
        g.num_layers * g.spec.bytes_per_token * tokens_needed(g.spec, length) for g in model.groups
    )
    return 1 - needed / stored
