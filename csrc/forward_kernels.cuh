// Forward kernel: gather the token row, compute the exact-angle sinusoid in registers, add or
// concatenate, round once, store.  One pass over memory; no table of positions exists.
//
// Work decomposition.  A row of the output is cut into "units", each one thread's share of a row:
//   - concat token columns: 16 bytes of consecutive token columns (scaled copy of W);
//   - interleaved PE: 16 bytes of consecutive PE columns, i.e. the (sin, cos) of vector_elems / 2
//     pairs, so each pair's sincos is computed once and both values are used;
//   - block PE (split layouts): vector_elems pair slots, whose sins and coses are two 16-byte
//     spans of the row (sin_base + i and cos_base + i), again one sincos per pair.
// In add mode a PE unit also reads the token columns it overwrites.  A block of threads covers
// consecutive units of a row in x (coalesced 16-byte accesses) and tokens in y; each thread
// handles the same unit of K tokens and issues all their loads before it uses any of them, so
// that several independent 16-byte loads are in flight per thread.
//
// Every token, row and column index is 64-bit: outputs beyond 2^31 elements are addressed exactly.
//
// Fused dropout (kDropout, docs/cuda_backend.md "Dropout"): each span of output columns of a token
// gets its keep bits from Philox (philox.cuh), one call per group of four columns it touches, and
// is scaled or zeroed in Math just before its store.  The mask depends only on (token, column), so
// no unit needs another's words; a span that does not start on a group (concat PE columns start
// at token_width, the split layouts' spans at sin_base / cos_base) takes one call more.
//
// This header holds the templates; forward_fp32.cu, forward_fp16.cu and forward_bf16.cu each
// instantiate one weight dtype (so they compile in parallel), forward.cu dispatches.
#pragma once

#include <cstdint>

#include "exact_angle.cuh"
#include "memory_access.cuh"
#include "philox.cuh"
#include "platform.cuh"
#include "posenc.h"

