#include "bindings.hpp"

namespace jvmm {

void register_host(pybind11::module_ m) { (void)m; }

}  // namespace jvmm
