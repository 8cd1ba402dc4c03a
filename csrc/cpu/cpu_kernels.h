// The framework-free interface of the CPU backend (posenc_fast._cpu): plain structs of host
// pointers, sizes and dtype codes in, an error message (nullptr: success) out.  Nothing here knows
// about Python or PyTorch; cpu_binding.cpp is the one thin caller.
//
// Semantics are those of posenc_fast/reference.py, with the algorithms of the CUDA kernels
// (posenc.h): the same exact-angle sin/cos (exact_angle.cuh), the same Philox dropout mask
// (philox.cuh), fp32 (or float64) arithmetic rounded once at the store, and a weight gradient
// summed in fp32 in sorted-token order, so bitwise reproducible whatever the thread count.
//
// cpu_kernels.cpp is compiled once per instruction-set variant (POSENC_CPU_ISA names the
// namespace: isa_baseline, isa_avx2, isa_avx512); cpu_binding.cpp picks one at run time.
#pragma once

#include <cstdint>

#include "common/forward_args.h"

namespace posenc {
namespace cpu {

// grad_W[v] = embed_scale * sum over tokens t with ids[t] == v of grad_out[t, :token_width] (fp32,
// in sorted order), as posenc::WeightGradArgs.  The caller sorts the ids stably (out-of-range ids
// become the sentinel num_embeddings).  Unlike the CUDA kernel, this one writes every row of
// grad_weight: rows no token hits, and padding_idx, become zero (the buffer needs no initial value).
struct WeightGradArgs {
  const void* sorted_ids;
  DType sorted_ids_dtype;  // kInt32 or kInt64
  const int64_t* order;  // sorted_ids[i] is the id of token order[i]
  const void* grad_out;  // [num_tokens, >= token_width], unit column stride
  int64_t grad_out_row_stride;
  DType grad_dtype;  // the weight's dtype or kFloat32
  void* grad_weight;  // [num_embeddings, token_width], contiguous; every element is written
  DType weight_dtype;
  int64_t num_tokens;
  int64_t num_embeddings;
  int64_t token_width;
  int64_t padding_idx;  // < 0: none
  double embed_scale;
  const int64_t* dropout_seed;  // nullptr: no dropout
  uint32_t dropout_threshold;
  double dropout_scale;
  int num_threads;
};

// One variant's entry points; nullptr on success, else a static message (bad dtype code).
#define POSENC_CPU_DECLARE_ISA(isa)                                  \
  namespace isa {                                                    \
  const char* forward(const ForwardArgs& args, int num_threads);     \
  const char* weight_grad(const WeightGradArgs& args);               \
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
