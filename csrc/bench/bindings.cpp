#include "bindings.hpp"

namespace jvmm {

void register_bench(pybind11::module_ m) { (void)m; }

}  // namespace jvmm
