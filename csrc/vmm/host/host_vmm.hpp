// Host VMM backend: one memfd of physical chunks mapped into anonymous reservations.
//
// Rationale
//   The CUDA driver VMM model (create a physical handle, reserve VA, map, unmap, release)
//   has an exact Linux counterpart, so everything above the backend can be tested on any
//   machine. The syscalls live here, in C++, so batched map/unmap run with the GIL released
//   and cost about what a plain C loop of the same syscalls costs.
//
// Approach
//   physical  one memfd per backend, ftruncate'd once to `capacity`; chunk handle h is the
//             memfd range [h*G, (h+1)*G). Creating populates it (fallocate mode 0), releasing
//             punches a hole (fallocate PUNCH_HOLE|KEEP_SIZE) so the pages go back to the OS.
//             New handles are the lowest free indices, so adjacent slots tend to get
//             adjacent offsets and their mappings merge into one VMA.
//   virtual   reserve = mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE) aligned to
//             max(G, 2 MiB). map = mmap(MAP_FIXED|MAP_SHARED, memfd, h*G), one call per run
//             of adjacent slots over adjacent handles. unmap = mmap an anonymous PROT_NONE (or
//             PROT_READ: the kernel zero page, our "zero chunk") over the slots, so the
//             reservation never gets a hole another mmap could land in.
//   VMAs      every reservation keeps a slot table (state + handle); the number of VMAs it
//             costs is the number of maximal runs of mergeable slots, kept incrementally.
//             A batch that would push the total above `vma_budget`, or the process-wide
//             total of every HostVmm above `process_vma_budget()`, is refused before any
//             syscall (at vm.max_map_count even munmap fails with ENOMEM). The process-wide
//             ledger is one atomic counter shared by all instances (several pools, one
//             kernel limit).
//   atomic    each public call is all-or-nothing: a failing syscall mid-batch undoes the
//             runs already done, restores the tables, then throws.
//   sharing   `fd()` exports the memfd (another process receives it over a Unix socket);
//             a backend built over a received fd (`import_fd` >= 0) never creates or punches
//             chunks: `import_handles` adopts indices the exporter created, and `release`
//             only forgets them (the exporter's release returns the memory to the OS).
//   faults    `inject_fault(k, err, n)` makes the k-th counted syscall from now and the
//             n-1 after it fail with errno `err`, so callers can prove their rollback at
//             every k (n = 1) and their handling of a failed rollback (n > 1).
//   broken    a failed rollback throws HostBrokenError: the slot tables no longer match
//             the kernel's mappings, and the caller must stop trusting them.
//
// Limitations
//   Linux only. A reservation freed while DLPack views still hold it is munmap'ed when the
//   last view dies and no longer counts in `vmas()`. Rollback of a failed batch assumes the
//   undo syscalls succeed (true under one-shot injection; a real failure there is reported).
#pragma once

#include <atomic>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older headers lack it, older kernels return EINVAL
#endif

namespace jvmm {

// "0x" and `v` in lower-case hex, for error messages. Formatted with std::to_chars, which
// never consults a locale: an iostream would use the process's global C++ locale, which any
// library loaded beside this module may have replaced (digit grouping, or facets from
// another C++ runtime that crash when used from here).
inline std::string hex_address(uint64_t v) {
  char buf[2 + 16];
  buf[0] = '0';
  buf[1] = 'x';
  const std::to_chars_result end = std::to_chars(buf + 2, buf + sizeof(buf), v, 16);
  return std::string(buf, end.ptr);
}

// Errors thrown by the host backend; bindings translate them to Python classes carrying
// (message, op, code) so `vmm.host` can raise the `vmm.errors` class that fits.
struct HostError : std::runtime_error {
  HostError(std::string msg, std::string op_, int code_)
      : std::runtime_error(std::move(msg)), op(std::move(op_)), code(code_) {}
  std::string op;
  int code;
};
struct HostOsError : HostError {  // a syscall failed; code = errno
  using HostError::HostError;
};
struct HostStateError : HostError {  // a slot or handle is in the wrong state
  using HostError::HostError;
};
struct HostArgError : HostError {  // misaligned / non-positive / unknown address or size
  using HostError::HostError;
};
struct HostRangeError : HostError {  // a view or slot lies outside its reservation
  using HostError::HostError;
};
struct HostVmaError : HostError {  // the batch would exceed the VMA budget; code = needed
  using HostError::HostError;
};
struct HostBrokenError : HostOsError {  // a syscall failed and so did its rollback
  using HostOsError::HostOsError;
};

// Process-wide VMA ledger: VMAs held by every HostVmm of the process, and their shared
// budget (<= 0: unlimited). Atomic: instances lock only their own mutex.
int64_t process_vmas();
int64_t process_vma_budget();
void set_process_vma_budget(int64_t budget);

enum class SlotState : uint8_t { kNone = 0, kZero = 1, kMapped = 2 };

// One reserved VA span. Shared with DLPack views, whose deleters keep it alive.
struct Reservation {
  uint64_t va = 0;
  size_t size = 0;
  size_t granularity = 0;
  std::vector<SlotState> state;
  std::vector<int64_t> handle;  // -1 unless kMapped
  int64_t vmas = 1;
  bool owned = true;        // false once free_reservation ran (views may still hold it)
  bool host_mapped = true;  // false: device memory another API reserved; never munmap'ed
  ~Reservation();
  size_t num_slots() const { return state.size(); }
  // 1 when slots i-1 and i cannot share a VMA, 0 when they merge (0 < i < num_slots).
  int boundary_cost(size_t i) const;
};

class HostVmm {
 public:
  // import_fd >= 0: build over a memfd another backend exported (dup'ed; capacity = its size).
  HostVmm(size_t granularity, size_t capacity, int64_t vma_budget, bool collapse,
          int import_fd = -1);
  ~HostVmm();
  HostVmm(const HostVmm&) = delete;
  HostVmm& operator=(const HostVmm&) = delete;

