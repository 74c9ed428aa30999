"""Test-wide setup: `cuda`-marked tests skip themselves without a GPU and cuda-python."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        if importlib.util.find_spec("cuda.bindings") is None:
            return "cuda-python is not installed"
    except ModuleNotFoundError:
        return "cuda-python is not installed"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    reason = _cuda_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"cuda test: {reason}")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
