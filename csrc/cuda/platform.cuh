// The one place the kernels meet the platform: the kernel launch, or, built by a host C++ compiler with
// POSENC_FAST_HOST_EMULATION (tests without a GPU: docs/cuda_backend.md, "Tests"), the same kernels run on the
// CPU one thread after another.
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
