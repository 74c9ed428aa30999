"""Backend selection: host always works here; auto says what it chose; cuda fails clearly."""

from __future__ import annotations

import logging

import pytest
from vmm.selection import cuda_unavailable_reason

import vmm


def test_host_by_name_with_options():
    backend = vmm.get_backend("host", granularity=256 << 10, capacity=1 << 24)
    assert (backend.name, backend.granularity, backend.device) == ("host", 256 << 10, "cpu")
    backend.close()


def test_auto_says_which_backend_it_chose(caplog):
    reason = cuda_unavailable_reason()
    with caplog.at_level(logging.INFO, logger="vmm"):
        backend = vmm.get_backend("auto")
    expected = "host" if reason else "cuda"
    assert backend.name == expected
    assert f"auto-selected the {expected} backend" in caplog.text
    if reason:
        assert reason in caplog.text
    backend.close()


def test_cuda_without_a_device_is_backend_unavailable():
    if cuda_unavailable_reason() is None:
        pytest.skip("a CUDA device is present")
    with pytest.raises(vmm.BackendUnavailable, match="cuda backend unavailable: "):
        vmm.get_backend("cuda")


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; expected one of"):
        vmm.get_backend("tpu")
