// Raw syscall loops (see raw_host.hpp for the design note).
#include "bench/raw_host.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <stdexcept>
#include <system_error>

namespace jvmm::bench {
namespace {

constexpr size_t kReserveAlign = size_t{2} << 20;  // the host backend aligns to max(G, 2 MiB)

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// The memfd of one cycle; closed (pages freed) on scope exit.
class RawMemfd {
 public:
  RawMemfd(size_t capacity) {
    fd_ = static_cast<int>(memfd_create("jvmm-raw-bench", MFD_CLOEXEC));
    if (fd_ < 0) throw_errno("memfd_create");
    if (ftruncate(fd_, static_cast<off_t>(capacity)) != 0) {
      int err = errno;
      close(fd_);
      errno = err;
      throw_errno("ftruncate");
    }
  }
  ~RawMemfd() { close(fd_); }
  RawMemfd(const RawMemfd&) = delete;
  RawMemfd& operator=(const RawMemfd&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
};

// One aligned PROT_NONE reservation; munmap'ed on scope exit unless released.
class RawReservation {
 public:
  RawReservation(size_t size) : size_(size) {
    size_t align = size < kReserveAlign ? size : kReserveAlign;
    size_t padded = size + align;
    void* p = mmap(nullptr, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw_errno("mmap(reserve)");
    auto raw = reinterpret_cast<uintptr_t>(p);
    uintptr_t base = (raw + align - 1) / align * align;
    if (base > raw) munmap(p, base - raw);
    uintptr_t tail = raw + padded - (base + size);
    if (tail > 0) munmap(reinterpret_cast<void*>(base + size), tail);
    va_ = base;
  }
  ~RawReservation() {
    if (va_ != 0) munmap(reinterpret_cast<void*>(va_), size_);
  }
  RawReservation(const RawReservation&) = delete;
  RawReservation& operator=(const RawReservation&) = delete;
  uintptr_t va() const { return va_; }
  // munmap now (timed by the caller); the destructor then does nothing.
  void release() {
    if (munmap(reinterpret_cast<void*>(va_), size_) != 0) throw_errno("munmap(reservation)");
    va_ = 0;
  }

 private:
  uintptr_t va_ = 0;
  size_t size_;
};

void* slot_addr(uintptr_t va, size_t slot, size_t chunk_size) {
  return reinterpret_cast<void*>(va + slot * chunk_size);
}

int64_t timed_fallocate(int fd, int mode, int64_t chunk, size_t chunk_size, const char* what) {
  int64_t t0 = now_ns();
  int rc = fallocate(fd, mode, static_cast<off_t>(chunk * static_cast<int64_t>(chunk_size)),
                     static_cast<off_t>(chunk_size));
  int64_t t1 = now_ns();
  if (rc != 0) throw_errno(what);
  return t1 - t0;
}

int64_t timed_map(int fd, uintptr_t va, size_t slot, int64_t chunk, size_t chunk_size) {
  int64_t t0 = now_ns();
  void* p = mmap(slot_addr(va, slot, chunk_size), chunk_size, PROT_READ | PROT_WRITE,
                 MAP_FIXED | MAP_SHARED, fd, static_cast<off_t>(chunk * int64_t(chunk_size)));
  int64_t t1 = now_ns();
  if (p == MAP_FAILED) throw_errno("mmap(map)");
  return t1 - t0;
}

int64_t timed_unmap(uintptr_t va, size_t slot, size_t chunk_size) {
  int64_t t0 = now_ns();
  void* p = mmap(slot_addr(va, slot, chunk_size), chunk_size, PROT_NONE,
                 MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  int64_t t1 = now_ns();
  if (p == MAP_FAILED) throw_errno("mmap(unmap)");
  return t1 - t0;
}

// The chunk indices `order` names, ascending; throws if one repeats or is negative.
std::vector<int64_t> used_chunks(const std::vector<int64_t>& order) {
  std::vector<int64_t> used(order);
  std::sort(used.begin(), used.end());
  if (used.front() < 0) throw std::invalid_argument("order holds a negative chunk index");
  if (std::adjacent_find(used.begin(), used.end()) != used.end()) {
    throw std::invalid_argument("order names a chunk twice");
  }
  return used;
}

}  // namespace

OpTimes raw_host_cycle(size_t chunk_size, const std::vector<int64_t>& order) {
  if (chunk_size == 0 || order.empty()) throw std::invalid_argument("empty cycle");
  const std::vector<int64_t> used = used_chunks(order);
  const size_t n = order.size();
  OpTimes out;
  int64_t t0 = now_ns();
  RawMemfd memfd(static_cast<size_t>(used.back() + 1) * chunk_size);
  out["pool"].push_back(now_ns() - t0);
  for (int64_t h : used) {
    out["create"].push_back(timed_fallocate(memfd.fd(), 0, h, chunk_size, "fallocate"));
  }
  t0 = now_ns();
  RawReservation res(n * chunk_size);
  out["reserve"].push_back(now_ns() - t0);
  for (size_t i = 0; i < n; ++i) {
    out["map"].push_back(timed_map(memfd.fd(), res.va(), i, order[i], chunk_size));
  }
  for (size_t i = 0; i < n; ++i) out["unmap"].push_back(timed_unmap(res.va(), i, chunk_size));
  const int punch = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
  for (int64_t h : used) {
    out["release"].push_back(timed_fallocate(memfd.fd(), punch, h, chunk_size, "fallocate(punch)"));
  }
  t0 = now_ns();
  res.release();
  out["free_reservation"].push_back(now_ns() - t0);
  return out;
}

OpTimes raw_host_map_rounds(size_t chunk_size, const std::vector<int64_t>& order, size_t rounds) {
  if (chunk_size == 0 || order.empty()) throw std::invalid_argument("empty cycle");
  const std::vector<int64_t> used = used_chunks(order);
  const size_t n = order.size();
  RawMemfd memfd(static_cast<size_t>(used.back() + 1) * chunk_size);
  for (int64_t h : used) timed_fallocate(memfd.fd(), 0, h, chunk_size, "fallocate");
  RawReservation res(n * chunk_size);
  OpTimes out;
  out["map"].reserve(n * rounds);
  out["unmap"].reserve(n * rounds);
  for (size_t r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < n; ++i) {
      out["map"].push_back(timed_map(memfd.fd(), res.va(), i, order[i], chunk_size));
    }
    for (size_t i = 0; i < n; ++i) out["unmap"].push_back(timed_unmap(res.va(), i, chunk_size));
  }
  return out;
}

}  // namespace jvmm::bench
