// The kernels' argument blocks (forward, weight gradient) and the dtype codes, shared by the CUDA core
// (posenc.h) and the CPU kernels (cpu_kernels.h): plain data, no CUDA, Python or PyTorch.
//
// y[t, :] = embed_scale * W[ids[t]]  (+)  pe_scale * PE(pos[t]), for t < num_tokens; semantics are those of
// posenc_fast/reference.py.  Pointers are device memory for the CUDA kernels, host memory for the CPU ones.
#pragma once

#include <cstdint>

namespace posenc {

// Element type codes shared with Python (exported by both bindings as FLOAT32, ...).
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
  // Dropout: out = round(keep ? value * dropout_scale : 0), value and the product in the math above.
  const int64_t* dropout_seed;  // one int64 in [0, 2^63); nullptr: no dropout
  uint32_t dropout_threshold;  // keep iff the element's Philox word >= this
  double dropout_scale;  // 1 / (1 - p), 0 for p = 1
};

// grad_W[v] = embed_scale * sum of grad_out[t, :token_width] over tokens t with ids[t] == v, summed in fp32
// in sorted order: bitwise reproducible.  With dropout, the sum takes only the elements (t, c) the forward
// kept (its mask, regenerated; dropped ones count as 0 even if not finite) and the final scale is
// embed_scale * dropout_scale.  The caller sorts (stably) the ids, with out-of-range ids replaced by the
// sentinel num_embeddings, and passes the sorted ids and the permutation.  Which rows of grad_weight the
// kernels write: posenc.h (CUDA), cpu_kernels.h (CPU).
struct WeightGradArgs {
  const void* sorted_ids;  // [num_tokens], values in [0, num_embeddings]
  DType sorted_ids_dtype;  // kInt32 (radix sorts are faster on narrow keys) or kInt64
  const int64_t* order;  // [num_tokens]: sorted_ids[i] is the id of token order[i]
  const void* grad_out;  // [num_tokens, >= token_width], unit column stride
  int64_t grad_out_row_stride;  // in elements
  DType grad_dtype;  // the weight's dtype or kFloat32
  void* grad_weight;  // [num_embeddings, token_width], contiguous
  DType weight_dtype;
  int64_t num_tokens;
  int64_t num_embeddings;
  int64_t token_width;
  int64_t padding_idx;  // < 0: none
  double embed_scale;  // applied in fp32 (rounded once, times dropout_scale with dropout) to each final sum
  const int64_t* dropout_seed;  // as in ForwardArgs; nullptr: no dropout
  uint32_t dropout_threshold;
  double dropout_scale;
};

}  // namespace posenc
