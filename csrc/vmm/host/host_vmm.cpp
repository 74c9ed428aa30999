#include "host/host_vmm.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace jvmm {
namespace {

constexpr size_t kTwoMiB = size_t{2} << 20;
constexpr size_t kMaxReserve = size_t{1} << 47;  // x86-64 / arm64 user space with 4-level pages
constexpr int kAnonFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

std::string os_message(const char* op, int err, const std::string& what) {
  return std::string(op) + " failed (" + std::strerror(err) + ", errno " + std::to_string(err) +
         "): " + what;
}

std::atomic<int64_t> g_process_vmas{0};
std::atomic<int64_t> g_process_vma_budget{0};

}  // namespace

int64_t process_vmas() { return g_process_vmas.load(); }
int64_t process_vma_budget() { return g_process_vma_budget.load(); }
void set_process_vma_budget(int64_t budget) { g_process_vma_budget.store(budget); }

void HostVmm::add_vmas(int64_t delta) {
  vmas_total_ += delta;
  g_process_vmas.fetch_add(delta);
}

std::string HostVmm::vma_refusal(int64_t extra) const {
  if (vmas_total_ + extra > vma_budget_) {
    return std::to_string(vmas_total_) + " of budget " + std::to_string(vma_budget_) + " in use";
  }
  const int64_t budget = g_process_vma_budget.load();
  const int64_t used = g_process_vmas.load();
  if (budget > 0 && used + extra > budget) {
    return std::to_string(used) + " of the process-wide budget " + std::to_string(budget) +
           " in use by every host pool";
  }
  return "";
}

Reservation::~Reservation() {
  if (va != 0 && host_mapped) munmap(reinterpret_cast<void*>(va), size);
}

int Reservation::boundary_cost(size_t i) const {
  if (state[i] != state[i - 1]) return 1;
  if (state[i] != SlotState::kMapped) return 0;
  return handle[i] == handle[i - 1] + 1 ? 0 : 1;
}

HostVmm::HostVmm(size_t granularity, size_t capacity, int64_t vma_budget, bool collapse,
                 int import_fd)
    : gran_(granularity), capacity_(capacity), vma_budget_(vma_budget), collapse_(collapse) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (gran_ < page || (gran_ & (gran_ - 1)) != 0) {
    throw HostArgError("granularity " + std::to_string(gran_) +
                           " must be a power of two >= the page size " + std::to_string(page),
                       "init", 0);
  }
  if (import_fd >= 0) {
    open_imported(import_fd);
    return;
  }
  if (capacity_ == 0 || capacity_ % gran_ != 0) {
    throw HostArgError("capacity " + std::to_string(capacity_) +
                           " must be a positive multiple of the granularity " +
                           std::to_string(gran_),
                       "init", 0);
  }
  if (vma_budget_ < 1) {
    throw HostArgError("vma_budget " + std::to_string(vma_budget_) + " must be >= 1", "init", 0);
  }
  fd_ = static_cast<int>(memfd_create("jenga-vmm", MFD_CLOEXEC));
  if (fd_ < 0) throw HostOsError(os_message("memfd_create", errno, "pool memfd"), "init", errno);
  if (ftruncate(fd_, static_cast<off_t>(capacity_)) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw HostOsError(os_message("ftruncate", err, std::to_string(capacity_) + " bytes"), "init",
                      err);
  }
}

void HostVmm::open_imported(int import_fd) {
  struct stat st;
  if (fstat(import_fd, &st) != 0) {
    throw HostOsError(os_message("fstat", errno, "imported fd " + std::to_string(import_fd)),
                      "init", errno);
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size == 0 || size % gran_ != 0) {
    throw HostArgError("imported memfd of " + std::to_string(size) +
                           " bytes is not a positive multiple of the granularity " +
                           std::to_string(gran_),
                       "init", 0);
  }
  fd_ = fcntl(import_fd, F_DUPFD_CLOEXEC, 0);
  if (fd_ < 0) throw HostOsError(os_message("fcntl(F_DUPFD)", errno, "imported fd"), "init", errno);
  capacity_ = size;
  imported_ = true;
}

