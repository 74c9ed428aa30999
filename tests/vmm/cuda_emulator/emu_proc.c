// Emulated CUDA driver: entry-point lookup (cuGetProcAddress, through which cuda-bindings
// resolves every driver function), error names, and the emu_* controls tests call through
// ctypes (fault injection, counters, device size).

#include <string.h>

#include "emu.h"

// The driver functions (defined in emu_context.c / emu_memory.c) under their ABI names.
CUresult cuInit(unsigned int);
CUresult cuDriverGetVersion(int*);
CUresult cuDeviceGetCount(int*);
CUresult cuDeviceGet(CUdevice*, int);
CUresult cuDeviceGetName(char*, int, CUdevice);
CUresult cuDeviceTotalMem_v2(size_t*, CUdevice);
CUresult cuDeviceGetAttribute(int*, int, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxGetCurrent(CUcontext*);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext*);
CUresult cuCtxGetDevice(CUdevice*);
CUresult cuCtxSynchronize(void);
CUresult cuStreamCreate(CUstream*, unsigned int);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult cuMemGetInfo_v2(size_t*, size_t*);
CUresult cuMemGetAllocationGranularity(size_t*, const CUmemAllocationProp*, int);
CUresult cuMemCreate(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                     unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
CUresult cuMemGetAccess(unsigned long long*, const CUmemLocation*, CUdeviceptr);
CUresult cuGetErrorName(CUresult, const char**);
CUresult cuGetErrorString(CUresult, const char**);
CUresult cuGetProcAddress_v2(const char*, void**, int, cuuint64_t, int*);
CUresult cuGetProcAddress(const char*, void**, int, cuuint64_t);

// cuGetProcAddress takes the base name and the CUDA version whose ABI the caller wants;
// `since` is the version that introduced the ABI we implement (e.g. cuMemGetInfo_v2 is
// the cuMemGetInfo of CUDA >= 3.2). Older ABIs are not provided.
typedef struct {
  const char* name;
  int since;
  void* fn;
} emu_entry;

static const emu_entry kEntries[] = {
    {"cuInit", 2000, (void*)cuInit},
    {"cuDriverGetVersion", 2020, (void*)cuDriverGetVersion},
    {"cuGetErrorName", 6000, (void*)cuGetErrorName},
    {"cuGetErrorString", 6000, (void*)cuGetErrorString},
    {"cuGetProcAddress", 12000, (void*)cuGetProcAddress_v2},
    {"cuDeviceGetCount", 2000, (void*)cuDeviceGetCount},
    {"cuDeviceGet", 2000, (void*)cuDeviceGet},
    {"cuDeviceGetName", 2000, (void*)cuDeviceGetName},
    {"cuDeviceTotalMem", 3020, (void*)cuDeviceTotalMem_v2},
    {"cuDeviceGetAttribute", 2000, (void*)cuDeviceGetAttribute},
    {"cuDevicePrimaryCtxRetain", 7000, (void*)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, (void*)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxGetCurrent", 4000, (void*)cuCtxGetCurrent},
    {"cuCtxSetCurrent", 4000, (void*)cuCtxSetCurrent},
    {"cuCtxPushCurrent", 4000, (void*)cuCtxPushCurrent_v2},
    {"cuCtxPopCurrent", 4000, (void*)cuCtxPopCurrent_v2},
    {"cuCtxGetDevice", 2000, (void*)cuCtxGetDevice},
    {"cuCtxSynchronize", 2000, (void*)cuCtxSynchronize},
    {"cuStreamCreate", 2000, (void*)cuStreamCreate},
    {"cuStreamDestroy", 4000, (void*)cuStreamDestroy_v2},
    {"cuStreamSynchronize", 2000, (void*)cuStreamSynchronize},
    {"cuMemsetD8Async", 3020, (void*)cuMemsetD8Async},
    {"cuMemGetInfo", 3020, (void*)cuMemGetInfo_v2},
    {"cuMemGetAllocationGranularity", 10020, (void*)cuMemGetAllocationGranularity},
    {"cuMemCreate", 10020, (void*)cuMemCreate},
    {"cuMemRelease", 10020, (void*)cuMemRelease},
    {"cuMemAddressReserve", 10020, (void*)cuMemAddressReserve},
    {"cuMemAddressFree", 10020, (void*)cuMemAddressFree},
    {"cuMemMap", 10020, (void*)cuMemMap},
    {"cuMemUnmap", 10020, (void*)cuMemUnmap},
    {"cuMemSetAccess", 10020, (void*)cuMemSetAccess},
    {"cuMemGetAccess", 10020, (void*)cuMemGetAccess},
};

void* emu_proc_lookup(const char* symbol, int cuda_version, int* status) {
  for (size_t i = 0; i < sizeof(kEntries) / sizeof(kEntries[0]); ++i) {
    if (strcmp(kEntries[i].name, symbol) != 0) continue;
    if (cuda_version < kEntries[i].since) {
      *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return NULL;
    }
    *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return kEntries[i].fn;
  }
  *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return NULL;
}

EMU_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version,
                                        cuuint64_t flags, int* symbol_status) {
  // cuGetProcAddress: a cudaVersion above the driver's is CUDA_ERROR_INVALID_VALUE; an
  // unknown symbol, or one with no ABI for that version, is CUDA_SUCCESS with *pfn NULL
  // and the reason in symbolStatus. The per-thread-default-stream flag changes nothing
  // here: the emulator has one default stream.
  (void)flags;
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  int version = 0;
  cuDriverGetVersion(&version);
  int status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  *pfn = NULL;
  CUresult err = CUDA_SUCCESS;
  if (cuda_version > version) {
    err = CUDA_ERROR_INVALID_VALUE;
  } else {
    *pfn = emu_proc_lookup(symbol, cuda_version, &status);
  }
  if (symbol_status) *symbol_status = status;
  return err;
}

EMU_EXPORT CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version,
                                     cuuint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}

