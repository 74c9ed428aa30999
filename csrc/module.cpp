#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "jenga-vmm private extension: host VMM backend and jenga allocator core";
  jvmm::register_host(m.def_submodule("host", "memfd + mmap virtual-memory backend"));
  jvmm::register_bench(m.def_submodule("bench", "raw syscall loops used as benchmark baselines"));
  jvmm::register_jenga(m.def_submodule("jenga", "two-level LCM allocator bookkeeping"));
}
