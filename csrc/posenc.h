// The framework-free interface of the CUDA core: plain structs of device pointers, sizes and
// dtype codes in, a cudaError_t out.  Nothing here knows about Python or PyTorch; the pybind11
// binding (binding.cpp) is one thin caller, and any other framework could be another.
//
// Semantics are those of posenc_fast/reference.py, with the same algorithms as the Triton
// backend (posenc_fast/backends/triton_kernels.py): exact-angle phases from fixed-point turns,
// fp32 accumulation with one round-to-nearest-even at the store, and a deterministic
// sort-based weight gradient.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace posenc {

// Element type codes shared with Python (exported by the binding as _C.FLOAT32, ...).
enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kInt32 = 3,
  kInt64 = 4,
};

// Where each pair's sin and cos land in the PE (posenc_fast._spec.PEColumns).
struct PEColumns {
  bool interleaved;  // sin of pair i at column 2i, cos at 2i + 1
  int64_t sin_base;  // block layouts: sin of pair i at sin_base + i, for i < num_sin
  int64_t num_sin;
  int64_t cos_base;  // cos of pair i at cos_base + i, for i < num_cos (slot i >= D / 2 is a zero column)
  int64_t num_cos;
};

// y[t, :] = embed_scale * W[ids[t]]  (+)  pe_scale * PE(pos[t]), for t < num_tokens.
struct ForwardArgs {
  const void* ids;  // [num_tokens], int32 or int64 (ids_dtype)
  DType ids_dtype;
  const void* weight;  // [num_embeddings, token_width], unit column stride
  int64_t weight_row_stride;  // in elements
  DType dtype;  // of weight and out: kFloat32, kFloat16 or kBFloat16
  void* out;  // [num_tokens, width], contiguous; width = token_width (+ pe_width if concat)
  const int64_t* turns;  // R_i = round(w_i / 2pi * 2^64) as two's complement; num_turns of them
  int64_t num_turns;
  // Position of token t: positions[t] if positions, else offsets[t / seq_len] + t % seq_len if
  // offsets, else offset + t % seq_len (int64, wrapping).
  const int64_t* positions;
  const int64_t* offsets;
  int64_t offset;
  int64_t seq_len;  // >= 1
  int64_t num_tokens;
  int64_t num_embeddings;  // ids outside [0, num_embeddings) read nothing: a zero token vector
  int64_t token_width;
  int64_t pe_width;  // D; h = D / 2 (sin, cos) pairs
  bool concat;  // false: add (pe_width == token_width)
  PEColumns columns;
  int64_t pe_zero_id;  // tokens with this id get no PE; < 0: none
  double embed_scale;  // used in fp32, or in float64 with float64_math
  double pe_scale;
  // PE and sum in float64 (longer polynomials), rounded once to the output dtype; else fp32.
  bool float64_math;
};

// Launches the forward kernel on `stream`; returns the launch status (cudaSuccess for 0 tokens).
cudaError_t launch_forward(const ForwardArgs& args, cudaStream_t stream);

// grad_W[v] = embed_scale * sum of grad_out[t, :token_width] over tokens t with ids[t] == v,
// summed in fp32 in sorted order: bitwise reproducible.  The caller sorts (stably) the ids,
// with out-of-range ids replaced by the sentinel num_embeddings, and passes the sorted ids and
// the permutation.  Rows that no token hits, padding_idx and the sentinel are never written, so
// grad_weight must come zero-filled.
struct WeightGradArgs {
  const void* sorted_ids;  // [num_tokens], values in [0, num_embeddings]
  DType sorted_ids_dtype;  // kInt32 (radix sorts are faster on narrow keys) or kInt64
  const int64_t* order;  // [num_tokens]: sorted_ids[i] is the id of token order[i]
  const void* grad_out;  // [num_tokens, >= token_width], unit column stride
  int64_t grad_out_row_stride;  // in elements
  DType grad_dtype;
  void* grad_weight;  // [num_embeddings, token_width], contiguous, zero-filled
  DType weight_dtype;
  float* partials;  // [ceil(num_tokens / chunk), 2, token_width] fp32 scratch (no initial value needed)
  int64_t num_tokens;
  int64_t num_embeddings;
  int64_t token_width;
  int64_t padding_idx;  // < 0: none
  float embed_scale;
  int64_t chunk;  // sorted tokens per stage-1 work item, >= 1
};

// Launches both stages of the weight gradient on `stream`; returns the launch status.
cudaError_t launch_weight_grad(const WeightGradArgs& args, cudaStream_t stream);

// Number of fp32 partial rows launch_weight_grad needs: 2 per chunk.
inline int64_t weight_grad_partial_rows(int64_t num_tokens, int64_t chunk) {
  return 2 * ((num_tokens + chunk - 1) / chunk);
}

}  // namespace posenc
