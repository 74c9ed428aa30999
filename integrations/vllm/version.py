"""The vLLM versions this integration follows, and the check that names them.

Rationale
    The manager mirrors vLLM's scheduler-facing surface, which changes between releases
    (signatures, module moves); running on a release we have not followed fails in
    ways far from the cause. So start-up checks the version first and names ours.

Approach
    `check_vllm_version` reads ``vllm.__version__`` (or a given string) and raises
    `UnsupportedVllmVersion` unless its release (local ``+...`` suffix dropped) is in
    `SUPPORTED_VLLM_VERSIONS`; `installed_vllm_version` reads the installed
    distribution's metadata without importing vLLM (for test collection).

Limitations
    Exact releases only: a patch release is unsupported until it is added here, run
    through the suite and the conformance suite (`docs/vllm.md`).
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not one whose scheduler/manager surface we follow."""


def release(version: str) -> str:
    """``version`` without a local suffix (``0.33.0+cpu`` -> ``0.33.0``)."""
    return version.split("+", 1)[0]


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise `UnsupportedVllmVersion` naming ours."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    if release(version) not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmVersion(
            f"jenga-vmm's vLLM integration supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
            f"found {version}. Install one of them (`pip install vllm=={SUPPORTED_VLLM_VERSIONS[-1]}`)."
        )
    return version


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version, or None; never imports vLLM."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
