/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without a GPU, so that Triton's own host path
 * can run and be timed there: its JIT (compile for a named GPU, load the binary) and its launcher (the
 * argument extraction, pointer checks and the launch call) are real, and every driver call returns at once.
 *
 * Used by bench/host_overhead.py (`--entry-points`, the `triton` rows) and tests/test_triton_backend.py;
 * built by bench/fake_cuda_driver.py.  Only the entry points that Triton's NVIDIA driver module and its
 * launchers (Triton 3.5 to 3.9) call are here; a device pointer is the host address it is given, so CPU
 * tensors pass Triton's pointer check.  Nothing is ever executed: cuLaunchKernel(Ex) records the launch
 * (function, stream, grid, block, shared memory and the first words of each parameter) for a test to read, and
 * returns success.
 *
 * The device it describes is an H100 (sm_90, 132 SMs, 227 KiB of shared memory per block). */

#include <cuda.h>
#include <stdint.h>
#include <string.h>

static int fake_context;

CUresult CUDAAPI cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDriverGetVersion(int *version) { *version = 13000; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) { *device = ordinal; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }

CUresult CUDAAPI cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  (void)device;
  switch (attribute) {
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 232448; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *value = 49152; break;
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
  case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *value = 1980000; break;
  case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *value = 2619000; break;
  case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *value = 5120; break;
  default: *value = 0;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
  (void)device;
  *context = (CUcontext)&fake_context;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *context) {
  *context = (CUcontext)&fake_context;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxSetCurrent(CUcontext context) { (void)context; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetLimit(size_t *value, CUlimit limit) { (void)limit; *value = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetLimit(CUlimit limit, size_t value) { (void)limit; (void)value; return CUDA_SUCCESS; }

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **text) {
  (void)error;
  *text = "error from the stand-in CUDA driver (bench/fake_libcuda.c)";
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGetErrorName(CUresult error, const char **text) { return cuGetErrorString(error, text); }

/* Handles are never dereferenced: one per loaded binary (each compiled kernel's own, so that a test can tell
 * which kernel a launch ran), its function the next address. */
static uintptr_t fake_modules_loaded;
CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
  (void)image;
  *module = (CUmodule)(0x10000 + 16 * ++fake_modules_loaded);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleUnload(CUmodule module) { (void)module; return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
  (void)name;
  *function = (CUfunction)((uintptr_t)module + 1);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction function) {
  (void)function;
  *value = attribute == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024
           : attribute == CU_FUNC_ATTRIBUTE_NUM_REGS              ? 32
                                                                  : 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction function, CUfunction_attribute attribute, int value) {
  (void)function; (void)attribute; (void)value;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetCacheConfig(CUfunction function, CUfunc_cache config) {
  (void)function; (void)config;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuOccupancyMaxActiveClusters(int *clusters, CUfunction function, const CUlaunchConfig *config) {
  (void)function; (void)config;
  *clusters = 1;
  return CUDA_SUCCESS;
}

/* Host memory is device memory here: a pointer's device address is itself.  (The only attribute Triton
 * asks for; the others, whose values have other widths, are not answered.) */
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr pointer) {
  if (attribute != CU_POINTER_ATTRIBUTE_DEVICE_POINTER) return CUDA_ERROR_NOT_SUPPORTED;
  *(CUdeviceptr *)data = pointer;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuPointerGetAttributes(unsigned int count, CUpointer_attribute *attributes, void **data,
                                        CUdeviceptr pointer) {
  for (unsigned int i = 0; i < count; ++i) {
    CUresult status = cuPointerGetAttribute(data[i], attributes[i], pointer);
    if (status != CUDA_SUCCESS) return status;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
  (void)stream;
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

/* The last launch, for tests: grid, block, shared memory, and the first parameters' values (a test names
 * their sizes in bytes, at most 8 each: pointers and scalars; it must name no more parameters than every
 * kernel launched meanwhile has, since each is read from the launch's own parameter array). */
#define FAKE_MAX_PARAMS 64
struct fake_launch {
  uint64_t launches;
  uint32_t grid[3], block[3], shared_bytes;
  uint32_t num_params;
  uint64_t params[FAKE_MAX_PARAMS];
  uint64_t function; /* the CUfunction launched (which compiled kernel) */
  uint64_t stream;
};
struct fake_launch fake_last_launch;
static uint32_t fake_params_recorded = 0; /* how many parameters to record: set by a test (0: none) */
static uint8_t fake_param_sizes[FAKE_MAX_PARAMS];

void fake_record_params(uint32_t count, const uint8_t *sizes) {
  fake_params_recorded = count < FAKE_MAX_PARAMS ? count : FAKE_MAX_PARAMS;
  for (uint32_t i = 0; i < fake_params_recorded; ++i) fake_param_sizes[i] = sizes[i] <= 8 ? sizes[i] : 8;
}

static void record(CUfunction function, CUstream stream, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                   unsigned by, unsigned bz, unsigned shared, void **params) {
  fake_last_launch.launches += 1;
  fake_last_launch.function = (uint64_t)(uintptr_t)function;
  fake_last_launch.stream = (uint64_t)(uintptr_t)stream;
  fake_last_launch.grid[0] = gx; fake_last_launch.grid[1] = gy; fake_last_launch.grid[2] = gz;
  fake_last_launch.block[0] = bx; fake_last_launch.block[1] = by; fake_last_launch.block[2] = bz;
  fake_last_launch.shared_bytes = shared;
  fake_last_launch.num_params = fake_params_recorded;
  for (uint32_t i = 0; i < fake_params_recorded; ++i) {
    fake_last_launch.params[i] = 0;
    memcpy(&fake_last_launch.params[i], params[i], fake_param_sizes[i]);
  }
}

CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction function, void **params, void **extra) {
  (void)extra;
  record(function, config->hStream, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
         config->blockDimY, config->blockDimZ, config->sharedMemBytes, params);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLaunchKernel(CUfunction function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, unsigned shared, CUstream stream, void **params, void **extra) {
  (void)extra;
  record(function, stream, gx, gy, gz, bx, by, bz, shared, params);
  return CUDA_SUCCESS;
}
