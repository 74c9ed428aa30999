// Registration hooks of the private extension module `vmm._core` (jenga has its own,
// `jenga._core`). Each subsystem owns one submodule and one register function; module.cpp only
// wires them.
#pragma once

#include <pybind11/pybind11.h>

namespace jvmm {

// vmm host backend (memfd + mmap): `vmm._core.host`.
void register_host(pybind11::module_ m);

// raw baselines for vmm-bench (plain C loops of the same syscalls): `vmm._core.bench`.
void register_bench(pybind11::module_ m);

}  // namespace jvmm
