#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "jenga-vmm private extension: host VMM backend and raw benchmark baselines";
  jvmm::register_host(m.def_submodule("host", "memfd + mmap virtual-memory backend"));
  jvmm::register_bench(m.def_submodule("bench", "raw syscall loops used as benchmark baselines"));
}
