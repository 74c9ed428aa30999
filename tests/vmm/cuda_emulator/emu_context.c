// Emulated CUDA driver: initialisation, the device, the primary context and the per-thread
// context stack, streams and the work queued on them (cuMemsetD8Async), memory info.
//
// Configuration, read from the environment when the library is loaded and again by
// emu_reset (this is a test library: the package itself never reads these):
//   JENGA_VMM_EMU_DEVICE_BYTES     device memory size (default 4 GiB)
//   JENGA_VMM_EMU_GRANULARITY      minimum allocation granularity (default 2 MiB)
//   JENGA_VMM_EMU_DRIVER_VERSION   what cuDriverGetVersion reports (default 13000)
//   JENGA_VMM_EMU_POISON           0 leaves new allocations clean (default 1: dirty)

#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "emu.h"

emu_state g_emu = {.lock = PTHREAD_MUTEX_INITIALIZER, .memfd = -1};

#define EMU_MAX_CTX_DEPTH 64
static __thread struct emu_ctx* t_ctx_stack[EMU_MAX_CTX_DEPTH];
static __thread int t_ctx_depth;

int emu_grow(void** array, size_t* cap, size_t need, size_t elem_size) {
  if (need <= *cap) return 0;
  size_t grown = *cap ? *cap * 2 : 16;
  while (grown < need) grown *= 2;
  void* bigger = realloc(*array, grown * elem_size);
  if (!bigger) return -1;
  *array = bigger;
  *cap = grown;
  return 0;
}

static uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* text = getenv(name);
  if (!text || !*text) return fallback;
  char* end = NULL;
  unsigned long long value = strtoull(text, &end, 0);
  return end && *end == '\0' && value > 0 ? (uint64_t)value : fallback;
}

__attribute__((constructor)) static void read_config_at_load(void) { emu_read_config(); }

void emu_read_config(void) {
  g_emu.device_bytes = env_u64("JENGA_VMM_EMU_DEVICE_BYTES", 4ull << 30);
  g_emu.granularity = env_u64("JENGA_VMM_EMU_GRANULARITY", 2ull << 20);
  g_emu.driver_version = (int)env_u64("JENGA_VMM_EMU_DRIVER_VERSION", 13000);
  const char* poison = getenv("JENGA_VMM_EMU_POISON");
  g_emu.poison = !(poison && strcmp(poison, "0") == 0);
  g_emu.read_only_access = 1;
}

CUresult emu_enter(int kind) {
  pthread_mutex_lock(&g_emu.lock);
  // cuInit: before it, every driver function returns CUDA_ERROR_NOT_INITIALIZED.
  if (!g_emu.initialised) return CUDA_ERROR_NOT_INITIALIZED;
  // CUDA_ERROR_ILLEGAL_ADDRESS leaves the context unusable: later work gets the same error
  // (context-stack and retain/release calls still work, so the context can be reset).
  if (g_emu.sticky && kind != EMU_PLAIN_CALL) return g_emu.sticky;
  if (kind == EMU_MEMORY_CALL) {
    g_emu.num_memory_calls++;
    if (g_emu.fail_in > 0 && --g_emu.fail_in == 0) return g_emu.fail_code;
  }
  return CUDA_SUCCESS;
}

void emu_unlock(void) { pthread_mutex_unlock(&g_emu.lock); }

// ---- init and device ------------------------------------------------------------------------
EMU_EXPORT CUresult cuDriverGetVersion(int* version) {
  // cuDriverGetVersion needs no cuInit; NULL is CUDA_ERROR_INVALID_VALUE.
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_emu.lock);
  *version = g_emu.driver_version;
  pthread_mutex_unlock(&g_emu.lock);
  return CUDA_SUCCESS;
}

EMU_EXPORT CUresult cuInit(unsigned int flags) {
  // cuInit: flags must be 0; repeated calls have no further effect.
  if (flags) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&g_emu.lock);
  CUresult err = CUDA_SUCCESS;
  if (!g_emu.initialised) {
    g_emu.memfd = memfd_create("jenga-vmm-cuda-emulator", MFD_CLOEXEC);
    if (g_emu.memfd < 0) {
      err = CUDA_ERROR_OPERATING_SYSTEM;
    } else {
      g_emu.initialised = 1;
    }
  }
  pthread_mutex_unlock(&g_emu.lock);
  return err;
}

