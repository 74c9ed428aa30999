// The subset of the CUDA driver ABI (cuda.h, CUDA 12.x / 13.x) that the emulator implements.
//
// Written from the driver API reference (the "Data types used by CUDA driver" and the
// per-function pages), not copied from cuda.h. Only what `vmm/cuda.py`, `vmm/bench/` and
// cuda-bindings' loader touch is declared. Struct layouts must match the real header byte
// for byte, because cuda-bindings hands us pointers to its own C structs; the
// static_asserts below pin the sizes the reference documents.

#ifndef JENGA_VMM_TESTS_CUDA_EMULATOR_CUDA_ABI_H_
#define JENGA_VMM_TESTS_CUDA_EMULATOR_CUDA_ABI_H_

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef uint64_t cuuint64_t;
typedef struct emu_ctx* CUcontext;
typedef struct emu_stream* CUstream;

// CUresult codes (values from the CUresult enum of the driver reference).
enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_OPERATING_SYSTEM = 304,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_UNKNOWN = 999,
};

// CUmemAllocationType, CUmemLocationType, CUmemAllocationHandleType, CUmemAccess_flags,
// CUmemAllocationGranularity_flags.
enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1 };
enum { CU_MEM_LOCATION_TYPE_DEVICE = 1 };
enum { CU_MEM_HANDLE_TYPE_NONE = 0 };
enum {
  CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
  CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
};
enum { CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1 };

// CUdevice_attribute values the emulator answers.
enum {
  CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
};

// CUstream_flags; CU_STREAM_LEGACY / CU_STREAM_PER_THREAD are the special handles 0x1, 0x2.
enum { CU_STREAM_DEFAULT = 0, CU_STREAM_NON_BLOCKING = 1 };
#define EMU_CU_STREAM_LEGACY ((CUstream)0x1)
#define EMU_CU_STREAM_PER_THREAD ((CUstream)0x2)

// CUdriverProcAddressQueryResult.
enum {
  CU_GET_PROC_ADDRESS_SUCCESS = 0,
  CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
  CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
};

// CUmemLocation: since CUDA 13 `id` shares an anonymous union with
// `struct { unsigned char deviceId, localityDomainId; } localized`, so the size stays 8.
typedef struct {
  int type;
  int id;
} CUmemLocation;

typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct {
  CUmemLocation location;
  int flags;
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation is 8 bytes in cuda.h");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes in cuda.h");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes in cuda.h");

#endif  // JENGA_VMM_TESTS_CUDA_EMULATOR_CUDA_ABI_H_