namespace posenc {
namespace forward_detail {

constexpr int kThreads = 256;

// Launchers of one weight dtype (defined in forward_<dtype>.cu).
cudaError_t launch_fp32(const ForwardArgs& args, cudaStream_t stream);
cudaError_t launch_fp16(const ForwardArgs& args, cudaStream_t stream);
cudaError_t launch_bf16(const ForwardArgs& args, cudaStream_t stream);

// Math: the arithmetic of the PE and the sum (float, or double for float64_math).
template <typename T, typename Math>
struct KernelArgs {
  const void* ids;
  const T* weight;
  T* out;
  const int64_t* turns;
  const int64_t* positions;
  const int64_t* offsets;
  int64_t offset;
  int64_t seq_len;
  int64_t num_tokens;
  int64_t num_embeddings;
  int64_t weight_row_stride;
  int64_t out_row_stride;
  int64_t token_width;
  int64_t pe_width;
  int64_t num_pairs;  // h = D / 2: pair slots at or past it have a zero cos
  int64_t num_turns;  // slots at or past it have rate 0 (an odd D's zero tail)
  int64_t pe_col0;  // first output column of the PE: token_width (concat) or 0 (add)
  int64_t sin_base;
  int64_t num_sin;
  int64_t cos_base;
  int64_t num_cos;
  int64_t pe_zero_id;
  int64_t num_copy_units;  // concat: units of token columns, first in each row
  int64_t num_units;
  Math embed_scale;
  Math pe_scale;
  bool add_tokens;
  const int64_t* dropout_seed;  // read only by the kDropout kernels
  uint32_t dropout_threshold;
  Math dropout_scale;
};

// Tokens each thread handles (loads in flight per thread): block layouts move two spans per token.
template <bool kInterleaved>
__host__ __device__ constexpr int tokens_per_thread() { return kInterleaved ? 4 : 2; }

template <typename IdT, int K, typename Args>
__device__ __forceinline__ void load_ids(const Args& a, int64_t first, int64_t step, int64_t (&token)[K],
                                         int64_t (&id)[K]) {
  const IdT* ids = static_cast<const IdT*>(a.ids);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    token[k] = first + k * step;
    id[k] = token[k] < a.num_tokens ? static_cast<int64_t>(__ldg(ids + token[k])) : -1;
  }
}

template <typename Args>
__device__ __forceinline__ bool id_in_table(const Args& a, int64_t id) {
  return id >= 0 && id < a.num_embeddings;  // out-of-range ids (range check off) read nothing
}

template <typename Args>
__device__ __forceinline__ int64_t token_position(const Args& a, int64_t token) {
  if (a.positions != nullptr) return __ldg(a.positions + token);
  int64_t sequence, within;
  if (((static_cast<uint64_t>(token) | static_cast<uint64_t>(a.seq_len)) >> 32) == 0) {
    // 32-bit division is several times cheaper than 64-bit, and covers every realistic batch.
    const uint32_t t = static_cast<uint32_t>(token), s = static_cast<uint32_t>(a.seq_len);
    const uint32_t q = t / s;
    sequence = q;
    within = t - q * s;
  } else {
    sequence = token / a.seq_len;
    within = token - sequence * a.seq_len;
  }
  const int64_t start = a.offsets != nullptr ? __ldg(a.offsets + sequence) : a.offset;
  // Wraps like torch's int64 addition.
  return static_cast<int64_t>(static_cast<uint64_t>(start) + static_cast<uint64_t>(within));
}

// Positions of a thread's tokens first + k * step (k < K; zero for tokens past the end).  Only the
// first token divides: the others step its (sequence, within) forward by `step`, which crosses at
// most one sequence boundary when step < seq_len (always, but for tiny sequences).
// kPositions: explicit positions (a.positions), a kernel of its own so that the computed positions'
// path has no branch on it.
template <int K, bool kPositions, typename Args>
__device__ __forceinline__ void token_positions(const Args& a, const int64_t (&token)[K], int64_t (&position)[K]) {
  if constexpr (kPositions) {
#pragma unroll
    for (int k = 0; k < K; ++k) position[k] = token[k] < a.num_tokens ? __ldg(a.positions + token[k]) : 0;
    return;
  }
  const int64_t step = K > 1 ? token[1] - token[0] : 0;
  const bool incremental = step < a.seq_len &&
                           ((static_cast<uint64_t>(token[0]) | static_cast<uint64_t>(a.seq_len)) >> 31) == 0;
  if (!incremental) {
    // Tokens past the end take the last token's position (never stored); no branch per token.
#pragma unroll
    for (int k = 0; k < K; ++k) position[k] = token_position(a, token[k] < a.num_tokens ? token[k] : a.num_tokens - 1);
    return;
  }
  // 32-bit: token[0] and seq_len are below 2^31, so within + step < 2^32.
  const uint32_t s = static_cast<uint32_t>(a.seq_len), step32 = static_cast<uint32_t>(step);
  uint32_t sequence = static_cast<uint32_t>(token[0]) / s;
  uint32_t within = static_cast<uint32_t>(token[0]) - sequence * s;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (k > 0) {
      within += step32;
      if (within >= s) {
        within -= s;
        ++sequence;
      }
    }
    int64_t start = a.offset;
    if (a.offsets != nullptr) start = token[k] < a.num_tokens ? __ldg(a.offsets + sequence) : 0;
    // Wraps like torch's int64 addition.
    position[k] = static_cast<int64_t>(static_cast<uint64_t>(start) + within);
  }
}

template <typename T, typename Math>
__device__ __forceinline__ Math pe_scale_of(const KernelArgs<T, Math>& a, int64_t id) {
  return (a.pe_zero_id >= 0 && id == a.pe_zero_id) ? Math(0) : a.pe_scale;  // fairseq: padding gets no PE
}

// Fixed-point rates of N pair slots from `pair0`; slots without a frequency get rate 0 (sin 0 = 0).
template <int N, typename Args>
__device__ __forceinline__ void load_rates(const Args& a, int64_t pair0, int64_t (&rate)[N]) {
#pragma unroll
  for (int p = 0; p < N; ++p) rate[p] = pair0 + p < a.num_turns ? __ldg(a.turns + pair0 + p) : 0;
}

// Token columns of K tokens' weight rows at `col` (zero for dead tokens and out-of-range ids).
template <typename T, int V, int K, typename Args>
__device__ __forceinline__ void load_token_spans(const Args& a, const int64_t (&token)[K], const int64_t (&id)[K],
                                                 int64_t col, int count, Span<T, V> (&w)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (token[k] < a.num_tokens && id_in_table(a, id[k])) {
      load_span(w[k], a.weight + id[k] * a.weight_row_stride + col, count);
    } else {
      zero_span(w[k]);
    }
  }
}

