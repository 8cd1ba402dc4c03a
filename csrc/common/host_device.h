// Function qualifiers for the code shared by the CUDA kernels and the CPU kernel: the exact-angle
// math (exact_angle.cuh) and the dropout mask (philox.cuh).
//
// nvcc, and the host-emulation build of the CUDA kernels, take them from the CUDA headers
// (platform.cuh).  A plain C++ compiler building the CPU backend (cpu_kernels.cpp) has no CUDA
// headers: it gets stand-ins, so the same functions compile as ordinary, always-inlined C++.
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
