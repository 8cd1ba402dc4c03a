// The one place the kernels meet the platform: kernel launch, and (only for tests) a host stand-in.
//
// Built by nvcc, `launch` is an ordinary <<<grid, block, 0, stream>>> launch followed by the launch
// check.  Built by a host C++ compiler with POSENC_FAST_HOST_EMULATION (csrc/cuda/emulation/), the same
// kernel code runs on the CPU, one thread after another; the kernels use no shared memory and no
// barriers, so this is their exact semantics.  That lets machines without a GPU test the kernels'
// indexing, layouts and numerics against the reference (tests/test_cuda_build.py).
#pragma once

#include <cuda_runtime_api.h>

#ifdef POSENC_FAST_HOST_EMULATION
#include "cuda/emulation/host_platform.h"
#endif

namespace posenc {

template <typename Args>
cudaError_t launch(void (*kernel)(Args), dim3 grid, dim3 block, cudaStream_t stream, const Args& args) {
#ifdef POSENC_FAST_HOST_EMULATION
  (void)stream;
  return emulation::run_grid(kernel, grid, block, args);
#else
  kernel<<<grid, block, 0, stream>>>(args);
  return cudaGetLastError();
#endif
}

}  // namespace posenc
