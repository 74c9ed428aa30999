"""vLLM's block slots over one VMM range: which chunks a slot touches (the "slots" geometry).

Rationale
    vLLM overlays every KV-cache group on one buffer, so memory moves between groups
    block by block, and for models whose groups all have the same block bytes that
    overlay wastes nothing. The per_group VMM geometry instead gives each group whole
    pages of many blocks, and a sliding-window group strands chunks that a few live
    blocks pin. The "slots" geometry keeps vLLM's overlay and its block slots (the
    allocator runs exactly as on vLLM's own tensors, `integrations.vllm.slots`) but puts
    the buffer on a VMM range: a 2 MiB chunk is mapped only while a mapped slot (held or
    cached) touches it, so a run commits what it uses, never more than vLLM's buffer.

Approach
    - `SlotChunks` reads where vLLM's `KVCacheTensor` s place slot ``s``: layer ``l`` of
      a tensor at ``offset + l*layer_stride + s*block_stride``, one (padded) page long.
      vLLM 0.32 / 0.33 list one tensor per group and layer shape, every tensor over the
      same backing allocation (groups alias from byte 0), so the slot's bytes are the
      union over the distinct (offset, stride, page) anchors. On the layer-outermost
      layouts (``LBHNC``, ``LBNHC``) a slot touches one or two chunks per layer region and
      a chunk holds ``chunk // page`` consecutive slots of every group.
    - `slot_cap`: the most slots (null slot 0 included) whose chunks together fit vLLM's
      bytes: ``chunks(slots 0 .. n-1) * chunk <= vLLM's buffer``. Mapping every slot
      therefore never commits more than vLLM allocates. Where vLLM's buffer is a whole
      number of chunks (the stand-ins at 128 MiB .. 1 GiB) the cap is vLLM's
      ``num_blocks``. Otherwise the buffer's last partial chunk cannot be mapped within
      vLLM's bytes; on vLLM's layer-outermost layouts (layer regions back to back from
      byte 0) dropping the slots whose last region's bytes reach into it frees it, so
      the cap loses at most ``ceil(chunk / page)`` slots (in general, with several
      tensors or offsets, fewer than ``regions * (chunk // page + 1)``). Measured with
      the real-scale shapes at 20 / 40 / 80 GiB: Gemma 2 9B 13 / 15 / 3 of 7,801 /
      15,603 / 31,207 slots, Ministral 8B 24 / 25 / 27 of 36,408 .., gpt-oss-20b 60 / 56 /
      60 of 54,613 .. (at most 0.11 %).
    - `ChunkRefs`: per chunk, how many layer runs of mapped slots touch it.
      `integrations.vllm.slots.SharedSlots` calls `ChunkRefs.change` whenever it maps or
      unmaps a slot (the same plan replay on the scheduler and the worker), so a chunk
      is mapped exactly while its count is positive; the null slot 0 holds its
      references for ever.

Limitations
    A config without tensors (vLLM's scheduler tests) is taken as block-outermost: slot
    ``s`` at ``[s*S, (s+1)*S)`` with ``S`` = vLLM's bytes per block.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from integrations.vllm.errors import JengaVllmError

if TYPE_CHECKING:
    from integrations.vllm.compat import KVCacheConfig


@dataclass(frozen=True)
class Anchor:
    """One layer of one `KVCacheTensor`: slot ``s`` at ``[offset + s*stride, + page)``."""

    offset: int
    stride: int
    page: int


class SlotChunks:
    """The chunks of vLLM's buffer each block slot touches.

    ``buffer_bytes``: vLLM's backing allocation; ``num_chunks``: the range's chunks
    (the buffer rounded up to a chunk).
    """

    def __init__(self, anchors: Iterable[Anchor], chunk_bytes: int, buffer_bytes: int) -> None:
        self.anchors = tuple(sorted(set(anchors), key=lambda a: (a.offset, a.stride, a.page)))
        if not self.anchors:
            raise JengaVllmError("the KV-cache config places no layer in its buffer")
        self.chunk_bytes = chunk_bytes
        self.buffer_bytes = buffer_bytes
        self.num_chunks = -(-buffer_bytes // chunk_bytes)

    @classmethod
    def from_config(cls, kv_cache_config: KVCacheConfig, chunk_bytes: int) -> SlotChunks:
        """vLLM's placement of every layer (`Anchor` per tensor and layer)."""
        from integrations.vllm.specs import kv_cache_memory_bytes

        memory = kv_cache_memory_bytes(kv_cache_config)
        num_blocks = max(1, int(kv_cache_config.num_blocks))
        anchors: list[Anchor] = []
        for t in kv_cache_config.kv_cache_tensors or ():
            page = _layer_page(kv_cache_config, t.layers[0], int(t.block_stride))
            offset = int(getattr(t, "offset", 0))
            for i in range(len(t.layers)):
                anchors.append(Anchor(offset + i * int(t.layer_stride), int(t.block_stride), page))
        if not anchors:
            slot = memory // num_blocks
            anchors.append(Anchor(0, slot, slot))
        return cls(anchors, chunk_bytes, memory)

    def runs(self, slot: int) -> list[range]:
        """Per layer run (`Anchor`), the chunk indices slot ``slot`` touches there (a
        chunk two runs touch is in both)."""
        c = self.chunk_bytes
        out = []
        for a in self.anchors:
            start = a.offset + slot * a.stride
            out.append(range(start // c, (start + a.page - 1) // c + 1))
        return out

    def chunks(self, slot: int) -> list[int]:
        """The chunk indices slot ``slot`` touches (sorted, distinct)."""
        return sorted({c for run in self.runs(slot) for c in run})

    def footprint(self, num_slots: int) -> int:
        """Chunks touched by slots ``0 .. num_slots - 1`` together."""
        if num_slots <= 0:
            return 0
        c = self.chunk_bytes
        spans: list[tuple[int, int]] = []  # inclusive chunk intervals
        for a in self.anchors:
            last = a.offset + (num_slots - 1) * a.stride + a.page - 1
            if a.stride - a.page < c:  # no gap between slots holds a whole chunk
                spans.append((a.offset // c, last // c))
            else:
                for s in range(num_slots):
                    start = a.offset + s * a.stride
                    spans.append((start // c, (start + a.page - 1) // c))
        spans.sort()
        total, end = 0, -1
        for lo, hi in spans:
            if hi > end:
                total += hi - max(lo, end + 1) + 1
                end = hi
        return total


def slot_cap(chunks: SlotChunks, num_blocks: int) -> int:
    """The most slots (slot 0 included, at most ``num_blocks``) whose chunks fit vLLM's
    bytes; raises `JengaVllmError` when not even the null slot and one more fit."""
    limit = chunks.buffer_bytes // chunks.chunk_bytes
    if num_blocks < 2 or chunks.footprint(2) > limit:
        raise JengaVllmError(
            f"the slots geometry needs 2 block slots within vLLM's {chunks.buffer_bytes} B "
            f"({limit} chunks of {chunks.chunk_bytes} B); slots 0 and 1 touch "
            f"{chunks.footprint(2)} chunks and vLLM has {num_blocks} block(s)"
        )
    lo, hi = 2, num_blocks  # footprint(lo) fits; find the largest that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunks.footprint(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _layer_page(kv_cache_config: KVCacheConfig, layer: str, stride: int) -> int:
    """Bytes one block of ``layer`` spans in the buffer: its group's (padded) page, at
    most the block stride when the stride is smaller (layer-interleaved layouts)."""
    for g in kv_cache_config.kv_cache_groups:
        if layer in g.layer_names:
            page = int(g.kv_cache_spec.page_size_bytes)
            return min(page, stride) if stride > 0 else page
    raise JengaVllmError(f"KV-cache tensor layer {layer!r} is in no KV-cache group")


class ChunkRefs:
    """Per chunk of the range, how many layer runs of mapped slots touch it (`SlotChunks`).

    ``num_mapped``: chunks with a positive count (what the range maps). When
    ``record`` is a list, every chunk that becomes mapped / unmapped is appended as
    ``(chunk, True / False)`` (the worker turns them into range ops). The null slot 0
    is referenced from the start.
    """

    def __init__(self, chunks: SlotChunks, record: list[tuple[int, bool]] | None = None) -> None:
        self.slot_chunks = chunks
        self.refs = array("i", bytes(4 * chunks.num_chunks))
        self.num_mapped = 0
        self.record = record
        self.change(0, 1)

    def change(self, slot: int, delta: int) -> None:
        """Slot ``slot`` was mapped (``delta`` 1) or unmapped (-1): every chunk each of
        its layer runs touches gains or loses one reference (a chunk two runs of one
        slot touch counts twice, so a count is positive exactly while a mapped slot
        touches the chunk; no per-call set, this runs on every slot the plans move)."""
        refs, record = self.refs, self.record
        for run in self.slot_chunks.runs(slot):
            for c in run:
                n = refs[c] = refs[c] + delta
                if n < 0:
                    raise AssertionError(f"chunk {c}: reference count {n} after slot {slot}")
                if n == (1 if delta > 0 else 0):  # 0 -> 1 or 1 -> 0
                    self.num_mapped += delta
                    if record is not None:
                        record.append((c, delta > 0))

    @property
    def committed_bytes(self) -> int:
        return self.num_mapped * self.slot_chunks.chunk_bytes

    def mapped_chunks(self) -> set[int]:
        return {c for c, n in enumerate(self.refs) if n > 0}

    def check(self, mapped_slots: Iterable[int]) -> None:
        """Raise AssertionError unless the counts are those of ``mapped_slots`` + slot 0."""
        want = array("i", bytes(4 * len(self.refs)))
        for slot in (0, *mapped_slots):
            for run in self.slot_chunks.runs(slot):
                for c in run:
                    want[c] += 1
        assert want == self.refs, "chunk reference counts disagree with the mapped slots"
        assert self.num_mapped == sum(1 for n in want if n > 0)
