// Emulated CUDA virtual memory management: handles (cuMemCreate / cuMemRelease), address
// reservations, mappings and access (see emu.h for the design note).
//
// Each rule below names the driver API reference page it comes from, in our words. Where
// the reference is silent the emulator takes the strict reading and says so ("strict").

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "emu.h"

static int is_power_of_two(uint64_t x) { return x && !(x & (x - 1)); }
static size_t mapping_lower_bound(uint64_t va);

// ---- physical memory: extents of the memfd ----------------------------------------------
static int phys_alloc(uint64_t size, uint64_t* offset) {
  for (size_t i = 0; i < g_emu.num_extents; ++i) {
    emu_range* ext = &g_emu.extents[i];
    if (ext->size < size) continue;
    *offset = ext->base;
    ext->base += size;
    ext->size -= size;
    if (ext->size == 0) {
      memmove(ext, ext + 1, (g_emu.num_extents - i - 1) * sizeof(*ext));
      g_emu.num_extents--;
    }
    return 0;
  }
  if (ftruncate(g_emu.memfd, (off_t)(g_emu.memfd_top + size)) != 0) return -1;
  *offset = g_emu.memfd_top;
  g_emu.memfd_top += size;
  return 0;
}

static void phys_free(uint64_t offset, uint64_t size) {
  // Give the pages back (the next allocation there starts from fresh, dirty, memory).
  fallocate(g_emu.memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)offset, (off_t)size);
  size_t i = 0;
  while (i < g_emu.num_extents && g_emu.extents[i].base < offset) ++i;
  emu_range* ext = g_emu.extents;
  int joins_prev = i > 0 && ext[i - 1].base + ext[i - 1].size == offset;
  int joins_next = i < g_emu.num_extents && offset + size == ext[i].base;
  if (joins_prev && joins_next) {
    ext[i - 1].size += size + ext[i].size;
    memmove(&ext[i], &ext[i + 1], (g_emu.num_extents - i - 1) * sizeof(*ext));
    g_emu.num_extents--;
  } else if (joins_prev) {
    ext[i - 1].size += size;
  } else if (joins_next) {
    ext[i].base = offset;
    ext[i].size += size;
  } else if (emu_grow((void**)&g_emu.extents, &g_emu.cap_extents, g_emu.num_extents + 1,
                      sizeof(emu_range)) == 0) {
    ext = g_emu.extents;
    memmove(&ext[i + 1], &ext[i], (g_emu.num_extents - i) * sizeof(*ext));
    ext[i] = (emu_range){offset, size};
    g_emu.num_extents++;
  }  // else: the offset range is lost to reuse, which only costs address space
}

static void poison(uint64_t offset, uint64_t size) {
  // Dirty the first and last 4 KiB: code that trusts cuMemCreate to zero memory reads junk
  // there, without paying to touch the whole allocation.
  unsigned char junk[4096];
  memset(junk, EMU_POISON_BYTE, sizeof(junk));
  uint64_t n = size < sizeof(junk) ? size : sizeof(junk);
  ssize_t ignored = pwrite(g_emu.memfd, junk, n, (off_t)offset);
  ignored = pwrite(g_emu.memfd, junk, n, (off_t)(offset + size - n));
  (void)ignored;
}

// ---- handles --------------------------------------------------------------------------------
emu_handle* emu_handle_lookup(CUmemGenericAllocationHandle value, uint32_t* index) {
  uint64_t slot = value & 0xffffffffu;
  if (slot == 0 || slot > g_emu.num_handle_slots) return NULL;
  emu_handle* h = &g_emu.handles[slot - 1];
  if (h->state == EMU_HANDLE_FREE || h->generation != (uint32_t)(value >> 32)) return NULL;
  if (index) *index = (uint32_t)(slot - 1);
  return h;
}

static void handle_free_memory(emu_handle* h) {
  phys_free(h->offset, h->size);
  g_emu.bytes_used -= h->size;
  h->state = EMU_HANDLE_FREE;
  h->generation++;
}

