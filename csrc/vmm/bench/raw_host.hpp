// Raw baselines for vmm-bench: plain C loops of the syscalls the host backend makes.
//
// Rationale
//   An overhead ratio needs a floor measured in the same run, on the same machine, with the
//   same sizes and the same memfd offsets. These loops do exactly the syscalls of the host
//   backend (csrc/host/) with no bookkeeping, no validation and no Python, and time each
//   call with steady_clock inside C++, so "ours / raw" isolates what the vmm layer adds.
//
// Approach
//   One cycle = the life of a small pool, every step timed per call:
//
//     pool      memfd_create + ftruncate(capacity)            (1 value per cycle)
//     create    fallocate(mode 0, h*G, G)      per chunk       (populates the chunk)
//     reserve   mmap(PROT_NONE, PRIVATE|ANON|NORESERVE) of size+align, trim head and tail
//     map       mmap(va+i*G, G, RW, FIXED|SHARED, fd, order[i]*G)   per slot, one by one
//     unmap     mmap(va+i*G, G, PROT_NONE, FIXED|PRIVATE|ANON|NORESERVE)   per slot
//     release   fallocate(PUNCH_HOLE|KEEP_SIZE, h*G, G)   per chunk
//     free_reservation  munmap(va, size)                    (1 value per cycle)
//
//   `order[i]` is the memfd chunk index mapped at slot i: the identity lets the kernel merge
//   neighbouring mappings; 2i (or any non-adjacent pattern) keeps every slot its own VMA.
//
// Limitations
//   Linux only. A cycle's VMAs must fit under vm.max_map_count (the caller sizes it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace jvmm::bench {

// Nanoseconds per call, keyed by op name (see the table above).
using OpTimes = std::map<std::string, std::vector<int64_t>>;

// Runs one cycle over `order.size()` chunks of `chunk_size` bytes; `order` holds distinct
// non-negative memfd chunk indices (create/release touch exactly those, ascending). Throws
// std::system_error (errno) if a syscall fails, after undoing what the cycle created.
OpTimes raw_host_cycle(size_t chunk_size, const std::vector<int64_t>& order);

// The map and unmap steps alone, `rounds` times over one populated memfd and one
// reservation (set up untimed): {"map": [...], "unmap": [...]}, n * rounds values each.
OpTimes raw_host_map_rounds(size_t chunk_size, const std::vector<int64_t>& order, size_t rounds);

}  // namespace jvmm::bench
