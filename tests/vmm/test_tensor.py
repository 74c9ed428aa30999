"""Zero-copy tensors and data integrity across map / unmap / remap / share, on every backend."""

from __future__ import annotations

import gc

import pytest
import torch

import vmm
from tests.vmm.vmm_helpers import check, data_view, kernel_vmas


def slot_view(rng: vmm.VirtualRange, slot: int, *, write: bool = False) -> torch.Tensor:
    n = rng.granularity // 4
    return data_view(rng, (n,), torch.int32, offset=slot * rng.granularity, write=write)


def pattern(seed: int, n: int, device: str) -> torch.Tensor:
    return torch.arange(seed * n, (seed + 1) * n, dtype=torch.int32, device=device)


@pytest.mark.gpu
def test_view_is_zero_copy_with_any_dtype_shape_offset(make_pool):
    pool = make_pool(4)
    rng = pool.reserve(4 * pool.granularity)
    rng.map([0, 1])
    t = rng.tensor((2, 8, 16), torch.float16, offset=256)
    assert t.data_ptr() == rng.va + 256
    assert (t.shape, t.dtype, t.is_contiguous()) == ((2, 8, 16), torch.float16, True)
    t.fill_(1.5)
    raw = rng.tensor((2 * 8 * 16 * 2,), torch.uint8, offset=256)
    assert raw.data_ptr() == t.data_ptr()
    assert (
        bytes(raw[:2].cpu().tolist())
        == torch.tensor([1.5], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    )
    strided = rng.tensor((4, 3), torch.int64, offset=64, strides=(5, 1))
    assert strided.stride() == (5, 1) and strided.data_ptr() == rng.va + 64
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.bool, torch.float8_e4m3fn):
        v = rng.tensor((16,), dtype, offset=pool.granularity)
        assert (v.dtype, v.data_ptr()) == (dtype, rng.va + pool.granularity)
    assert rng.tensor((0,), torch.float32).numel() == 0


@pytest.mark.gpu
def test_view_dtype_by_name(make_pool):
    pool = make_pool(1)
    rng = pool.reserve(pool.granularity)
    rng.map([0])
    by_name = rng.tensor((4,), "bfloat16")
    assert by_name.dtype == torch.bfloat16
    assert rng.tensor((4,), "torch.float16").dtype == torch.float16
    with pytest.raises(TypeError, match="unknown dtype name 'float17'"):
        rng.tensor((4,), "float17")


def test_views_past_the_range_or_misaligned_are_refused(make_pool):
    pool = make_pool(2)
    gran = pool.granularity
    rng = pool.reserve(2 * gran)
    with pytest.raises(vmm.RangeError, match=rf"view of 8 bytes at offset {2 * gran - 4} "):
        rng.tensor((2,), torch.float32, offset=2 * gran - 4)
    with pytest.raises(vmm.RangeError, match=rf"leaves the {2 * gran}-byte range"):
        rng.tensor((gran + 1,), torch.int16)
    with pytest.raises(vmm.RangeError):
        rng.tensor((2, 2), torch.int32, offset=2 * gran - 16, strides=(3, 1))
    with pytest.raises(vmm.AlignmentError, match=r"misaligned|not a multiple"):
        rng.tensor((2,), torch.float32, offset=2)
    rng.close()
    with pytest.raises(vmm.ClosedError):
        rng.tensor((2,), torch.float32)


def test_patterns_survive_changes_to_other_slots(make_pool):
    pool = make_pool(8)
    a = pool.reserve(8 * pool.granularity, name="a")
    b = pool.reserve(8 * pool.granularity, name="b")
    a.map([0, 1, 2, 3])
    n = pool.granularity // 4
    for slot in range(4):
        view = slot_view(a, slot, write=True)
        view.copy_(pattern(slot, n, view.device))
    a.unmap([1])
    b.remap_from(a, [3], [6])
    a.map([5])
    b.map([0, 1])
    for slot in (0, 2):
        view = slot_view(a, slot)
        assert torch.equal(view, pattern(slot, n, view.device))
    view = slot_view(b, 6)
    assert torch.equal(view, pattern(3, n, view.device))  # nothing lost in remap
    check(pool)


def test_sharing_shows_writes_both_ways(make_pool):
    pool = make_pool(4)
    a = pool.reserve(4 * pool.granularity, name="a")
    b = pool.reserve(4 * pool.granularity, name="b")
    a.map([2])
    b.share_from(a, [2], [0])
    va, vb = slot_view(a, 2, write=True), slot_view(b, 0, write=True)
    va[:3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    assert vb[:3].tolist() == [7, 8, 9]
    vb[-1] = 42
    assert int(va[-1]) == 42
    check(pool)


def test_zero_backed_range_reads_zeros_until_mapped(make_pool):
    pool = make_pool(4)
    rng = pool.reserve(4 * pool.granularity, zero_backed=True)
    assert int(slot_view(rng, 3).abs().sum()) == 0
    rng.map([3])
    slot_view(rng, 3, write=True).fill_(5)
    rng.unmap([3])
    assert int(slot_view(rng, 3).abs().sum()) == 0  # back on the zero chunk
    assert int(slot_view(rng, 0).abs().sum()) == 0


def test_tensor_keeps_the_reservation_until_it_dies(host_pool):
    rng = host_pool.reserve(4 * host_pool.granularity)
    va, size = rng.va, rng.size
    rng.map([0])
    assert rng.num_views == 0
    t = rng.tensor((8,), torch.int32)
    u = rng.tensor((2, 2), torch.int64, offset=64)
    assert rng.num_views == 2
    del u
    assert rng.num_views == 1
    t.fill_(3)
    rng.close()
    assert rng.num_views is None
    assert kernel_vmas(va, size) == 1  # still reserved (PROT_NONE): no other mmap lands here
    del t
    gc.collect()
    assert kernel_vmas(va, size) == 0


def test_released_chunks_read_back_as_zeros_and_free_memory(host_pool):
    pool = host_pool
    gran = pool.granularity
    rng = pool.reserve(4 * gran)
    rng.map([0, 1])
    slot_view(rng, 1, write=True).fill_(-1)
    assert pool.backend.physical_bytes() == 2 * gran
    rng.unmap([0, 1])
    assert pool.backend.physical_bytes() == 2 * gran  # unmapping alone frees nothing
    pool.set_budget(0)
    assert pool.backend.physical_bytes() == 0  # PUNCH_HOLE gave the pages back
    pool.set_budget(4 * gran)
    assert rng.map([1, 0]) == [0, 1]  # the same memfd offsets, created afresh
    assert int(slot_view(rng, 0).abs().sum()) == 0
    check(pool)
