"""
raw syscall loops used as benchmark baselines
"""

from __future__ import annotations

import collections.abc
import typing

__all__: list[str] = ["raw_host_cycle", "raw_host_map_rounds", "raw_view_capsule"]

def raw_host_cycle(
    chunk_size: typing.SupportsInt | typing.SupportsIndex,
    order: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
) -> dict[str, list[int]]:
    """
    ns per call of each syscall of one pool's life (see raw_host.hpp).
    """

def raw_host_map_rounds(
    chunk_size: typing.SupportsInt | typing.SupportsIndex,
    order: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
    rounds: typing.SupportsInt | typing.SupportsIndex,
) -> dict[str, list[int]]:
    """
    ns per map and unmap call, `rounds` passes over chunks set up once.
    """

def raw_view_capsule(
    addr: typing.SupportsInt | typing.SupportsIndex,
    nbytes: typing.SupportsInt | typing.SupportsIndex,
    cuda_device: typing.SupportsInt | typing.SupportsIndex = -1,
) -> typing.Any:
    """
    A bare uint8 'dltensor' capsule at addr (owns nothing).
    """
