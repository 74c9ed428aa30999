#include "bindings.hpp"

namespace jvmm {

void register_jenga(pybind11::module_ m) { (void)m; }

}  // namespace jvmm