static CUresult check_device(CUdevice dev) {
  return dev == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

EMU_EXPORT CUresult cuDeviceGetCount(int* count) {
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && !count) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) *count = 1;
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  // cuDeviceGet: the ordinal must lie in [0, cuDeviceGetCount()).
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && !device) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) err = check_device(ordinal);
  if (err == CUDA_SUCCESS) *device = ordinal;
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuDeviceGetName(char* name, int length, CUdevice dev) {
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && (!name || length <= 0)) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) err = check_device(dev);
  if (err == CUDA_SUCCESS) {
    strncpy(name, EMU_DEVICE_NAME, (size_t)length - 1);
    name[length - 1] = '\0';
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && !bytes) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) err = check_device(dev);
  if (err == CUDA_SUCCESS) *bytes = g_emu.device_bytes;
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice dev) {
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && !value) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) err = check_device(dev);
  if (err == CUDA_SUCCESS) {
    switch (attribute) {
      case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
      case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
        *value = 1;
        break;
      case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
        *value = 9;
        break;
      case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
        *value = 0;
        break;
      default:
        // Not modelled: refused, so a new dependency shows up as an error, not a made-up value.
        err = CUDA_ERROR_INVALID_VALUE;
    }
  }
  emu_unlock();
  return err;
}

// ---- contexts -------------------------------------------------------------------------------
struct emu_ctx* emu_current_ctx(void) { return t_ctx_depth ? t_ctx_stack[t_ctx_depth - 1] : NULL; }

int emu_ctx_depth(void) { return t_ctx_depth; }

void emu_clear_ctx_stack(void) { t_ctx_depth = 0; }

static int ctx_is_live(struct emu_ctx* ctx) { return ctx == &g_emu.primary && ctx->retains > 0; }

// Calls that act on "the current context" return CUDA_ERROR_INVALID_CONTEXT without one.
static CUresult require_ctx(void) {
  return ctx_is_live(emu_current_ctx()) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static void run_work(struct emu_stream* stream);

long emu_destroy_all_streams(void) {
  long destroyed = g_emu.num_streams;
  while (g_emu.streams) {
    struct emu_stream* s = g_emu.streams;
    g_emu.streams = s->next;
    run_work(s);
    free(s);
  }
  run_work(&g_emu.null_stream);
  g_emu.num_streams = 0;
  return destroyed;
}

EMU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  // cuDevicePrimaryCtxRetain: retains (does not push) the device's one primary context.
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && !ctx) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) err = check_device(dev);
  if (err == CUDA_SUCCESS) {
    g_emu.primary.retains++;
    *ctx = &g_emu.primary;
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  // cuDevicePrimaryCtxRelease: releasing an unretained primary context fails with
  // CUDA_ERROR_INVALID_CONTEXT; the last release resets the context (its streams go, the
  // sticky error is cleared); it never pops the context from any thread's stack.
  pthread_mutex_lock(&g_emu.lock);
  CUresult err = g_emu.initialised ? check_device(dev) : CUDA_ERROR_NOT_INITIALIZED;
  if (err == CUDA_SUCCESS && g_emu.primary.retains == 0) err = CUDA_ERROR_INVALID_CONTEXT;
  if (err == CUDA_SUCCESS && --g_emu.primary.retains == 0) {
    emu_destroy_all_streams();
    g_emu.sticky = CUDA_SUCCESS;
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuCtxGetCurrent(CUcontext* ctx) {
  // cuCtxGetCurrent: NULL (and CUDA_SUCCESS) when no context is bound to the thread.
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && !ctx) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) *ctx = emu_current_ctx();
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && !ctx_is_live(ctx)) err = CUDA_ERROR_INVALID_CONTEXT;
  if (err == CUDA_SUCCESS && t_ctx_depth == EMU_MAX_CTX_DEPTH) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) t_ctx_stack[t_ctx_depth++] = ctx;
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* ctx) {
  // cuCtxPopCurrent: with nothing current there is nothing to pop.
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && t_ctx_depth == 0) err = CUDA_ERROR_INVALID_CONTEXT;
  if (err == CUDA_SUCCESS) {
    struct emu_ctx* top = t_ctx_stack[--t_ctx_depth];
    if (ctx) *ctx = top;
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
  // cuCtxSetCurrent: replaces the top of the thread's stack; NULL pops (no-op if empty).
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS) {
    if (!ctx) {
      if (t_ctx_depth) t_ctx_depth--;
    } else if (!ctx_is_live(ctx)) {
      err = CUDA_ERROR_INVALID_CONTEXT;
    } else if (t_ctx_depth) {
      t_ctx_stack[t_ctx_depth - 1] = ctx;
    } else {
      t_ctx_stack[t_ctx_depth++] = ctx;
    }
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuCtxGetDevice(CUdevice* device) {
  CUresult err = emu_enter(EMU_PLAIN_CALL);
  if (err == CUDA_SUCCESS && !device) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) err = require_ctx();
  if (err == CUDA_SUCCESS) *device = 0;
  emu_unlock();
  return err;
}

// ---- streams and their work -----------------------------------------------------------------
static struct emu_stream* resolve_stream(CUstream stream) {
  if (!stream || stream == EMU_CU_STREAM_LEGACY || stream == EMU_CU_STREAM_PER_THREAD)
    return &g_emu.null_stream;
  for (struct emu_stream* s = g_emu.streams; s; s = s->next) {
    if (s == stream) return s;
  }
  return NULL;
}

