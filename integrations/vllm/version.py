"""The vLLM versions this integration follows, and the check that names them.

Rationale
    The manager mirrors vLLM's scheduler-facing surface, which changes between releases
    (signatures, module moves); running on a release we have not followed fails in
    ways far from the cause. So start-up checks the version first and names ours.

Approach
    `check_vllm_version` reads the installed version from the package metadata (or
    takes a given string), so checking never imports vLLM (every import of vLLM lives
    in `integrations.vllm.compat`), and raises `UnsupportedVllmVersion` unless its
    release (local ``+...`` suffix dropped) is in `SUPPORTED_VLLM_VERSIONS`.

Limitations
    Exact releases only: a patch release is unsupported until it is added here and run
    through the suite and the conformance suite (`docs/vllm.md`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not one whose scheduler/manager surface we follow."""


def release(version: str) -> str:
    """``version`` without a local suffix (``0.33.0+cpu`` -> ``0.33.0``)."""
    return version.split("+", 1)[0]


def installed_vllm_version() -> str | None:
    """The installed vLLM's version string, or None when vLLM is not installed."""
    try:
        return _distribution_version("vllm")
    except PackageNotFoundError:
        return None


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise `UnsupportedVllmVersion` naming ours."""
    if version is None:
        version = installed_vllm_version()
    if version is None:
        raise UnsupportedVllmVersion(
            f"vLLM is not installed; jenga-vmm's vLLM integration supports vLLM "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}"
        )
    if release(version) not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmVersion(
            f"jenga-vmm's vLLM integration supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
            f"found {version}. Install one of them (jenga-vmm's 'vllm' extra)."
        )
    return version