static CUresult mem_create(CUmemGenericAllocationHandle* out, size_t size,
                           const CUmemAllocationProp* prop, unsigned long long flags) {
  // cuMemCreate: flags are reserved and must be 0; the size must be a multiple of the
  // minimum granularity; the prop names the device the memory lives on.
  if (!out || !prop || flags) return CUDA_ERROR_INVALID_VALUE;
  if (size == 0 || size % g_emu.granularity) return CUDA_ERROR_INVALID_VALUE;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.id != 0) return CUDA_ERROR_INVALID_DEVICE;
  // The emulator exports nothing, so it only creates handles with no shareable type.
  if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) return CUDA_ERROR_NOT_SUPPORTED;
  // cuMemCreate lists CUDA_ERROR_OUT_OF_MEMORY: the device holds `device_bytes` in all.
  if (g_emu.bytes_used + size > g_emu.device_bytes) return CUDA_ERROR_OUT_OF_MEMORY;
  size_t slot = 0;
  while (slot < g_emu.num_handle_slots && g_emu.handles[slot].state != EMU_HANDLE_FREE) ++slot;
  if (slot == g_emu.num_handle_slots) {
    if (slot >= 0xffffffffu) return CUDA_ERROR_OUT_OF_MEMORY;
    if (emu_grow((void**)&g_emu.handles, &g_emu.cap_handles, slot + 1, sizeof(emu_handle)))
      return CUDA_ERROR_OUT_OF_MEMORY;
    memset(&g_emu.handles[slot], 0, sizeof(emu_handle));
    g_emu.num_handle_slots++;
  }
  emu_handle* h = &g_emu.handles[slot];
  if (phys_alloc(size, &h->offset) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (g_emu.poison) poison(h->offset, size);
  h->size = size;
  h->state = EMU_HANDLE_LIVE;
  h->num_mappings = 0;
  g_emu.bytes_used += size;
  g_emu.num_live++;
  *out = ((uint64_t)h->generation << 32) | (slot + 1);
  return CUDA_SUCCESS;
}

static CUresult mem_release(CUmemGenericAllocationHandle value) {
  // cuMemRelease: releasing an invalid handle is undefined behaviour; the emulator reports
  // CUDA_ERROR_INVALID_VALUE (strict) so a double release is caught.
  emu_handle* h = emu_handle_lookup(value, NULL);
  if (!h || h->state != EMU_HANDLE_LIVE) return CUDA_ERROR_INVALID_VALUE;
  g_emu.num_live--;
  // cuMemRelease: a handle may be released while mapped; the memory is freed once the
  // last mapping of it is unmapped.
  if (h->num_mappings > 0) {
    h->state = EMU_HANDLE_RELEASED;
    g_emu.num_released_mapped++;
  } else {
    handle_free_memory(h);
  }
  return CUDA_SUCCESS;
}

// ---- reservations ---------------------------------------------------------------------------
static size_t reservation_index(uint64_t va) {  // last reservation with base <= va
  size_t lo = 0, hi = g_emu.num_reservations;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (g_emu.reservations[mid].base <= va) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo == 0 ? g_emu.num_reservations : lo - 1;
}

const emu_range* emu_reservation_containing(uint64_t va) {
  size_t i = reservation_index(va);
  if (i == g_emu.num_reservations) return NULL;
  const emu_range* r = &g_emu.reservations[i];
  return va < r->base + r->size ? r : NULL;
}

