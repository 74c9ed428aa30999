"""
two-level LCM allocator bookkeeping
"""

from __future__ import annotations

__all__: list[str] = list()