HostVmm::~HostVmm() { close(); }

int HostVmm::fd() const {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("fd");
  return fd_;
}

void HostVmm::import_handles(const std::vector<int64_t>& handles) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("import_handles");
  if (!imported_) {
    throw HostStateError("import_handles on a backend that owns its memfd", "import", 0);
  }
  const auto limit = static_cast<int64_t>(capacity_ / gran_);
  std::vector<int64_t> sorted(handles);
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int64_t h = sorted[i];
    if (h < 0 || h >= limit) {
      throw HostArgError("import of chunk " + std::to_string(h) + " outside the memfd's " +
                             std::to_string(limit) + " chunks",
                         "import", 0);
    }
    if ((i > 0 && sorted[i - 1] == h) || (h < high_water_ && map_count_[h] >= 0)) {
      throw HostStateError("import of chunk " + std::to_string(h) + " already held", "import", 0);
    }
  }
  for (const int64_t h : sorted) {
    if (h >= high_water_) {
      if (map_count_.size() <= static_cast<size_t>(h)) map_count_.resize(h * 2 + 64, -1);
      for (int64_t i = high_water_; i < h; ++i) free_below_.insert(i);
      high_water_ = h + 1;
    } else {
      free_below_.erase(h);
    }
    map_count_[h] = 0;
  }
  num_chunks_ += static_cast<int64_t>(sorted.size());
}

bool HostVmm::fault_now() {
  ++syscalls_;
  if (fail_in_ > 0 && --fail_in_ == 0) {
    errno = fail_errno_;
    if (--fail_left_ > 0) fail_in_ = 1;  // the next syscall fails too
    return true;
  }
  return false;
}

void HostVmm::inject_fault(int64_t k, int err, int64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_in_ = k;
  fail_left_ = count;
  fail_errno_ = err;
}

void HostVmm::check_open(const char* op) const {
  if (fd_ < 0) throw HostStateError(std::string(op) + " on a closed host backend", "closed", 0);
}

uint64_t HostVmm::syscalls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return syscalls_;
}

int64_t HostVmm::vmas() const {
  std::lock_guard<std::mutex> lock(mu_);
  return vmas_total_;
}

int64_t HostVmm::chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_chunks_;
}

bool HostVmm::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fd_ < 0;
}

int64_t HostVmm::physical_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) return 0;
  struct stat st;
  if (fstat(fd_, &st) != 0) return -1;
  return static_cast<int64_t>(st.st_blocks) * 512;
}

// ---- physical chunks ------------------------------------------------------------------

int64_t HostVmm::take_index() {
  if (!free_below_.empty()) {
    const int64_t h = *free_below_.begin();
    free_below_.erase(free_below_.begin());
    return h;
  }
  if (static_cast<size_t>(high_water_ + 1) * gran_ > capacity_) return -1;
  if (map_count_.size() <= static_cast<size_t>(high_water_)) {
    map_count_.resize(static_cast<size_t>(high_water_) * 2 + 64, -1);
  }
  return high_water_++;
}

void HostVmm::give_index(int64_t h) {
  map_count_[h] = -1;
  if (h != high_water_ - 1) {
    free_below_.insert(h);
    return;
  }
  --high_water_;
  while (!free_below_.empty() && *free_below_.rbegin() == high_water_ - 1) {
    free_below_.erase(std::prev(free_below_.end()));
    --high_water_;
  }
}

