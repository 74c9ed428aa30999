// Registration hook of the private extension module `jenga._core` (the allocator core).
// Kept apart from `vmm._core` so that jenga (integers only) and vmm (memory) build and import
// independently; see docs/design-notes.md, "Two compiled modules".
#pragma once

#include <pybind11/pybind11.h>

namespace jvmm {

// jenga allocator core (free lists, request association, LRU, hash index): `jenga._core`.
void register_jenga(pybind11::module_ m);

}  // namespace jvmm
