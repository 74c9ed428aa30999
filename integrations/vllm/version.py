"""The vLLM versions this integration targets, and the check that names them.

Reads the installed version from the package metadata, so checking never imports vLLM
(every import of vLLM lives in `integrations.vllm.compat`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not one whose scheduler/manager surface we follow."""


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
    base = version.split("+", 1)[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmVersion(
            f"jenga-vmm's vLLM integration supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
            f"found {version}. Install it with `pip install jenga-vmm[vllm]`."
        )
    return version