  size_t granularity() const { return gran_; }
  size_t capacity() const { return capacity_; }

  std::vector<int64_t> create(size_t count);
  // Adopt chunks (memfd indices) the exporter created; all-or-nothing, no syscall.
  void import_handles(const std::vector<int64_t>& handles);
  int fd() const;
  bool imported() const { return imported_; }
  void release(const std::vector<int64_t>& handles);
  uint64_t reserve(size_t size, bool zero);
  void free_reservation(uint64_t va, size_t size);
  void map(const std::vector<uint64_t>& vas, const std::vector<int64_t>& handles);
  void unmap(const std::vector<uint64_t>& vas, bool to_zero);
  std::shared_ptr<Reservation> reservation(uint64_t va, size_t size);
  // Per slot of the reservation: the mapped handle, -1 when unmapped, -2 when zero-backed.
  std::vector<int64_t> slot_table(uint64_t va, size_t size);
  void close();

  void inject_fault(int64_t k, int err, int64_t count = 1);
  // Getters of shared state take the mutex (a worker thread may be mapping).
  uint64_t syscalls() const;
  int64_t vmas() const;
  int64_t vma_budget() const { return vma_budget_; }  // constant
  int64_t chunks() const;
  int64_t physical_bytes() const;  // memfd st_blocks * 512
  bool closed() const;

 private:
  struct Target {  // one slot of a batch, sorted by address
    Reservation* res;
    size_t slot;
    int64_t handle;
  };
  bool fault_now();
  void open_imported(int import_fd);
  void check_open(const char* op) const;
  Reservation* find(uint64_t va, const char* op) const;
  std::vector<Target> resolve(const std::vector<uint64_t>& vas, const char* op) const;
  // Sets every target to (state[i], handle[i]); keeps the VMA counts; returns their change.
  int64_t retarget(const std::vector<Target>& ts, const std::vector<SlotState>& st,
                   const std::vector<int64_t>& h);
  bool map_run(const Target& first, size_t n, SlotState st, int64_t handle);
  void apply_batch(const std::vector<Target>& ts, const std::vector<SlotState>& st,
                   const std::vector<int64_t>& h, const char* op);
  void do_runs(const std::vector<Target>& ts, const std::vector<SlotState>& st,
               const std::vector<int64_t>& h, size_t limit, size_t* failed_at);
  void populate(int64_t first, int64_t n);
  int64_t take_index();
  void give_index(int64_t h);

  size_t gran_;
  size_t capacity_;
  int64_t vma_budget_;
  bool collapse_;
  bool imported_ = false;
  int fd_ = -1;
  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Reservation>> res_;  // by base address
  std::vector<int32_t> map_count_;  // per handle index: slots mapping it; -1 = not created
  std::set<int64_t> free_below_;    // free indices below high_water_
  int64_t high_water_ = 0;
  int64_t num_chunks_ = 0;
  int64_t vmas_total_ = 0;
  uint64_t syscalls_ = 0;
  int64_t fail_in_ = 0;
  int64_t fail_left_ = 0;
  int fail_errno_ = 0;
  // Adds `delta` to this instance's and the process's VMA totals.
  void add_vmas(int64_t delta);
  // Whether `extra` more VMAs fit this instance's and the process's budgets; else a message.
  std::string vma_refusal(int64_t extra) const;
};

}  // namespace jvmm
