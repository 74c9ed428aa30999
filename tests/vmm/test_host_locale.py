"""The host backend's error messages do not depend on the process's global C++ locale.

Any library loaded into the interpreter may call `std::locale::global`; iostreams made
after that format numbers with its facets. On a GPU machine's Python (torch and a few
hundred other packages loaded by the test run) a refused address made the backend's
iostream-based hex formatting crash inside the locale's facets. Here a small shared
library installs a global locale that groups digits, as a user's locale may, and the
refusals must still name the address exactly (and not crash). Each case runs in its own
interpreter, since the global locale cannot be put back for the rest of the session.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LOCALE_SETTER = r"""
#include <locale>
#include <string>

namespace {
struct Grouping : std::numpunct<char> {
  char do_thousands_sep() const override { return ','; }
  std::string do_grouping() const override { return "\1"; }  // a separator after every digit
};
}  // namespace

extern "C" void install_grouping_locale() {
  std::locale::global(std::locale(std::locale::classic(), new Grouping));
}
"""

PROBE = """
import ctypes, sys
import vmm
from vmm.host import HostBackend

ctypes.CDLL(sys.argv[1]).install_grouping_locale()
G = 64 << 10
backend = HostBackend(granularity=G, capacity=8 * G)
va = backend.reserve(4 * G)
(h,) = backend.create(1)
for call in (
    lambda: backend.map([va + 8 * G], [h]),
    lambda: backend.unmap([va + 16 * G]),
    lambda: backend.free_reservation(va + 4 * G, G),
    lambda: backend.map([va + 4096], [h]),
):
    try:
        call()
    except vmm.VmmError as exc:
        print(exc)
print(hex(va))
backend.close()
"""


@pytest.fixture(scope="module")
def locale_setter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the locale-setting library")
    work = tmp_path_factory.mktemp("locale")
    src = work / "setter.cpp"
    src.write_text(LOCALE_SETTER)
    lib = work / "libsetter.so"
    subprocess.run([cxx, "-shared", "-fPIC", "-O1", str(src), "-o", str(lib)], check=True)
    return lib


def test_refusals_name_the_address_whatever_the_global_cpp_locale(locale_setter: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE), str(locale_setter)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"probe died with {proc.returncode}: {proc.stderr[-2000:]}"
    *messages, va_hex = proc.stdout.strip().splitlines()
    va, g = int(va_hex, 16), 64 << 10
    assert len(messages) == 4, proc.stdout
    expected = [va + 8 * g, va + 16 * g, va + 4 * g, va + 4096]
    for message, address in zip(messages, expected, strict=True):
        assert f"{address:#x}" in message, message
        assert "," not in message.split("address")[-1], message