// ---- error names ----------------------------------------------------------------------------
typedef struct {
  CUresult code;
  const char* name;
  const char* text;
} emu_error;

static const emu_error kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const emu_error* find_error(CUresult code) {
  for (size_t i = 0; i < sizeof(kErrors) / sizeof(kErrors[0]); ++i) {
    if (kErrors[i].code == code) return &kErrors[i];
  }
  return NULL;
}

EMU_EXPORT CUresult cuGetErrorName(CUresult code, const char** name) {
  // cuGetErrorName: an unrecognised code is CUDA_ERROR_INVALID_VALUE with *pStr NULL.
  if (!name) return CUDA_ERROR_INVALID_VALUE;
  const emu_error* e = find_error(code);
  *name = e ? e->name : NULL;
  return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EMU_EXPORT CUresult cuGetErrorString(CUresult code, const char** text) {
  if (!text) return CUDA_ERROR_INVALID_VALUE;
  const emu_error* e = find_error(code);
  *text = e ? e->text : NULL;
  return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// ---- test controls (ctypes) -----------------------------------------------------------------
// The k-th memory call from now (1 = the next) returns `code` and does nothing; k <= 0
// cancels a pending fault. One shot.
EMU_EXPORT void emu_fail_after(long long k, int code) {
  pthread_mutex_lock(&g_emu.lock);
  g_emu.fail_in = k > 0 ? k : 0;
  g_emu.fail_code = code;
  pthread_mutex_unlock(&g_emu.lock);
}

// Counters by name; -1 for an unknown name.
EMU_EXPORT long long emu_count(const char* what) {
  pthread_mutex_lock(&g_emu.lock);
  long long value = -1;
  if (strcmp(what, "memory_calls") == 0) value = g_emu.num_memory_calls;
  if (strcmp(what, "handles") == 0) value = g_emu.num_live;
  if (strcmp(what, "released_mapped") == 0) value = g_emu.num_released_mapped;
  if (strcmp(what, "reservations") == 0) value = (long long)g_emu.num_reservations;
  if (strcmp(what, "mappings") == 0) value = (long long)g_emu.num_mappings;
  if (strcmp(what, "streams") == 0) value = g_emu.num_streams;
  if (strcmp(what, "ctx_retains") == 0) value = g_emu.primary.retains;
  if (strcmp(what, "ctx_depth") == 0) value = emu_ctx_depth();
  if (strcmp(what, "bytes_used") == 0) value = (long long)g_emu.bytes_used;
  if (strcmp(what, "device_bytes") == 0) value = (long long)g_emu.device_bytes;
  if (strcmp(what, "sticky_error") == 0) value = g_emu.sticky;
  if (strcmp(what, "device_faults") == 0) value = g_emu.num_device_faults;
  if (strcmp(what, "pending_fault") == 0) value = g_emu.fail_in;
  pthread_mutex_unlock(&g_emu.lock);
  return value;
}

// Access of the mapping at va (CU_MEM_ACCESS_FLAGS_*), -1 if reserved but unmapped, -2 if
// not reserved: tests check this before they touch "device memory" through a host view.
EMU_EXPORT int emu_access(unsigned long long va) {
  pthread_mutex_lock(&g_emu.lock);
  int access = -2;
  if (emu_reservation_containing(va)) {
    size_t i = emu_mapping_containing(va);
    access = i == g_emu.num_mappings ? -1 : g_emu.mappings[i].access;
  }
  pthread_mutex_unlock(&g_emu.lock);
  return access;
}

EMU_EXPORT void emu_set_device_bytes(unsigned long long bytes) {
  pthread_mutex_lock(&g_emu.lock);
  g_emu.device_bytes = bytes;
  pthread_mutex_unlock(&g_emu.lock);
}

EMU_EXPORT void emu_set_read_only_access(int supported) {
  pthread_mutex_lock(&g_emu.lock);
  g_emu.read_only_access = supported != 0;
  pthread_mutex_unlock(&g_emu.lock);
}

// Destroys everything (handles, reservations, mappings, streams, retains, this thread's
// context stack), clears faults and restores the configuration; returns how many objects
// were still alive, so a test can tell a leak from a clean slate.
EMU_EXPORT long long emu_reset(void) {
  pthread_mutex_lock(&g_emu.lock);
  long long alive = 0;
  if (g_emu.initialised) {
    alive += emu_destroy_all_streams();
    alive += emu_destroy_all_memory();
    alive += g_emu.primary.retains;
    g_emu.primary.retains = 0;
    emu_read_config();
  }
  alive += emu_ctx_depth();
  emu_clear_ctx_stack();
  g_emu.sticky = CUDA_SUCCESS;
  g_emu.fail_in = 0;
  g_emu.num_memory_calls = 0;
  pthread_mutex_unlock(&g_emu.lock);
  return alive;
}
