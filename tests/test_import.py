import subprocess
import sys


def test_extension_builds_and_imports():
    from vmm import _core

    assert hasattr(_core, "host")
    assert hasattr(_core, "jenga")


def test_import_vmm_and_jenga_does_not_import_torch():
    code = "import sys, vmm, jenga; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
