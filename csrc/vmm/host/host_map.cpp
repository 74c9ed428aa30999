// Batched map / unmap of the host backend (see host_vmm.hpp for the design note).
//
// A batch is resolved to slots sorted by address, the slot tables are switched to the new
// state (which yields the VMA change and enforces the budget before any syscall), then one
// mmap runs per run of slots that the kernel can keep in one VMA. On a failing syscall the
// runs already done are mapped back to their old state and the tables restored.
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "host/host_vmm.hpp"

namespace jvmm {
namespace {

constexpr int kAnonFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;

}  // namespace

Reservation* HostVmm::find(uint64_t va, const char* op) const {
  if (va % gran_ != 0) {
    throw HostArgError(std::string(op) + " address " + hex_address(va) + " is not aligned to the " +
                           std::to_string(gran_) + "-byte granularity (off by " +
                           std::to_string(va % gran_) + ")",
                       op, 0);
  }
  // The last reservation starting at or below va, if va lies before its end (an offset
  // test: no end address is computed, so nothing can wrap).
  auto it = res_.upper_bound(va);
  if (it != res_.begin()) {
    --it;
    Reservation* r = it->second.get();
    if (va - r->va < r->size && (va - r->va) / gran_ < r->num_slots()) return r;
  }
  throw HostArgError(std::string(op) + " address " + hex_address(va) + " is inside no reservation",
                     op, 0);
}

std::vector<HostVmm::Target> HostVmm::resolve(const std::vector<uint64_t>& vas,
                                              const char* op) const {
  std::vector<Target> ts;
  ts.reserve(vas.size());
  bool sorted = true;
  for (size_t i = 0; i < vas.size(); ++i) {
    Reservation* r = find(vas[i], op);
    ts.push_back(Target{r, (vas[i] - r->va) / gran_, static_cast<int64_t>(i)});
    if (i > 0 && vas[i] <= vas[i - 1]) sorted = false;
  }
  if (!sorted) {
    std::sort(ts.begin(), ts.end(), [this](const Target& a, const Target& b) {
      return a.res->va + a.slot * gran_ < b.res->va + b.slot * gran_;
    });
    for (size_t i = 1; i < ts.size(); ++i) {
      if (ts[i].res == ts[i - 1].res && ts[i].slot == ts[i - 1].slot) {
        throw HostArgError(std::string(op) + " lists address " +
                               hex_address(ts[i].res->va + ts[i].slot * gran_) + " twice",
                           op, 0);
      }
    }
  }
  return ts;  // Target::handle holds the index into the caller's arrays for now
}

int64_t HostVmm::retarget(const std::vector<Target>& ts, const std::vector<SlotState>& st,
                          const std::vector<int64_t>& h) {
  std::vector<std::pair<Reservation*, size_t>> bounds;  // boundary i: between slots i-1, i
  bounds.reserve(ts.size() * 2);
  for (const Target& t : ts) {
    if (t.slot > 0) bounds.emplace_back(t.res, t.slot);
    if (t.slot + 1 < t.res->num_slots()) bounds.emplace_back(t.res, t.slot + 1);
  }
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  int64_t delta = 0;
  for (const auto& b : bounds) {
    const int c = b.first->boundary_cost(b.second);
    b.first->vmas -= c;
    delta -= c;
  }
  for (size_t i = 0; i < ts.size(); ++i) {
    ts[i].res->state[ts[i].slot] = st[i];
    ts[i].res->handle[ts[i].slot] = h[i];
  }
  for (const auto& b : bounds) {
    const int c = b.first->boundary_cost(b.second);
    b.first->vmas += c;
    delta += c;
  }
  add_vmas(delta);
  return delta;
}

bool HostVmm::map_run(const Target& first, size_t n, SlotState st, int64_t handle) {
  if (fault_now()) return false;
  void* addr = reinterpret_cast<void*>(first.res->va + first.slot * gran_);
  const size_t len = n * gran_;
  void* got;
  if (st == SlotState::kMapped) {
    got = mmap(addr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
               static_cast<off_t>(handle * static_cast<int64_t>(gran_)));
    if (got != MAP_FAILED && collapse_) madvise(addr, len, MADV_COLLAPSE);  // best effort
  } else {
    const int prot = st == SlotState::kZero ? PROT_READ : PROT_NONE;
    got = mmap(addr, len, prot, kAnonFlags, -1, 0);
  }
  return got != MAP_FAILED;
}

// Runs the syscalls for targets [0, limit); on failure returns errno and sets *failed_end to
// the end of the run that failed (its slots may or may not have changed).
void HostVmm::do_runs(const std::vector<Target>& ts, const std::vector<SlotState>& st,
                      const std::vector<int64_t>& h, size_t limit, size_t* failed_end) {
  *failed_end = 0;
  for (size_t i = 0; i < limit;) {
    size_t j = i + 1;
    while (j < limit && ts[j].res == ts[j - 1].res && ts[j].slot == ts[j - 1].slot + 1 &&
           st[j] == st[i] && (st[i] != SlotState::kMapped || h[j] == h[j - 1] + 1)) {
      ++j;
    }
    if (!map_run(ts[i], j - i, st[i], h[i])) {
      *failed_end = j;
      return;
    }
    i = j;
  }
}

void HostVmm::apply_batch(const std::vector<Target>& ts, const std::vector<SlotState>& st,
                          const std::vector<int64_t>& h, const char* op) {
  std::vector<SlotState> old_st(ts.size());
  std::vector<int64_t> old_h(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    old_st[i] = ts[i].res->state[ts[i].slot];
    old_h[i] = ts[i].res->handle[ts[i].slot];
  }
  const int64_t delta = retarget(ts, st, h);
  if (delta > 0 && !vma_refusal(0).empty()) {
    retarget(ts, old_st, old_h);  // the refusal names the totals before the batch
    throw HostVmaError(std::string(op) + " of " + std::to_string(ts.size()) + " slots needs " +
                           std::to_string(delta) + " more VMAs, " + vma_refusal(delta),
                       op, static_cast<int>(delta));
  }
  size_t failed_end = 0;
  do_runs(ts, st, h, ts.size(), &failed_end);
  if (failed_end == 0) return;
  const int err = errno;
  size_t undo_failed = 0;
  do_runs(ts, old_st, old_h, failed_end, &undo_failed);
  retarget(ts, old_st, old_h);
  std::string msg = std::string(op) + " of " + std::to_string(ts.size()) + " slots failed: mmap " +
                    std::strerror(err) + " (errno " + std::to_string(err) + ")";
  if (undo_failed != 0) {
    msg += "; its rollback failed too (" + std::string(std::strerror(errno)) +
           "): the slots of this batch may be inaccessible";
    throw HostBrokenError(msg, op, err);
  }
  throw HostOsError(msg, op, err);
}

void HostVmm::map(const std::vector<uint64_t>& vas, const std::vector<int64_t>& handles) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("map");
  if (vas.size() != handles.size()) {
    throw HostArgError("map got " + std::to_string(vas.size()) + " addresses and " +
                           std::to_string(handles.size()) + " handles",
                       "map", 0);
  }
  std::vector<Target> ts = resolve(vas, "map");
  std::vector<SlotState> st(ts.size(), SlotState::kMapped);
  std::vector<int64_t> h(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    Target& t = ts[i];
    t.handle = handles[static_cast<size_t>(t.handle)];
    if (t.handle < 0 || t.handle >= high_water_ || map_count_[t.handle] < 0) {
      throw HostArgError("map of unknown handle " + std::to_string(t.handle), "map", 0);
    }
    if (t.res->state[t.slot] == SlotState::kMapped) {
      throw HostStateError("map over slot " + std::to_string(t.slot) + " of reservation " +
                               hex_address(t.res->va) + ", already mapped to handle " +
                               std::to_string(t.res->handle[t.slot]),
                           "map", 0);
    }
    h[i] = t.handle;
  }
  apply_batch(ts, st, h, "map");
  for (const Target& t : ts) ++map_count_[t.handle];
}

void HostVmm::unmap(const std::vector<uint64_t>& vas, bool to_zero) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("unmap");
  std::vector<Target> ts = resolve(vas, "unmap");
  for (Target& t : ts) {
    if (t.res->state[t.slot] != SlotState::kMapped) {
      throw HostStateError("unmap of slot " + std::to_string(t.slot) + " of reservation " +
                               hex_address(t.res->va) + ", which is not mapped",
                           "unmap", 0);
    }
    t.handle = t.res->handle[t.slot];
  }
  std::vector<SlotState> st(ts.size(), to_zero ? SlotState::kZero : SlotState::kNone);
  std::vector<int64_t> h(ts.size(), -1);
  apply_batch(ts, st, h, "unmap");
  for (const Target& t : ts) --map_count_[t.handle];
}

}  // namespace jvmm
