// Raw DLPack capsule over an address (see raw_dlpack.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace jvmm::bench {

// A "dltensor" capsule of `nbytes` uint8 at `addr`: on the CPU when `cuda_device` < 0,
// else on that CUDA device. Nothing keeps the memory alive.
pybind11::object raw_view_capsule(uint64_t addr, int64_t nbytes, int32_t cuda_device);

}  // namespace jvmm::bench