std::vector<int64_t> HostVmm::create(size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("create");
  if (imported_) {
    throw HostStateError("create on a backend over an imported memfd (chunks come from import)",
                         "create", 0);
  }
  if (count == 0) throw HostArgError("create needs count >= 1, got 0", "create", 0);
  const size_t limit = capacity_ / gran_;
  if (count > limit) {  // before any table or allocation: the memfd could never hold them
    throw HostOsError("create needs " + std::to_string(count) + " chunks, memfd has " +
                          std::to_string(limit - static_cast<size_t>(num_chunks_)) + " free of " +
                          std::to_string(limit),
                      "create", ENOSPC);
  }
  std::vector<int64_t> hs;
  hs.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const int64_t h = take_index();
    if (h < 0) {
      for (auto it = hs.rbegin(); it != hs.rend(); ++it) give_index(*it);
      throw HostOsError("create needs " + std::to_string(count) + " chunks, memfd has " +
                            std::to_string(i) + " free of " + std::to_string(capacity_ / gran_),
                        "create", ENOSPC);
    }
    map_count_[h] = 0;
    hs.push_back(h);
  }
  std::vector<int64_t> sorted(hs);
  std::sort(sorted.begin(), sorted.end());
  size_t done = 0;  // chunks of `sorted` populated so far
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i + 1;
    while (j < sorted.size() && sorted[j] == sorted[j - 1] + 1) ++j;
    const off_t off = static_cast<off_t>(sorted[i] * static_cast<int64_t>(gran_));
    const off_t len = static_cast<off_t>((j - i) * gran_);
    if (fault_now() || fallocate(fd_, 0, off, len) != 0) {
      const int err = errno;
      for (size_t k = 0; k < done; ++k) {
        fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  static_cast<off_t>(sorted[k] * static_cast<int64_t>(gran_)),
                  static_cast<off_t>(gran_));
      }
      for (auto it = hs.rbegin(); it != hs.rend(); ++it) give_index(*it);
      throw HostOsError(
          os_message("fallocate", err, "populating " + std::to_string(count) + " chunks"), "create",
          err);
    }
    done = j;
    i = j;
  }
  num_chunks_ += static_cast<int64_t>(count);
  return hs;
}

void HostVmm::release(const std::vector<int64_t>& handles) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("release");
  std::vector<int64_t> sorted(handles);
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int64_t h = sorted[i];
    if (h < 0 || h >= high_water_ || map_count_[h] < 0) {
      throw HostArgError("release of unknown handle " + std::to_string(h), "release", 0);
    }
    if (i > 0 && sorted[i - 1] == h) {
      throw HostArgError("release lists handle " + std::to_string(h) + " twice", "release", 0);
    }
    if (map_count_[h] > 0) {
      throw HostStateError("release of handle " + std::to_string(h) + " still mapped at " +
                               std::to_string(map_count_[h]) + " slots",
                           "release", 0);
    }
  }
  for (size_t i = 0; i < sorted.size() && !imported_;) {  // imported: the exporter punches
    size_t j = i + 1;
    while (j < sorted.size() && sorted[j] == sorted[j - 1] + 1) ++j;
    const off_t off = static_cast<off_t>(sorted[i] * static_cast<int64_t>(gran_));
    const off_t len = static_cast<off_t>((j - i) * gran_);
    if (fault_now() || fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, len) != 0) {
      const int err = errno;
      // Chunks punched so far read back as zeros; repopulate them so they stay created.
      for (size_t k = 0; k < i; ++k) {
        fallocate(fd_, 0, static_cast<off_t>(sorted[k] * static_cast<int64_t>(gran_)),
                  static_cast<off_t>(gran_));
      }
      throw HostOsError(os_message("fallocate(PUNCH_HOLE)", err,
                                   "releasing " + std::to_string(handles.size()) + " chunks"),
                        "release", err);
    }
    i = j;
  }
  for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) give_index(*it);
  num_chunks_ -= static_cast<int64_t>(sorted.size());
}

// ---- reservations ---------------------------------------------------------------------

