#include "host/dlpack_view.hpp"

#include <algorithm>
#include <string>

namespace jvmm {
namespace {

struct ViewContext {
  DlManagedTensor managed;
  std::shared_ptr<Reservation> keep_alive;
  std::vector<int64_t> dims;  // shape, then strides
};

void delete_view(DlManagedTensor* self) { delete static_cast<ViewContext*>(self->manager_ctx); }

void destroy_unconsumed_capsule(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and then owns the tensor.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<DlManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    managed->deleter(managed);
  }
}

[[noreturn]] void throw_too_large(const std::string& what) {
  throw HostRangeError("view " + what + " overflows int64 (larger than any reservation)", "view",
                       0);
}

// Bytes spanned by the view, from its first to past its last element; throws on bad input and
// HostRangeError where the element count or the span does not fit int64 (even for an empty
// view: torch recomputes both), so no wrapped size reaches the bounds check or torch.
int64_t span_bytes(const int64_t* shape, const int64_t* strides, size_t ndim, int64_t itemsize) {
  int64_t last = 0;  // element index of the last element
  int64_t numel = 1;
  for (size_t i = 0; i < ndim; ++i) {
    if (shape[i] < 0) {
      throw HostArgError("view shape has a negative size " + std::to_string(shape[i]), "view", 0);
    }
    if (strides[i] < 0) {
      throw HostArgError("view stride " + std::to_string(strides[i]) + " is negative", "view", 0);
    }
    int64_t step = 0;
    if (__builtin_mul_overflow(numel, shape[i], &numel) ||
        (shape[i] > 0 && (__builtin_mul_overflow(shape[i] - 1, strides[i], &step) ||
                          __builtin_add_overflow(last, step, &last)))) {
      throw_too_large("dim " + std::to_string(i) + " (size " + std::to_string(shape[i]) +
                      ", stride " + std::to_string(strides[i]) + ")");
    }
  }
  if (numel == 0) return 0;
  int64_t span = 0;
  if (__builtin_add_overflow(last, int64_t{1}, &span) ||
      __builtin_mul_overflow(span, itemsize, &span)) {
    throw_too_large("of " + std::to_string(last) + "+1 items of " + std::to_string(itemsize) +
                    " bytes");
  }
  return span;
}

// Contiguous strides of `shape` (elements) into `st`; HostRangeError where one overflows int64.
void contiguous_strides(const int64_t* shape, int64_t* st, size_t ndim) {
  int64_t running = 1;
  bool overflowed = false;
  for (size_t i = ndim; i-- > 0;) {
    if (overflowed) throw_too_large("stride of dim " + std::to_string(i));
    st[i] = running;
    overflowed = __builtin_mul_overflow(running, shape[i], &running);
  }
}

// The item size of a view's dtype; HostArgError on a strides count that is not the dims
// count (none: contiguous) or a dtype without a positive item size.
int64_t view_itemsize(size_t ndim, size_t num_strides, int bits, int lanes) {
  if (num_strides != 0 && num_strides != ndim) {
    throw HostArgError("view got " + std::to_string(ndim) + " dims but " +
                           std::to_string(num_strides) + " strides",
                       "view", 0);
  }
  const int64_t itemsize = (static_cast<int64_t>(bits) * lanes + 7) / 8;
  if (bits <= 0 || lanes <= 0 || itemsize <= 0) {
    throw HostArgError("view dtype of " + std::to_string(bits) + " bits x " +
                           std::to_string(lanes) + " lanes has no positive item size",
                       "view", 0);
  }
  return itemsize;
}

// HostArgError (misaligned offset) or HostRangeError unless [offset, offset + span) lies
// within the reservation's `size` bytes.
void check_view_range(int64_t offset, int64_t span, int64_t itemsize, int64_t size) {
  int64_t end = 0;
  if (offset >= 0 && offset % itemsize == 0 && !__builtin_add_overflow(offset, span, &end) &&
      end <= size) {
    return;
  }
  const std::string what = "view of " + std::to_string(span) + " bytes at offset " +
                           std::to_string(offset) + " (item size " + std::to_string(itemsize) +
                           ") ";
  if (offset >= 0 && offset % itemsize != 0) throw HostArgError(what + "is misaligned", "view", 0);
  throw HostRangeError(what + "leaves the " + std::to_string(size) + "-byte range", "view", 0);
}

}  // namespace

ViewFactory ViewFactory::over_device(uint64_t va, size_t size, int32_t device_type,
                                     int32_t device_id) {
  if (va == 0 || size == 0 || va + size < va) {
    throw HostArgError("device view factory over " + std::to_string(size) + " bytes at " +
                           std::to_string(va) + ": not a non-empty range",
                       "view_factory", 0);
  }
  auto res = std::make_shared<Reservation>();
  res->va = va;
  res->size = size;
  res->host_mapped = false;
  return ViewFactory(std::move(res), device_type, device_id);
}

pybind11::capsule ViewFactory::capsule(int64_t offset, const std::vector<int64_t>& shape,
                                       const std::vector<int64_t>& strides, int code, int bits,
                                       int lanes) const {
  if (!res_->owned) {
    throw HostStateError("view of reservation at " + std::to_string(res_->va) +
                             " after it was freed (use after close)",
                         "closed", 0);
  }
  const size_t ndim = shape.size();
  const int64_t itemsize = view_itemsize(ndim, strides.size(), bits, lanes);
  auto* ctx = new ViewContext{};
  ctx->dims.assign(shape.begin(), shape.end());
  ctx->dims.resize(2 * ndim);
  int64_t* st = ctx->dims.data() + ndim;
  int64_t span = 0;
  try {
    if (strides.empty()) {
      contiguous_strides(ctx->dims.data(), st, ndim);
    } else {
      std::copy(strides.begin(), strides.end(), st);
    }
    span = span_bytes(ctx->dims.data(), st, ndim, itemsize);
  } catch (...) {
    delete ctx;
    throw;
  }
  try {
    check_view_range(offset, span, itemsize, static_cast<int64_t>(res_->size));
  } catch (...) {
    delete ctx;
    throw;
  }
  ctx->keep_alive = res_;
  DlTensor& t = ctx->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(res_->va + static_cast<uint64_t>(offset));
  t.device = device_;
  t.ndim = static_cast<int32_t>(ndim);
  t.dtype = DlDataType{static_cast<uint8_t>(code), static_cast<uint8_t>(bits),
                       static_cast<uint16_t>(lanes)};
  t.shape = ctx->dims.data();
  t.strides = st;
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = delete_view;
  PyObject* cap = PyCapsule_New(&ctx->managed, "dltensor", destroy_unconsumed_capsule);
  if (cap == nullptr) {
    delete ctx;
    throw pybind11::error_already_set();
  }
  return pybind11::reinterpret_steal<pybind11::capsule>(cap);
}

}  // namespace jvmm