// Dropout keep bits of one span (output columns [col, col + count)) of K tokens' rows.  Called
// right after the loads are issued: Philox is pure arithmetic and runs while they are in flight,
// and only K words stay live through the PE math.
template <bool kDropout, int N, int K, typename Args>
__device__ __forceinline__ void span_keep_bits(const Args& a, const DropoutMask& mask, const int64_t (&token)[K],
                                               int64_t col, int count, uint32_t (&keep)[K]) {
  if constexpr (kDropout) {
#pragma unroll
    for (int k = 0; k < K; ++k) keep[k] = token[k] < a.num_tokens ? mask.keep_bits<N>(token[k], col, count) : 0u;
  }
}

template <bool kDropout, typename Math, int N>
__device__ __forceinline__ void drop_span(uint32_t keep, Math scale, Math (&values)[N]) {
  if constexpr (kDropout) apply_keep_bits(values, keep, scale);
}

// concat: out[t, col:col+V] = embed_scale * W[id, col:col+V].
template <typename T, typename Math, typename IdT, int K, bool kDropout>
__device__ __forceinline__ void copy_token_columns(const KernelArgs<T, Math>& a, const DropoutMask& mask,
                                                   int64_t unit, int64_t first, int64_t step) {
  constexpr int V = vector_elems<T>();
  const int64_t col = unit * V;
  const int count = elems_inside<V>(col, a.token_width);
  int64_t token[K], id[K];
  load_ids<IdT>(a, first, step, token, id);
  Span<T, V> w[K];
  load_token_spans(a, token, id, col, count, w);
  uint32_t keep[K];
  span_keep_bits<kDropout, V>(a, mask, token, col, count, keep);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (token[k] >= a.num_tokens) continue;
    Math values[V];
    widen_span(w[k], values);
#pragma unroll
    for (int e = 0; e < V; ++e) values[e] *= a.embed_scale;
    drop_span<kDropout>(keep[k], a.dropout_scale, values);
    store_span(a.out + token[k] * a.out_row_stride + col, values, count);
  }
}

// Interleaved layout: PE columns [col, col + V) hold sin, cos of pairs col/2 .. col/2 + V/2.
template <typename T, typename Math, typename IdT, int K, bool kDropout, bool kPositions>
__device__ __forceinline__ void interleaved_pe_columns(const KernelArgs<T, Math>& a, const DropoutMask& mask,
                                                       int64_t pe_unit, int64_t first, int64_t step) {
  constexpr int V = vector_elems<T>();
  constexpr int P = V / 2;
  const int64_t col = pe_unit * V;
  const int count = elems_inside<V>(col, a.pe_width);  // an odd D's tail cos (column D) falls outside
  const int64_t pair0 = pe_unit * P;
  int64_t rate[P];
  load_rates(a, pair0, rate);
  int64_t token[K], id[K], position[K];
  load_ids<IdT>(a, first, step, token, id);
  token_positions<K, kPositions>(a, token, position);
  Span<T, V> w[K];
  if (a.add_tokens) load_token_spans(a, token, id, col, count, w);
  uint32_t keep[K];
  span_keep_bits<kDropout, V>(a, mask, token, a.pe_col0 + col, count, keep);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (token[k] >= a.num_tokens) continue;
    const Math scale = pe_scale_of(a, id[k]);
    Math values[V];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      Math s, c;
      sin_cos_of_turns(phase_of(position[k], rate[p]), s, c);
      // An odd D's tail cos (column D) is past `count`: never stored, so no mask.
      values[2 * p] = s * scale;
      values[2 * p + 1] = c * scale;
    }
    if (a.add_tokens) {
      Math tokens[V];
      widen_span(w[k], tokens);
#pragma unroll
      for (int e = 0; e < V; ++e) values[e] = fma(tokens[e], a.embed_scale, values[e]);
    }
    drop_span<kDropout>(keep[k], a.dropout_scale, values);
    store_span(a.out + token[k] * a.out_row_stride + a.pe_col0 + col, values, count);
  }
}

