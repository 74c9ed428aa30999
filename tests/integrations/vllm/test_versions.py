"""Supported vLLM versions: the start-up check, and the suite skipping on another one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from integrations.vllm.version import (
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVllmVersion,
    check_vllm_version,
    installed_vllm_version,
)

from tests.integrations.vllm.conftest import VLLM_MISSING

ROOT = Path(__file__).resolve().parents[3]


def test_both_releases_are_supported_and_others_are_named_in_the_error() -> None:
    assert SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0")
    assert check_vllm_version("0.33.0+cpu") == "0.33.0+cpu"
    with pytest.raises(
        UnsupportedVllmVersion, match=r"supports vLLM 0\.32\.0, 0\.33\.0; found 0\.31"
    ):
        check_vllm_version("0.31.2")


def _fake_vllm_dist(folder: Path, version: str) -> Path:
    """A folder whose only content is vLLM ``version``'s distribution metadata."""
    info = folder / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return folder


def test_the_suite_skips_each_module_with_the_reason_on_an_unsupported_vllm(
    tmp_path: Path,
) -> None:
    fake = _fake_vllm_dist(tmp_path / "site", "0.34.0")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]))
    target = "tests/integrations/vllm/test_scheduler.py"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", target]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert run.returncode in (0, 5), run.stdout + run.stderr  # 5: skipped whole, no items
    assert "1 skipped" in run.stdout, run.stdout
    assert "vLLM 0.34.0 is installed; the integration supports 0.32.0, 0.33.0" in run.stdout


def test_start_up_refuses_an_unsupported_vllm_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm = pytest.importorskip("vllm", reason=VLLM_MISSING)
    from integrations.vllm.harness import cases, replay

    from integrations.vllm import version

    model_dir = replay.write_tiny_model(tmp_path / "tiny-llama")
    assert installed_vllm_version() == vllm.__version__
    setup = replay.SchedulerSetup(max_model_len=256, max_num_batched_tokens=256)
    config = replay.make_vllm_config(model_dir, setup)
    kv_config = replay.kv_cache_config_for(config, cases.layer_specs("llama"), 16 << 20)
    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.34.0")
    with pytest.raises(UnsupportedVllmVersion, match=r"0\.32\.0, 0\.33\.0; found 0\.34\.0"):
        replay.make_scheduler(config, kv_config, jenga=True)
