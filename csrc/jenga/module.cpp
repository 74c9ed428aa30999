#include "jenga/bindings.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "jenga private extension: two-level LCM allocator bookkeeping and block hashing";
  jvmm::register_jenga(m);
}
