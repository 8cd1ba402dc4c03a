// Host stand-ins for the few CUDA built-ins the kernels use, for POSENC_FAST_HOST_EMULATION builds:
// the kernels of csrc/ compiled by a host C++ compiler and run on the CPU, one thread after another
// (see csrc/cuda/platform.cuh).  Test-only: the shipped extension never includes this file.
#pragma once

#include <math.h>  // float overloads of fma in the global namespace, as CUDA has them

#include <cstdint>

#include <cuda_runtime_api.h>

#define __launch_bounds__(...)

// The launch geometry of the thread being emulated.
inline thread_local dim3 gridDim, blockDim, blockIdx, threadIdx;

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

inline float __double2float_rn(double x) { return static_cast<float>(x); }  // the host rounds to nearest even

namespace posenc {
namespace emulation {

template <typename Args>
cudaError_t run_grid(void (*kernel)(Args), dim3 grid, dim3 block, const Args& args) {
  if (block.x * block.y * block.z == 0 || block.x * block.y * block.z > 1024) return cudaErrorInvalidConfiguration;
  gridDim = grid;
  blockDim = block;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx)
        for (unsigned tz = 0; tz < block.z; ++tz)
          for (unsigned ty = 0; ty < block.y; ++ty)
            for (unsigned tx = 0; tx < block.x; ++tx) {
              blockIdx = dim3(bx, by, bz);
              threadIdx = dim3(tx, ty, tz);
              kernel(args);
            }
  return cudaSuccess;
}

}  // namespace emulation
}  // namespace posenc
