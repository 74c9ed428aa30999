import subprocess
import sys


def test_extensions_build_and_import():
    from jenga import _core as jenga_core
    from vmm import _core as vmm_core

    assert hasattr(vmm_core, "host")
    assert hasattr(vmm_core, "bench")
    assert not hasattr(vmm_core, "jenga")
    assert hasattr(jenga_core, "Core")


def test_jenga_imports_without_vmm():
    code = (
        "import sys, jenga, jenga.allocator, jenga.sim.cli; "
        "print(any(m.split('.')[0] in ('vmm', 'torch') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_vmm_and_jenga_does_not_import_torch():
    code = "import sys, vmm, jenga; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
