"""vmm-bench: per-op latency of the vmm layer against a raw baseline (placeholder until built)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("vmm-bench is not built yet")