// Every byte of [va, va + n) read-write mapped right now?
static int writable_now(uint64_t va, uint64_t n) {
  uint64_t pos = va;
  size_t i = emu_mapping_containing(va);
  while (pos < va + n) {
    if (i >= g_emu.num_mappings) return 0;
    const emu_mapping* m = &g_emu.mappings[i];
    if (m->va > pos || m->access != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return 0;
    pos = m->va + m->size;
    ++i;
  }
  return 1;
}

static void run_work(struct emu_stream* stream) {
  while (stream->head) {
    emu_work* w = stream->head;
    stream->head = w->next;
    if (!g_emu.sticky) {
      // A kernel writing where nothing is mapped read-write faults, and the fault is sticky.
      if (writable_now(w->va, w->num_bytes)) {
        memset((void*)w->va, w->value, w->num_bytes);
      } else {
        g_emu.sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
        g_emu.num_device_faults++;
      }
    }
    free(w);
  }
  stream->tail = NULL;
}

EMU_EXPORT CUresult cuStreamCreate(CUstream* out, unsigned int flags) {
  // cuStreamCreate: CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING, in the current context.
  CUresult err = emu_enter(EMU_WORK_CALL);
  if (err == CUDA_SUCCESS &&
      (!out || (flags != CU_STREAM_DEFAULT && flags != CU_STREAM_NON_BLOCKING)))
    err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) err = require_ctx();
  if (err == CUDA_SUCCESS) {
    struct emu_stream* s = calloc(1, sizeof(*s));
    if (!s) {
      err = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      s->next = g_emu.streams;
      g_emu.streams = s;
      g_emu.num_streams++;
      *out = s;
    }
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuStreamDestroy_v2(CUstream stream) {
  // cuStreamDestroy: returns at once; pending work still completes (it runs now here).
  CUresult err = emu_enter(EMU_WORK_CALL);
  if (err == CUDA_SUCCESS) err = require_ctx();
  struct emu_stream* s = err == CUDA_SUCCESS ? resolve_stream(stream) : NULL;
  if (err == CUDA_SUCCESS && (!s || s == &g_emu.null_stream)) err = CUDA_ERROR_INVALID_HANDLE;
  if (err == CUDA_SUCCESS) {
    struct emu_stream** link = &g_emu.streams;
    while (*link != s) link = &(*link)->next;
    *link = s->next;
    run_work(s);
    free(s);
    g_emu.num_streams--;
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuStreamSynchronize(CUstream stream) {
  // cuStreamSynchronize: waits for the stream's work and reports a fault it hit.
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = require_ctx();
  struct emu_stream* s = err == CUDA_SUCCESS ? resolve_stream(stream) : NULL;
  if (err == CUDA_SUCCESS && !s) err = CUDA_ERROR_INVALID_HANDLE;
  if (err == CUDA_SUCCESS) {
    run_work(s);
    err = g_emu.sticky;
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuCtxSynchronize(void) {
  CUresult err = emu_enter(EMU_WORK_CALL);
  if (err == CUDA_SUCCESS) err = require_ctx();
  if (err == CUDA_SUCCESS) {
    run_work(&g_emu.null_stream);
    for (struct emu_stream* s = g_emu.streams; s; s = s->next) run_work(s);
    err = g_emu.sticky;
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n,
                                    CUstream stream) {
  // cuMemsetD8Async: asynchronous, in the current context; the stream must exist.
  CUresult err = emu_enter(EMU_MEMORY_CALL);
  if (err == CUDA_SUCCESS) err = require_ctx();
  struct emu_stream* s = err == CUDA_SUCCESS ? resolve_stream(stream) : NULL;
  if (err == CUDA_SUCCESS && !s) err = CUDA_ERROR_INVALID_VALUE;
  // A destination outside every reservation is not device memory at all.
  if (err == CUDA_SUCCESS && n) {
    const emu_range* r = emu_reservation_containing(dst);
    if (!r || dst + n > r->base + r->size) err = CUDA_ERROR_INVALID_VALUE;
  }
  if (err == CUDA_SUCCESS && n) {
    emu_work* w = calloc(1, sizeof(*w));
    if (!w) {
      err = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      *w = (emu_work){dst, n, value, NULL};
      if (s->tail) {
        s->tail->next = w;
      } else {
        s->head = w;
      }
      s->tail = w;
    }
  }
  emu_unlock();
  return err;
}

EMU_EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
  // cuMemGetInfo: free and total memory of the device of the current context.
  CUresult err = emu_enter(EMU_WORK_CALL);
  if (err == CUDA_SUCCESS && (!free_bytes || !total_bytes)) err = CUDA_ERROR_INVALID_VALUE;
  if (err == CUDA_SUCCESS) err = require_ctx();
  if (err == CUDA_SUCCESS) {
    uint64_t used = g_emu.bytes_used;
    *free_bytes = used >= g_emu.device_bytes ? 0 : g_emu.device_bytes - used;
    *total_bytes = g_emu.device_bytes;
  }
  emu_unlock();
  return err;
}
