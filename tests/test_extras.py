"""Optional dependencies: without torch the core works and torch-needing modules name the
extra to install (a subprocess with torch blocked, as in an install without extras)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from vmm.extras import MissingExtra, require

# Blocks torch (and transformers, which imports it) as if neither were installed.
NO_TORCH = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


class _HideTopLevel:
    """A meta-path finder before the others: importing `name` fails as if absent."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == self.name:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MissingExtra, match=r"a feature needs no_such_module_x.*'hf' extra"):
        require("no_such_module_x", "a feature", extra="hf")
    # cuda-bindings may be installed (GPU machines, the emulator job): hide it from the
    # import system as an absent distribution looks.
    for name in [m for m in sys.modules if m == "cuda" or m.startswith("cuda.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_HideTopLevel("cuda"), *sys.meta_path])
    with pytest.raises(MissingExtra, match=r"needs cuda-bindings.*pip install '\.\[cuda\]'"):
        require("cuda.no_such_submodule_x", "the CUDA backend")
    assert require("json", "anything") is sys.modules["json"]


def test_a_missing_module_inside_an_installed_package_is_not_renamed() -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        require("email.no_such_submodule_x", "a feature")
    assert not isinstance(info.value, MissingExtra)


def test_core_imports_and_runs_without_torch() -> None:
    proc = _run(
        """
        import vmm, jenga, jenga.sim, integrations.kvcache
        pool = vmm.ChunkPool(vmm.get_backend("auto"), budget_bytes=8 << 20)
        rng = pool.reserve(4 << 20)
        vmm.MappingPlan().map(rng, [0]).apply()
        print("mapped", pool.stats()["bytes.mapped.current"])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["mapped", str(2 << 20)]


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("import integrations.hf", "integrations.hf (the transformers KV cache) needs torch"),
        ("import integrations.engine", "integrations.engine (the mini engine) needs torch"),
        (
            "import vmm; p = vmm.ChunkPool(vmm.get_backend('host'), 1 << 22);"
            " r = p.reserve(2 << 20); r.tensor((4,), 'float16')",
            "a tensor view (vmm.tensor) needs torch",
        ),
    ],
)
def test_torch_needing_modules_name_the_extra(statement: str, expected: str) -> None:
    proc = _run(
        f"""
        from vmm.extras import MissingExtra
        try:
            {statement}
        except MissingExtra as exc:
            print(exc)
        else:
            print("no error")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout, proc.stdout
    assert "extra" in proc.stdout and "pip install '.[" in proc.stdout, proc.stdout


def test_every_extra_named_in_a_message_exists_and_the_core_needs_no_torch() -> None:
    import tomllib
    from pathlib import Path

    from vmm.extras import EXTRAS

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {extra for _, extra in EXTRAS.values()} <= set(extras)
    assert not any(dep.startswith("torch") for dep in project["dependencies"])
    for extra in ("torch", "hf", "cuda", "flash", "dev"):
        assert any(dep.startswith("torch>=") for dep in extras[extra]), extra


def test_vmm_bench_without_torch_skips_the_tensor_views_naming_the_extra() -> None:
    proc = _run(
        """
        from vmm.bench.cli import main
        raise SystemExit(main(["--backend", "host", "--chunk-sizes", "64K", "--counts", "4",
                               "--rounds", "1", "--map-rounds", "1", "--create-count", "2",
                               "--views", "5", "--no-progress"]))
        """
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "not measured tensor_view: timing tensor views needs torch" in text, text
    assert "pip install '.[torch]'" in text, text


def test_the_vllm_integration_without_vllm_names_its_extra() -> None:
    proc = _run(
        """
        import sys
        sys.modules["vllm"] = None
        import integrations.vllm  # the version check only: no vLLM needed
        from vmm.extras import MissingExtra
        try:
            import integrations.vllm.scheduler
        except MissingExtra as exc:
            print(exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "integrations.vllm (the vLLM scheduler and plugin) needs vllm" in proc.stdout
    assert "'vllm' extra" in proc.stdout