static CUresult address_reserve(CUdeviceptr* out, size_t size, size_t alignment, CUdeviceptr addr,
                                unsigned long long flags) {
  // cuMemAddressReserve: size and addr are multiples of the host page size, alignment is
  // a power of two or 0 (default), flags must be 0, addr is only a hint.
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  if (!out || flags || size == 0 || size % page || addr % page) return CUDA_ERROR_INVALID_VALUE;
  if (alignment && !is_power_of_two(alignment)) return CUDA_ERROR_INVALID_VALUE;
  uint64_t align = alignment > g_emu.granularity ? alignment : g_emu.granularity;
  if (emu_grow((void**)&g_emu.reservations, &g_emu.cap_reservations, g_emu.num_reservations + 1,
               sizeof(emu_range)))
    return CUDA_ERROR_OUT_OF_MEMORY;
  uint64_t span = size + align;
  void* raw =
      mmap((void*)addr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uint64_t start = (uint64_t)raw;
  uint64_t base = (start + align - 1) & ~(align - 1);
  if (base > start) munmap(raw, base - start);
  if (start + span > base + size) munmap((void*)(base + size), start + span - base - size);
  size_t i = reservation_index(base);
  i = i == g_emu.num_reservations ? 0 : i + 1;
  emu_range* rs = g_emu.reservations;
  memmove(&rs[i + 1], &rs[i], (g_emu.num_reservations - i) * sizeof(*rs));
  rs[i] = (emu_range){base, size};
  g_emu.num_reservations++;
  *out = base;
  return CUDA_SUCCESS;
}

static CUresult address_free(CUdeviceptr ptr, size_t size) {
  // cuMemAddressFree: ptr and size must be exactly what cuMemAddressReserve gave and took.
  size_t i = reservation_index(ptr);
  if (i == g_emu.num_reservations) return CUDA_ERROR_INVALID_VALUE;
  emu_range* r = &g_emu.reservations[i];
  if (r->base != ptr || r->size != size) return CUDA_ERROR_INVALID_VALUE;
  // Strict: the reference does not say what happens to mappings still inside; the
  // emulator refuses, so a backend that forgets to unmap first is caught.
  size_t m = mapping_lower_bound(ptr);  // mappings never straddle a reservation's start
  if (m < g_emu.num_mappings && g_emu.mappings[m].va < ptr + size) return CUDA_ERROR_INVALID_VALUE;
  munmap((void*)ptr, size);
  memmove(r, r + 1, (g_emu.num_reservations - i - 1) * sizeof(*r));
  g_emu.num_reservations--;
  return CUDA_SUCCESS;
}

// ---- mappings -------------------------------------------------------------------------------
static size_t mapping_lower_bound(uint64_t va) {  // first mapping with va >= `va`
  size_t lo = 0, hi = g_emu.num_mappings;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (g_emu.mappings[mid].va < va) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

size_t emu_mapping_at(uint64_t va) {
  size_t i = mapping_lower_bound(va);
  return i < g_emu.num_mappings && g_emu.mappings[i].va == va ? i : g_emu.num_mappings;
}

size_t emu_mapping_containing(uint64_t va) {
  size_t i = mapping_lower_bound(va + 1);
  if (i == 0) return g_emu.num_mappings;
  const emu_mapping* m = &g_emu.mappings[i - 1];
  return va < m->va + m->size ? i - 1 : g_emu.num_mappings;
}

// [ptr, ptr + size) as a run of whole, adjacent mappings: their index range [first, *last).
static int whole_mappings(uint64_t ptr, uint64_t size, size_t* first, size_t* last) {
  size_t i = emu_mapping_at(ptr);
  if (size == 0 || i == g_emu.num_mappings) return 0;
  uint64_t pos = ptr;
  size_t j = i;
  while (pos < ptr + size) {
    if (j == g_emu.num_mappings || g_emu.mappings[j].va != pos) return 0;
    pos += g_emu.mappings[j].size;
    ++j;
  }
  if (pos != ptr + size) return 0;
  *first = i;
  *last = j;
  return 1;
}

static CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset,
                        CUmemGenericAllocationHandle value, unsigned long long flags) {
  // cuMemMap: flags must be 0; ptr, size and offset are multiples of the minimum
  // granularity; offset + size stays inside the allocation.
  uint64_t g = g_emu.granularity;
  if (flags || size == 0 || ptr % g || size % g || offset % g) return CUDA_ERROR_INVALID_VALUE;
  uint32_t index = 0;
  emu_handle* h = emu_handle_lookup(value, &index);
  // Strict: mapping a released handle is using an invalid handle (undefined behaviour).
  if (!h || h->state != EMU_HANDLE_LIVE) return CUDA_ERROR_INVALID_VALUE;
  if (offset + size > h->size) return CUDA_ERROR_INVALID_VALUE;
  // cuMemMap: the range must lie in an address reservation from cuMemAddressReserve ...
  const emu_range* r = emu_reservation_containing(ptr);
  if (!r || ptr + size > r->base + r->size) return CUDA_ERROR_INVALID_VALUE;
  // ... that is not currently mapped ("can only create mappings on VA range reservations
  // that are not currently mapped").
  size_t at = mapping_lower_bound(ptr);
  if (at < g_emu.num_mappings && g_emu.mappings[at].va < ptr + size)
    return CUDA_ERROR_INVALID_VALUE;
  if (emu_mapping_containing(ptr) != g_emu.num_mappings) return CUDA_ERROR_INVALID_VALUE;
  if (emu_grow((void**)&g_emu.mappings, &g_emu.cap_mappings, g_emu.num_mappings + 1,
               sizeof(emu_mapping)))
    return CUDA_ERROR_OUT_OF_MEMORY;
  // cuMemMap: mapping does not make the range accessible (cuMemSetAccess does): PROT_NONE.
  void* got = mmap((void*)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, g_emu.memfd,
                   (off_t)(h->offset + offset));
  if (got == MAP_FAILED) return errno == ENOMEM ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN;
  emu_mapping* ms = g_emu.mappings;
  memmove(&ms[at + 1], &ms[at], (g_emu.num_mappings - at) * sizeof(*ms));
  ms[at] = (emu_mapping){ptr, size, index, CU_MEM_ACCESS_FLAGS_PROT_NONE};
  g_emu.num_mappings++;
  h->num_mappings++;
  return CUDA_SUCCESS;
}

static void unmap_one(const emu_mapping* m) {
  // Back to a plain reservation: PROT_NONE anonymous memory that costs nothing.
  mmap((void*)m->va, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
       -1, 0);
  emu_handle* h = &g_emu.handles[m->handle_index];
  h->num_mappings--;
  // cuMemUnmap: backing memory is freed when no mapping and no unreleased handle remain.
  if (h->num_mappings == 0 && h->state == EMU_HANDLE_RELEASED) {
    g_emu.num_released_mapped--;
    handle_free_memory(h);
  }
}

static CUresult mem_unmap(CUdeviceptr ptr, size_t size) {
  // cuMemUnmap: the range must be whole mappings; a sub-range of one cannot be unmapped.
  // (Several adjacent whole mappings in one call are accepted, as the driver does.)
  size_t first = 0, last = 0;
  if (!whole_mappings(ptr, size, &first, &last)) return CUDA_ERROR_INVALID_VALUE;
  for (size_t j = first; j < last; ++j) unmap_one(&g_emu.mappings[j]);
  emu_mapping* ms = g_emu.mappings;
  memmove(&ms[first], &ms[last], (g_emu.num_mappings - last) * sizeof(*ms));
  g_emu.num_mappings -= last - first;
  return CUDA_SUCCESS;
}

static int prot_of(int access) {
  if (access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return PROT_READ | PROT_WRITE;
  return access == CU_MEM_ACCESS_FLAGS_PROT_READ ? PROT_READ : PROT_NONE;
}

static CUresult mem_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                               size_t count) {
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  int access = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (desc[i].location.id != 0) return CUDA_ERROR_INVALID_DEVICE;
    int flags = desc[i].flags;
    if (flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      return CUDA_ERROR_INVALID_VALUE;
    // cuMemSetAccess lists CUDA_ERROR_NOT_SUPPORTED: a device may refuse read-only access
    // (emu_set_read_only_access(0) plays such a device).
    if (flags == CU_MEM_ACCESS_FLAGS_PROT_READ && !g_emu.read_only_access)
      return CUDA_ERROR_NOT_SUPPORTED;
    access = flags;
  }
  // cuMemSetAccess: the range must be fully mapped. Strict: it must also start and end on
  // mapping boundaries (the reference says the range contains whole allocations).
  size_t first = 0, last = 0;
  if (!whole_mappings(ptr, size, &first, &last)) return CUDA_ERROR_INVALID_VALUE;
  for (size_t j = first; j < last; ++j) {
    emu_mapping* m = &g_emu.mappings[j];
    if (mprotect((void*)m->va, m->size, prot_of(access)) != 0) return CUDA_ERROR_UNKNOWN;
    m->access = access;
  }
  return CUDA_SUCCESS;
}

static CUresult mem_get_access(unsigned long long* flags, const CUmemLocation* location,
                               CUdeviceptr ptr) {
  if (!flags || !location || location->type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  if (location->id != 0) return CUDA_ERROR_INVALID_DEVICE;
  size_t i = emu_mapping_containing(ptr);
  if (i == g_emu.num_mappings) return CUDA_ERROR_INVALID_VALUE;
  *flags = (unsigned long long)g_emu.mappings[i].access;
  return CUDA_SUCCESS;
}

// ---- teardown (emu_reset) -------------------------------------------------------------------
long emu_destroy_all_memory(void) {
  long destroyed = (long)g_emu.num_mappings + (long)g_emu.num_reservations + g_emu.num_live;
  for (size_t j = 0; j < g_emu.num_mappings; ++j) unmap_one(&g_emu.mappings[j]);
  g_emu.num_mappings = 0;
  for (size_t i = 0; i < g_emu.num_reservations; ++i)
    munmap((void*)g_emu.reservations[i].base, g_emu.reservations[i].size);
  g_emu.num_reservations = 0;
  for (size_t s = 0; s < g_emu.num_handle_slots; ++s) {
    if (g_emu.handles[s].state != EMU_HANDLE_FREE) handle_free_memory(&g_emu.handles[s]);
  }
  g_emu.num_live = 0;
  g_emu.num_released_mapped = 0;
  return destroyed;
}

// ---- exported entry points ------------------------------------------------------------------
EMU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                                const CUmemAllocationProp* prop, unsigned long long flags) {
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = mem_create(handle, size, prop, flags);
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = mem_release(handle);
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment,
                                        CUdeviceptr addr, unsigned long long flags) {
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = address_reserve(ptr, size, alignment, addr, flags);
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = address_free(ptr, size);
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle handle, unsigned long long flags) {
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = mem_map(ptr, size, offset, handle, flags);
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = mem_unmap(ptr, size);
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                                   size_t count) {
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = mem_set_access(ptr, size, desc, count);
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location,
                                   CUdeviceptr ptr) {
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS) err = mem_get_access(flags, location, ptr);
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemGetAllocationGranularity(size_t* granularity,
                                                  const CUmemAllocationProp* prop, int option) {
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS) {
    // cuMemGetAllocationGranularity: the granularity depends on the prop (type, device)
    // and on the option (minimum or recommended); both are one value here.
    if (!granularity || !prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
         option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)) {
      err = CUDA_ERROR_INVALID_VALUE;
    } else if (prop->location.id != 0) {
      err = CUDA_ERROR_INVALID_DEVICE;
    } else {
      *granularity = g_emu.granularity;
    }
  }
  emu_unlock();
  return err;
}