// Block layouts: pair slots [pair0, pair0 + V) put their sins at sin_base + i (i < num_sin) and
// their coses at cos_base + i (i < num_cos; a slot at or past h is a zero column).
template <typename T, typename Math, typename IdT, int K, bool kDropout, bool kPositions>
__device__ __forceinline__ void block_pe_columns(const KernelArgs<T, Math>& a, const DropoutMask& mask,
                                                 int64_t pe_unit, int64_t first, int64_t step) {
  constexpr int V = vector_elems<T>();
  const int64_t pair0 = pe_unit * V;
  const int sin_count = elems_inside<V>(pair0, a.num_sin);
  const int cos_count = elems_inside<V>(pair0, a.num_cos);
  const int64_t sin_col = a.sin_base + pair0, cos_col = a.cos_base + pair0;
  int64_t rate[V];
  load_rates(a, pair0, rate);
  int64_t token[K], id[K], position[K];
  load_ids<IdT>(a, first, step, token, id);
  token_positions<K, kPositions>(a, token, position);
  // Slots at or past h have a zero cos column: the count of slots with a cos, once per thread.
  const int with_cos = elems_inside<V>(pair0, a.num_pairs);
  Span<T, V> w_sin[K], w_cos[K];
  if (a.add_tokens) {
    load_token_spans(a, token, id, sin_col, sin_count, w_sin);
    load_token_spans(a, token, id, cos_col, cos_count, w_cos);
  }
  uint32_t keep_sin[K], keep_cos[K];
  span_keep_bits<kDropout, V>(a, mask, token, a.pe_col0 + sin_col, sin_count, keep_sin);
  span_keep_bits<kDropout, V>(a, mask, token, a.pe_col0 + cos_col, cos_count, keep_cos);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (token[k] >= a.num_tokens) continue;
    const Math scale = pe_scale_of(a, id[k]);
    Math sins[V], coses[V];
#pragma unroll
    for (int p = 0; p < V; ++p) {
      Math s, c;
      sin_cos_of_turns(phase_of(position[k], rate[p]), s, c);
      sins[p] = s * scale;
      coses[p] = p < with_cos ? c * scale : Math(0);
    }
    if (a.add_tokens) {
      Math tokens[V];
      widen_span(w_sin[k], tokens);
#pragma unroll
      for (int e = 0; e < V; ++e) sins[e] = fma(tokens[e], a.embed_scale, sins[e]);
      widen_span(w_cos[k], tokens);
#pragma unroll
      for (int e = 0; e < V; ++e) coses[e] = fma(tokens[e], a.embed_scale, coses[e]);
    }
    drop_span<kDropout>(keep_sin[k], a.dropout_scale, sins);
    drop_span<kDropout>(keep_cos[k], a.dropout_scale, coses);
    T* row = a.out + token[k] * a.out_row_stride + a.pe_col0;
    store_span(row + sin_col, sins, sin_count);
    store_span(row + cos_col, coses, cos_count);
  }
}

