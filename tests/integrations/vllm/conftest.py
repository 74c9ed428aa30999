"""Fixtures for tests that drive vLLM's real Scheduler (skipped without vLLM or on an
unsupported version, with the reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

VLLM_MISSING = (
    "vLLM is not importable in this interpreter; `make test-vllm VLLM=0.32.0|0.33.0` installs it "
    "with tools/vllm-venv.sh and runs tests/integrations/vllm there"
)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from integrations.vllm.harness.replay import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def unsupported_vllm_reason() -> str | None:
    """Why this suite cannot run on the installed vLLM (None: supported or not installed)."""
    from integrations.vllm.version import (
        SUPPORTED_VLLM_VERSIONS,
        installed_vllm_version,
        release,
    )

    version = installed_vllm_version()
    if version is None or release(version) in SUPPORTED_VLLM_VERSIONS:
        return None
    return (
        f"vLLM {version} is installed; the integration supports "
        f"{', '.join(SUPPORTED_VLLM_VERSIONS)} (`make test-vllm VLLM=0.32.0|0.33.0`)"
    )


class _UnsupportedVllmModule(pytest.Module):
    """A test module skipped whole, before its imports run, with the version reason."""

    def collect(self) -> list[pytest.Item]:
        pytest.skip(unsupported_vllm_reason() or "", allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> object:
    if unsupported_vllm_reason() is None:
        return None
    return _UnsupportedVllmModule.from_parent(parent, path=module_path)
