"""README's `VmmCache` example runs as written, with no deprecation warning on the
installed transformers (5.24 deprecates ``generate(past_key_values=...)``)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[3] / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if "VmmCache(" in b]
    assert len(found) == 1, f"README has {len(found)} python blocks using VmmCache"
    return found[0]


def test_readme_vmm_cache_example_runs_without_deprecation_warnings():
    scope: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(_example(), "README.md", "exec"), scope)
    deprecations = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, (DeprecationWarning, FutureWarning))
    ]
    assert deprecations == []
    out = scope["out"]
    assert out.shape == (1, 4 + 8)  # type: ignore[attr-defined]
    cache = scope["cache"]
    assert cache.store.length == 4 + 8 - 1  # type: ignore[attr-defined]
