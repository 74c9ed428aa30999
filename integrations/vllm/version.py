"""The one vLLM version this integration targets, and the check that names it."""

from __future__ import annotations

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not one whose scheduler/manager surface we follow."""


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise `UnsupportedVllmVersion` naming ours."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    base = version.split("+", 1)[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmVersion(
            f"jenga-vmm's vLLM integration supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}; "
            f"found {version}. Install it with `pip install jenga-vmm[vllm]`."
        )
    return version
