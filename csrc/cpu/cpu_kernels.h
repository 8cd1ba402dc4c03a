// The framework-free interface of the CPU kernels: the argument blocks of common/kernel_args.h in, an error
// message (nullptr: success) out; cpu_binding.cpp is the one caller.  Design: docs/cpu_backend.md.
// cpu_kernels.cpp is compiled once per instruction set (POSENC_CPU_ISA names the namespace).
#pragma once

#include <cstdint>

#include "common/kernel_args.h"

namespace posenc {
namespace cpu {

// The weight gradient (posenc::WeightGradArgs) on num_threads threads.  Unlike the CUDA kernel, this one
// writes every row of grad_weight: rows no token hits, and padding_idx, become zero (the buffer needs no
// initial value).
struct CpuWeightGradArgs : WeightGradArgs {
  int num_threads;
};

// One variant's entry points; nullptr on success, else a static message (bad dtype code).
#define POSENC_CPU_DECLARE_ISA(isa)                                  \
  namespace isa {                                                    \
  const char* forward(const ForwardArgs& args, int num_threads);     \
  const char* weight_grad(const CpuWeightGradArgs& args);            \
  }
POSENC_CPU_DECLARE_ISA(isa_baseline)
POSENC_CPU_DECLARE_ISA(isa_avx2)
POSENC_CPU_DECLARE_ISA(isa_avx512)
#undef POSENC_CPU_DECLARE_ISA

// Runs fn(context, begin, end) over [0, num_items) in chunks of about `grain` items, on up to
// num_threads threads (the caller's included); returns when all are done.  The split never
// changes a result: every item is computed independently.  Defined in cpu_binding.cpp (one
// thread pool for every variant).
void parallel_for(int64_t num_items, int64_t grain, int num_threads, void (*fn)(void*, int64_t, int64_t),
                  void* context);

}  // namespace cpu
}  // namespace posenc
