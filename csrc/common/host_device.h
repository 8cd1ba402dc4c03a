// Function qualifiers for the code the CUDA and CPU kernels share (exact_angle.cuh, philox.cuh): the CUDA
// headers' under nvcc and in the host emulation, always-inlined stand-ins under a plain C++ compiler
// (docs/cpu_backend.md, "How it works").
#pragma once

#if defined(__CUDACC__) || defined(POSENC_FAST_HOST_EMULATION)
#include "cuda/platform.cuh"
#else
#define __host__
#define __device__
// Always inlined: the CPU kernel is compiled once per instruction set, and an out-of-line copy
// of a shared function could be merged across those variants by the linker.
#define __forceinline__ inline __attribute__((always_inline))
// Read-only load (a cache hint on the GPU; a plain load on the CPU).
template <typename T>
__forceinline__ T __ldg(const T* p) {
  return *p;
}
#endif