uint64_t HostVmm::reserve(size_t size, bool zero) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("reserve");
  if (size == 0 || size % gran_ != 0) {
    throw HostArgError("reserve size " + std::to_string(size) +
                           " must be a positive multiple of the granularity " +
                           std::to_string(gran_),
                       "reserve", 0);
  }
  const size_t align = std::max(gran_, kTwoMiB);
  // The mapping is over-allocated by `align` to trim it to an aligned start; a size that
  // wraps that sum would map a small range and then trim (munmap) outside it.
  if (size > kMaxReserve) {
    throw HostArgError("reserve size " + std::to_string(size) + " exceeds the largest " +
                           std::to_string(kMaxReserve) +
                           " bytes (2^47, all mmap hands out without an address hint)",
                       "reserve", 0);
  }
  const std::string refusal = vma_refusal(1);
  if (!refusal.empty()) throw HostVmaError("reserve needs 1 VMA, " + refusal, "reserve", 1);
  if (fault_now()) {
    throw HostOsError(os_message("mmap", errno, "reserving " + std::to_string(size) + " bytes"),
                      "reserve", errno);
  }
  void* raw = mmap(nullptr, size + align, PROT_NONE, kAnonFlags, -1, 0);
  if (raw == MAP_FAILED) {
    throw HostOsError(os_message("mmap", errno, "reserving " + std::to_string(size) + " bytes"),
                      "reserve", errno);
  }
  const uint64_t base = reinterpret_cast<uint64_t>(raw);
  const uint64_t va = (base + align - 1) & ~static_cast<uint64_t>(align - 1);
  if (va > base) munmap(raw, va - base);
  const uint64_t tail = base + size + align - (va + size);
  if (tail > 0) munmap(reinterpret_cast<void*>(va + size), tail);
  auto res = std::make_shared<Reservation>();
  res->va = va;
  res->size = size;
  res->granularity = gran_;
  const SlotState st = zero ? SlotState::kZero : SlotState::kNone;
  res->state.assign(size / gran_, st);
  res->handle.assign(size / gran_, -1);
  if (zero) {
    if (fault_now() || mmap(reinterpret_cast<void*>(va), size, PROT_READ, kAnonFlags | MAP_FIXED,
                            -1, 0) == MAP_FAILED) {
      const int err = errno;
      throw HostOsError(os_message("mmap", err, "zero-backing " + hex_address(va)), "reserve", err);
    }
  }
  res_.emplace(va, std::move(res));
  add_vmas(1);
  return va;
}

void HostVmm::free_reservation(uint64_t va, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("free_reservation");
  auto it = res_.find(va);
  if (it == res_.end() || it->second->size != size) {
    throw HostArgError("no reservation of " + std::to_string(size) + " bytes at " + hex_address(va),
                       "free_reservation", 0);
  }
  const auto& st = it->second->state;
  const auto mapped = std::count(st.begin(), st.end(), SlotState::kMapped);
  if (mapped > 0) {
    throw HostStateError("free_reservation of " + hex_address(va) + " with " +
                             std::to_string(mapped) + " slots still mapped",
                         "free_reservation", 0);
  }
  it->second->owned = false;
  add_vmas(-it->second->vmas);
  res_.erase(it);  // munmap now, or when the last DLPack view lets go
}

std::shared_ptr<Reservation> HostVmm::reservation(uint64_t va, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("view_factory");
  auto it = res_.find(va);
  if (it == res_.end() || it->second->size != size) {
    throw HostArgError("no reservation of " + std::to_string(size) + " bytes at " + hex_address(va),
                       "view_factory", 0);
  }
  return it->second;
}

std::vector<int64_t> HostVmm::slot_table(uint64_t va, size_t size) {
  const std::shared_ptr<Reservation> r = reservation(va, size);
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out(r->num_slots());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = r->state[i] == SlotState::kZero ? -2 : r->handle[i];
  }
  return out;
}

void HostVmm::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) return;
  for (auto& kv : res_) {
    Reservation& r = *kv.second;
    r.owned = false;
    // Views may outlive the backend: leave them an inaccessible (not a holed) range.
    mmap(reinterpret_cast<void*>(r.va), r.size, PROT_NONE, kAnonFlags | MAP_FIXED, -1, 0);
  }
  res_.clear();
  add_vmas(-vmas_total_);
  ::close(fd_);
  fd_ = -1;
  num_chunks_ = 0;
}

}  // namespace jvmm
