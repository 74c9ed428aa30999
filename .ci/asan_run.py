"""Run pytest with `vmm._core` and `jenga._core` loaded from an ASan/UBSan build.

Usage: python .ci/asan_run.py BUILD_DIR [pytest args...]  (LD_PRELOAD=libasan.so set by
`.ci/test-asan`). The editable install's finder would load the regular modules; a finder
placed first on `sys.meta_path` hands out the sanitized ones from BUILD_DIR instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path


class _SanitizedCores(importlib.abc.MetaPathFinder):
    def __init__(self, build: Path) -> None:
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        self.paths = {f"{p}._core": build / p / f"_core{suffix}" for p in ("vmm", "jenga")}

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        where = self.paths.get(name)
        if where is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(name, str(where))
        return importlib.util.spec_from_file_location(name, where, loader=loader)


def main() -> int:
    build = Path(sys.argv[1]).resolve()
    finder = _SanitizedCores(build)
    missing = [str(p) for p in finder.paths.values() if not p.exists()]
    if missing:
        print(f"asan_run: not built: {missing}", file=sys.stderr)
        return 2
    sys.meta_path.insert(0, finder)
    import jenga._core
    import pytest
    import vmm._core

    print(f"asan_run: {vmm._core.__file__}, {jenga._core.__file__}")
    return int(pytest.main(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
