"""Skip the HF cache and mini engine suites, with the reason, where transformers is missing
or older than the oldest release they support (`integrations.hf.compat.MIN_VERSION`), so
collection never fails on an import error (a GPU machine's own transformers may be old)."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

MIN_VERSION = (5, 16)  # as integrations.hf.compat, read without importing transformers


def unsupported_reason() -> str | None:
    try:
        found = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "transformers is not installed"
    numbers = tuple(int(n) for n in re.findall(r"\d+", found)[:2])
    if numbers < MIN_VERSION:
        low = ".".join(map(str, MIN_VERSION))
        return f"transformers {found} is older than {low}, the oldest supported release"
    return None


def skip_unless_supported() -> None:
    """Skip the importing test package's modules where transformers cannot run them."""
    reason = unsupported_reason()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
