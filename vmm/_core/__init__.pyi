"""
jenga-vmm private extension: host VMM backend and raw benchmark baselines
"""

from __future__ import annotations

from . import bench, host

__all__: list[str] = ["bench", "host"]
