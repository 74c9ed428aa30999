// Zero-copy DLPack capsules over a host reservation.
//
// The capsule's DLManagedTensor owns a shared_ptr to the Reservation, so a torch tensor made
// from it keeps the address range reserved until the tensor dies; the deleter is plain C++
// (torch may run it on any thread, without the GIL), it never calls into Python.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "host/host_vmm.hpp"

namespace jvmm {

// ABI of DLPack's unversioned DLManagedTensor (dlpack.h v0.8 / 1.x "dltensor" capsules).
struct DlDevice {
  int32_t device_type;  // 1 = CPU, 2 = CUDA
  int32_t device_id;
};
struct DlDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool
  uint8_t bits;
  uint16_t lanes;
};
struct DlTensor {
  void* data;
  DlDevice device;
  int32_t ndim;
  DlDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DlManagedTensor {
  DlTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DlManagedTensor* self);
};

// Builds capsules over one reservation; holds it alive like the views it makes.
class ViewFactory {
 public:
  ViewFactory(std::shared_ptr<Reservation> res, int32_t device_type, int32_t device_id)
      : res_(std::move(res)), device_{device_type, device_id} {}
  // A "dltensor" capsule of `shape`/`strides` (elements; empty strides = contiguous) at byte
  // `offset` into the reservation. Throws HostRangeError if the span leaves it.
  pybind11::capsule capsule(int64_t offset, const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& strides, int code, int bits,
                            int lanes) const;
  // A factory over device memory (e.g. a CUDA reservation): views carry `device_type` /
  // `device_id` and keep no mapping alive (the owner frees the range; `retire` first).
  static ViewFactory over_device(uint64_t va, size_t size, int32_t device_type, int32_t device_id);
  // Later capsules raise HostStateError (the range was freed).
  void retire() const { res_->owned = false; }
  uint64_t va() const { return res_->va; }
  uint64_t size() const { return res_->size; }
  long holders() const { return res_.use_count(); }

 private:
  std::shared_ptr<Reservation> res_;
  DlDevice device_;
};

}  // namespace jvmm
