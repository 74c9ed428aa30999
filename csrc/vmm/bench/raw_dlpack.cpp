// Raw tensor-view baseline: the smallest DLPack capsule over an address, with no owner.
//
// Rationale: the vmm tensor view builds a DLPack capsule in C++ and hands it to
// torch.from_dlpack; the floor for that path is a capsule with nothing behind it but one
// heap block for shape/strides. vmm-bench times `torch.from_dlpack(raw_view_capsule(...))`
// against the vmm view of the same bytes.
// Limitations: the capsule does not keep the memory alive; callers own the lifetime.
#include "bench/raw_dlpack.hpp"

#include <pybind11/pybind11.h>

#include <cstdint>

namespace jvmm::bench {
namespace {

// DLPack v0.x ABI (the "dltensor" capsule protocol), written from the published spec.
struct RawDlDevice {
  int32_t device_type;
  int32_t device_id;
};
struct RawDlDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct RawDlTensor {
  void* data;
  RawDlDevice device;
  int32_t ndim;
  RawDlDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct RawDlManagedTensor {
  RawDlTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(RawDlManagedTensor*);
};

// One allocation holds the managed tensor and its 1-element shape.
struct RawView {
  RawDlManagedTensor managed;
  int64_t shape[1];
};

void delete_raw_view(RawDlManagedTensor* self) { delete reinterpret_cast<RawView*>(self); }

void capsule_destructor(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and calls the deleter itself.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<RawDlManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    m->deleter(m);
  }
}

constexpr int32_t kDlCpu = 1;
constexpr int32_t kDlCuda = 2;
constexpr uint8_t kDlUInt = 1;

}  // namespace

pybind11::object raw_view_capsule(uint64_t addr, int64_t nbytes, int32_t cuda_device) {
  auto* view = new RawView{};
  view->shape[0] = nbytes;
  RawDlTensor& t = view->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(addr);
  t.device = cuda_device < 0 ? RawDlDevice{kDlCpu, 0} : RawDlDevice{kDlCuda, cuda_device};
  t.ndim = 1;
  t.dtype = RawDlDataType{kDlUInt, 8, 1};
  t.shape = view->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  view->managed.manager_ctx = nullptr;
  view->managed.deleter = delete_raw_view;
  PyObject* cap = PyCapsule_New(&view->managed, "dltensor", capsule_destructor);
  if (cap == nullptr) {
    delete view;
    throw pybind11::error_already_set();
  }
  return pybind11::reinterpret_steal<pybind11::object>(cap);
}

}  // namespace jvmm::bench
