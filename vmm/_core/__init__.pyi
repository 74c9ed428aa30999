"""
jenga-vmm private extension: host VMM backend and jenga allocator core
"""

from __future__ import annotations

from . import bench, host, jenga

__all__: list[str] = ["bench", "host", "jenga"]
