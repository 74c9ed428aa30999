// Shared state of the CUDA driver emulator (a test double, never shipped).
//
// Design note
// -----------
// Rationale: `vmm/cuda.py` talks to the driver through cuda-bindings. On a machine with no
// GPU the only way to run that code for real (argument types, struct layouts, return
// tuples, error codes) is a library that cuda-bindings loads as `libcuda.so.1` and that
// keeps the driver's documented VMM rules.
//
// Approach: device memory is host memory. A handle from cuMemCreate is a range of one
// memfd; cuMemAddressReserve reserves real process VA (PROT_NONE, MAP_NORESERVE), so a
// CUdeviceptr is a host address; cuMemMap maps the handle's memfd range there with no
// access; cuMemSetAccess mprotects it. Tests can therefore read "device memory" at the
// device address, and touching a slot whose access was never set faults, as on a GPU.
// Stream work (cuMemsetD8Async) is queued and runs at the latest moment the API allows
// (cuStreamSynchronize, cuCtxSynchronize, cuStreamDestroy), against the mappings that
// exist *then*: work that outlives the unmap of its target fails with the sticky
// CUDA_ERROR_ILLEGAL_ADDRESS, the worst case of a real in-flight kernel.
//
//     reservation  [ base ............................................ base+size )
//     mappings         [va0, +g) -> handle 7 (RW)   [va2, +g) -> handle 9 (R)
//     memfd            | h7: offset 0 | h9: offset g | free | ...
//
// Rules: each enforced rule names, in a comment at the code, the driver call whose page of
// the CUDA Driver API reference states it (sections Virtual Memory Management, Stream
// Management, Context Management, Primary Context Management, Initialization; the same
// text cuda-bindings ships as its functions' docstrings). Where the reference is silent the
// code says "strict" and refuses.
//
// Limitations: one device; no kernels, events, graphs or IPC; latencies are host mmap
// and mprotect costs, never GPU figures. Everything is behind one mutex.
//
// Memory calls (the ones `emu_fail_after` counts and can fail): cuMemCreate, cuMemRelease,
// cuMemAddressReserve, cuMemAddressFree, cuMemMap, cuMemUnmap, cuMemSetAccess,
// cuMemsetD8Async, cuStreamSynchronize.

#ifndef JENGA_VMM_TESTS_CUDA_EMULATOR_EMU_H_
#define JENGA_VMM_TESTS_CUDA_EMULATOR_EMU_H_

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_abi.h"

#define EMU_EXPORT __attribute__((visibility("default")))
#define EMU_DEVICE_NAME "jenga-vmm CUDA emulator (host memory)"
#define EMU_POISON_BYTE 0xA5  // cuMemCreate gives no zeroing guarantee: new memory is dirty

enum { EMU_HANDLE_FREE = 0, EMU_HANDLE_LIVE = 1, EMU_HANDLE_RELEASED = 2 };
// PLAIN: device queries, the context stack, retain/release. WORK: calls that use the
// context's device (streams, memsets, memory info). MEMORY: the fault-injectable calls.
enum { EMU_PLAIN_CALL = 0, EMU_WORK_CALL = 1, EMU_MEMORY_CALL = 2 };

typedef struct {
  uint64_t size;
  uint64_t offset;  // byte offset of the allocation in the memfd
  uint32_t generation;
  int state;  // EMU_HANDLE_*: RELEASED = cuMemRelease'd while still mapped
  long num_mappings;
} emu_handle;

typedef struct {
  uint64_t base;
  uint64_t size;
} emu_range;  // a reservation, or a free extent of the memfd

typedef struct {
  uint64_t va;
  uint64_t size;
  uint32_t handle_index;
  int access;  // CU_MEM_ACCESS_FLAGS_*; a new mapping has none
} emu_mapping;

typedef struct emu_work {
  uint64_t va;
  uint64_t num_bytes;
  unsigned char value;
  struct emu_work* next;
} emu_work;

struct emu_stream {
  struct emu_stream* next;
  emu_work* head;
  emu_work* tail;
};

struct emu_ctx {
  int retains;
};

typedef struct {
  pthread_mutex_t lock;
  int initialised;
  // configuration (environment at cuInit, or the emu_set_* controls)
  uint64_t granularity;
  uint64_t device_bytes;
  int driver_version;
  int read_only_access;
  int poison;
  // physical memory: one memfd; free extents sorted by offset and coalesced
  int memfd;
  uint64_t memfd_top;
  emu_range* extents;
  size_t num_extents, cap_extents;
  uint64_t bytes_used;  // live handles plus released-but-mapped ones
  // handles: slot i holds handle value (generation << 32) | (i + 1)
  emu_handle* handles;
  size_t num_handle_slots, cap_handles;
  long num_live, num_released_mapped;
  // virtual memory, both arrays sorted by address
  emu_range* reservations;
  size_t num_reservations, cap_reservations;
  emu_mapping* mappings;
  size_t num_mappings, cap_mappings;
  // contexts and streams
  struct emu_ctx primary;
  struct emu_stream null_stream;
  struct emu_stream* streams;
  long num_streams;
  CUresult sticky;              // CUDA_ERROR_ILLEGAL_ADDRESS once stream work faulted
  long long num_device_faults;  // stream work that hit an illegal address, ever
  // fault injection
  long long num_memory_calls;
  long long fail_in;  // > 0: the fail_in-th memory call from now returns fail_code
  CUresult fail_code;
} emu_state;

extern emu_state g_emu;

// Locks the state and checks that a call may run: cuInit done, no sticky error, and for
// memory calls the injected fault. Always pair with emu_unlock.
CUresult emu_enter(int kind);
void emu_unlock(void);
int emu_grow(void** array, size_t* cap, size_t need, size_t elem_size);

// emu_memory.c
emu_handle* emu_handle_lookup(CUmemGenericAllocationHandle value, uint32_t* index);
size_t emu_mapping_at(uint64_t va);  // index of the mapping starting at va, or num_mappings
size_t emu_mapping_containing(uint64_t va);
const emu_range* emu_reservation_containing(uint64_t va);
long emu_destroy_all_memory(void);

// emu_context.c
struct emu_ctx* emu_current_ctx(void);
int emu_ctx_depth(void);
void emu_clear_ctx_stack(void);
long emu_destroy_all_streams(void);
void emu_read_config(void);

// emu_proc.c
void* emu_proc_lookup(const char* symbol, int cuda_version, int* status);

#endif  // JENGA_VMM_TESTS_CUDA_EMULATOR_EMU_H_