// Grid: (token groups, unit blocks); block: (units, tokens).  No shared memory and no barriers,
// so a thread without a unit simply returns.
template <typename T, typename Math, typename IdT, bool kInterleaved, bool kDropout, bool kPositions>
__global__ void __launch_bounds__(kThreads) forward_kernel(const KernelArgs<T, Math> a) {
  constexpr int K = tokens_per_thread<kInterleaved>();
  const int64_t unit = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (unit >= a.num_units) return;
  const int64_t step = blockDim.y;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * (step * K) + threadIdx.y;
  DropoutMask mask{};
  // Loaded first, so its latency hides behind the id and weight loads; first used at the stores.
  if constexpr (kDropout) mask = DropoutMask::load(a.dropout_seed, a.dropout_threshold);
  if (unit < a.num_copy_units) {
    copy_token_columns<T, Math, IdT, K, kDropout>(a, mask, unit, first, step);
  } else if constexpr (kInterleaved) {
    interleaved_pe_columns<T, Math, IdT, K, kDropout, kPositions>(a, mask, unit - a.num_copy_units, first, step);
  } else {
    block_pe_columns<T, Math, IdT, K, kDropout, kPositions>(a, mask, unit - a.num_copy_units, first, step);
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T, typename Math, typename IdT, bool kInterleaved, bool kDropout, bool kPositions>
cudaError_t launch_kernel(const ForwardArgs& args, cudaStream_t stream) {
  constexpr int V = vector_elems<T>();
  constexpr int K = tokens_per_thread<kInterleaved>();
  const int64_t width = args.concat ? args.token_width + args.pe_width : args.token_width;
  const int64_t pair_slots = args.pe_width - args.pe_width / 2;  // ceil(D / 2): includes an odd D's tail
  const int64_t num_copy_units = args.concat ? ceil_div(args.token_width, V) : 0;
  const int64_t num_pe_units = kInterleaved ? ceil_div(args.pe_width, V) : ceil_div(pair_slots, V);

  KernelArgs<T, Math> a;
  a.ids = args.ids;
  a.weight = static_cast<const T*>(args.weight);
  a.out = static_cast<T*>(args.out);
  a.turns = args.turns;
  a.positions = args.positions;
  a.offsets = args.offsets;
  a.offset = args.offset;
  a.seq_len = args.seq_len;
  a.num_tokens = args.num_tokens;
  a.num_embeddings = args.num_embeddings;
  a.weight_row_stride = args.weight_row_stride;
  a.out_row_stride = width;
  a.token_width = args.token_width;
  a.pe_width = args.pe_width;
  a.num_pairs = args.pe_width / 2;
  a.num_turns = args.num_turns;
  a.pe_col0 = args.concat ? args.token_width : 0;
  a.sin_base = args.columns.sin_base;
  a.num_sin = args.columns.num_sin;
  a.cos_base = args.columns.cos_base;
  a.num_cos = args.columns.num_cos;
  a.pe_zero_id = args.pe_zero_id;
  a.num_copy_units = num_copy_units;
  a.num_units = num_copy_units + num_pe_units;
  a.embed_scale = static_cast<Math>(args.embed_scale);  // fp32 math: the scales rounded to fp32, as in Triton
  a.pe_scale = static_cast<Math>(args.pe_scale);
  a.add_tokens = !args.concat;
  a.dropout_seed = args.dropout_seed;
  a.dropout_threshold = args.dropout_threshold;
  a.dropout_scale = static_cast<Math>(args.dropout_scale);  // fp32 math: rounded to fp32, like the other scales

  // All units of a row across x (up to the block size; no idle lanes for widths like 768), as many
  // tokens across y as fill the block.
  const int64_t units_x = a.num_units < kThreads ? a.num_units : kThreads;
  const int64_t tokens_y = kThreads / units_x;
  const int64_t grid_x = ceil_div(args.num_tokens, tokens_y * K);
  const int64_t grid_y = ceil_div(a.num_units, units_x);
  if (grid_x > INT32_MAX || grid_y > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  const dim3 block(static_cast<unsigned>(units_x), static_cast<unsigned>(tokens_y));
  return launch(forward_kernel<T, Math, IdT, kInterleaved, kDropout, kPositions>, grid, block, stream, a);
}

// Dispatch on the runtime choices that change the generated code: math, ids dtype, layout, dropout,
// explicit positions.
template <typename T, typename Math, typename IdT, bool kPositions>
cudaError_t launch_for_positions(const ForwardArgs& args, cudaStream_t stream) {
  const bool interleaved = args.columns.interleaved;
  if (args.dropout_seed != nullptr) {
    return interleaved ? launch_kernel<T, Math, IdT, true, true, kPositions>(args, stream)
                       : launch_kernel<T, Math, IdT, false, true, kPositions>(args, stream);
  }
  return interleaved ? launch_kernel<T, Math, IdT, true, false, kPositions>(args, stream)
                     : launch_kernel<T, Math, IdT, false, false, kPositions>(args, stream);
}

template <typename T, typename Math, typename IdT>
cudaError_t launch_for_types(const ForwardArgs& args, cudaStream_t stream) {
  return args.positions != nullptr ? launch_for_positions<T, Math, IdT, true>(args, stream)
                                   : launch_for_positions<T, Math, IdT, false>(args, stream);
}

template <typename T>
cudaError_t launch_for_dtype(const ForwardArgs& args, cudaStream_t stream) {
  const bool ids64 = args.ids_dtype == DType::kInt64;
  if (!ids64 && args.ids_dtype != DType::kInt32) return cudaErrorInvalidValue;
  if (args.float64_math) {
    return ids64 ? launch_for_types<T, double, int64_t>(args, stream)
                 : launch_for_types<T, double, int32_t>(args, stream);
  }
  return ids64 ? launch_for_types<T, float, int64_t>(args, stream) : launch_for_types<T, float, int32_t>(args, stream);
}

}  // namespace forward_detail
}  // namespace posenc
