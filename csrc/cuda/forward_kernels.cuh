// The forward kernel template: gather the token row, compute the exact-angle sinusoid in registers, add or
// concatenate, round once, store (design: docs/cuda_backend.md, "Forward").  forward_fp32.cu, forward_fp16.cu
// and forward_bf16.cu each instantiate one weight dtype (to compile in parallel); forward.cu dispatches.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/exact_angle.cuh"
#include "cuda/memory_access.cuh"
#include "common/philox.cuh"
#include "cuda/platform.cuh"
#include "cuda/posenc.h"

namespace posenc {
namespace forward_detail {

constexpr int kThreads = 256;

// Units across x of a concat block (tokens fill y).  A concat row has units of two kinds, and a PE unit
// issues about three times a copy unit's instructions: with the whole row across x, each block waits on
// the warp that holds its PE units.  -DPOSENC_CONCAT_UNITS_X=32 (one warp of units, so that the warps of
// a block take alike) is the variant bench/cuda_forward_ab.py times against this default.
#ifndef POSENC_CONCAT_UNITS_X
#define POSENC_CONCAT_UNITS_X kThreads
#endif

// __launch_bounds__'s minimum blocks per multiprocessor, which caps the registers per thread at
// 65536 / (kThreads * blocks).  The 2-byte kernels with fp32 math and no dropout run faster capped
// at 64 registers (4 blocks); the others would spill under that cap.  -DPOSENC_FORWARD_MIN_BLOCKS=N
// sets the 2-byte kernels' value (for bench/cuda_forward_ab.py).
#ifndef POSENC_FORWARD_MIN_BLOCKS
#define POSENC_FORWARD_MIN_BLOCKS 4
#endif
template <typename T, typename Math, bool kDropout>
__host__ __device__ constexpr int forward_min_blocks() {
  return (sizeof(T) == 2 && sizeof(Math) == 4 && !kDropout) ? POSENC_FORWARD_MIN_BLOCKS : 1;
}

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
  // t / seq_len = mulhi(t, seq_magic) >> seq_shift for t < 2^31, when 1 < seq_len < 2^31 (the
  // positions' incremental path): Granlund and Montgomery's round-up multiplier, set on the host.
  uint32_t seq_magic;
  uint32_t seq_shift;
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
  // vector_path_holds, proved on the host: every span then moves as 16-byte vectors with no
  // per-access test, and an in-range id's row offset is the 32-bit id times weight_row_bytes.
  bool vector_path;
  uint32_t weight_row_bytes;
  int64_t out_row_bytes;
  Math embed_scale;
  Math pe_scale;
  bool add_tokens;
  const int64_t* dropout_seed;  // read only by the kDropout kernels
  uint32_t dropout_threshold;
  Math dropout_scale;
};

// Tokens per thread (block layouts move two spans per token).  Consecutive, so that their ids,
// positions and output rows are one base plus constant offsets.
template <bool kInterleaved>
__host__ __device__ constexpr int tokens_per_thread() { return kInterleaved ? 4 : 2; }

// Elements of one PE unit: one 16-byte vector, or two for 4-byte types, so that every dtype spreads
// the per-token work (id, position, row addresses) over the same number of pairs.
template <typename T>
__host__ __device__ constexpr int pe_unit_elems() { return sizeof(T) == 4 ? 2 * vector_elems<T>() : vector_elems<T>(); }

// ids of a thread's tokens first + k (k < K); -1 (no row) for the tokens past the end, k >= live.
template <typename IdT, int K, typename Args>
__device__ __forceinline__ void load_ids(const Args& a, int64_t first, int live, int64_t (&id)[K]) {
  const IdT* ids = static_cast<const IdT*>(a.ids) + first;
  if (live == K) {  // all but the last thread of the grid: no predicates
#pragma unroll
    for (int k = 0; k < K; ++k) id[k] = static_cast<int64_t>(__ldg(ids + k));
    return;
  }
  // The last thread reads the first id again in place of those past the end (K loads here too).
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t loaded = __ldg(ids + (k < live ? k : 0));
    id[k] = k < live ? loaded : -1;
  }
}

template <typename Args>
__device__ __forceinline__ bool id_in_table(const Args& a, int64_t id) {
  // One unsigned compare: negative ids (dead tokens: -1) wrap above any table size and read nothing.
  return static_cast<uint64_t>(id) < static_cast<uint64_t>(a.num_embeddings);
}

template <typename Args>
__device__ __forceinline__ int64_t token_position(const Args& a, int64_t token) {
  if (a.positions != nullptr) return __ldg(a.positions + token);
  int64_t sequence, within;
  if (((static_cast<uint64_t>(token) | static_cast<uint64_t>(a.seq_len)) >> 32) == 0) {
    // 32-bit division is much cheaper than 64-bit, and covers every realistic batch.
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

// Positions start + within, start + within + 1, ... of one sequence (seq_len s) from a scalar start.
template <int K>
__device__ __forceinline__ void stepped_positions(int64_t start, uint32_t within, uint32_t s, int64_t (&position)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (k > 0 && ++within == s) within = 0;  // the next sequence starts at the same offset
    position[k] = static_cast<int64_t>(static_cast<uint64_t>(start) + within);
  }
}

// The same with each sequence's own start (offsets[sequence], from `starts` on), read for the
// tokens k < live only.
template <int K>
__device__ __forceinline__ void stepped_positions(const int64_t* starts, uint32_t within, uint32_t s, int live,
                                                  int64_t (&position)[K]) {
  uint32_t sequence = 0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (k > 0 && ++within == s) {
      within = 0;
      ++sequence;
    }
    const int64_t start = k < live ? __ldg(starts + sequence) : 0;
    position[k] = static_cast<int64_t>(static_cast<uint64_t>(start) + within);
  }
}

// Positions of a thread's tokens first + k (k < K; tokens k >= live are past the end and get a
// position that is never stored).  Only the first token divides: the others step its (sequence,
// within) forward by one, which crosses at most one sequence boundary when seq_len > 1.
// kPositions (explicit positions) is a kernel of its own so that the computed path has no branch on it.
template <int K, bool kPositions, typename Args>
__device__ __forceinline__ void token_positions(const Args& a, int64_t first, int live, int64_t (&position)[K]) {
  if constexpr (kPositions) {
    const int64_t* positions = a.positions + first;
#pragma unroll
    for (int k = 0; k < K; ++k) position[k] = k < live ? __ldg(positions + k) : 0;
    return;
  }
  const bool incremental =
      a.seq_len > 1 && ((static_cast<uint64_t>(first) | static_cast<uint64_t>(a.seq_len)) >> 31) == 0;
  if (!incremental) {
#pragma unroll
    for (int k = 0; k < K; ++k) position[k] = token_position(a, k < live ? first + k : first);
    return;
  }
  // 32-bit: first and seq_len are below 2^31, so within + 1 < 2^32, and the host's multiplier
  // (seq_magic, seq_shift) divides first exactly.
  const uint32_t s = static_cast<uint32_t>(a.seq_len);
  const uint32_t sequence =
      static_cast<uint32_t>((static_cast<uint64_t>(static_cast<uint32_t>(first)) * a.seq_magic) >> 32) >> a.seq_shift;
  const uint32_t within = static_cast<uint32_t>(first) - sequence * s;
  // Two loops, so that a scalar offset's path holds no (predicated) offsets load.
  if (a.offsets == nullptr) {
    stepped_positions<K>(a.offset, within, s, position);
  } else {
    stepped_positions<K>(a.offsets + sequence, within, s, live, position);
  }
}

// Bit k set iff token k's id is pe_zero_id (fairseq: padding gets no PE).  Taken right after the
// loads are issued, so that the ids need not stay live through the PE math.
template <int K, typename Args>
__device__ __forceinline__ uint32_t zero_pe_tokens(const Args& a, const int64_t (&id)[K]) {
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < K; ++k) bits |= static_cast<uint32_t>(a.pe_zero_id >= 0 && id[k] == a.pe_zero_id) << k;
  return bits;
}

// A PE unit's K tokens (the tokens k < live from `first`): their ids and positions.
template <typename IdT, int K, bool kPositions, typename Args>
__device__ __forceinline__ void load_tokens(const Args& a, int64_t first, int live, int64_t (&id)[K],
                                            int64_t (&position)[K]) {
  load_ids<IdT>(a, first, live, id);
  token_positions<K, kPositions>(a, first, live, position);
}

// body(k, scale, first_row) for each live token k of a PE unit: `scale` is its PE scale (0 for a pe_zero_id
// token), `first_row` the PE columns of the unit's first token in out (out_at(a, first_row, k, col)).  Called
// once the unit's loads are issued, so that the ids need not stay live through the PE math.
template <int K, typename T, typename Math, typename Body>
__device__ __forceinline__ void for_each_token(const KernelArgs<T, Math>& a, const int64_t (&id)[K], int64_t first,
                                               int live, Body body) {
  const uint32_t zero_pe = zero_pe_tokens(a, id);
  T* first_row = a.out + first * a.out_row_stride + a.pe_col0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (k >= live) break;
    body(k, (zero_pe >> k) & 1u ? Math(0) : a.pe_scale, first_row);
  }
}

// Fixed-point rates of N pair slots from `pair0`; slots without a frequency get rate 0 (sin 0 = 0).
// kVector: the host proved the turns 16-byte aligned and every unit's slots below num_turns, and
// N and pair0 are even: N / 2 16-byte loads.
template <bool kVector, int N, typename Args>
__device__ __forceinline__ void load_rates(const Args& a, int64_t pair0, int64_t (&rate)[N]) {
  if constexpr (kVector) {
    static_assert(N % 2 == 0, "rates in pairs");
    const uint4* turns = reinterpret_cast<const uint4*>(a.turns + pair0);
#pragma unroll
    for (int v = 0; v < N / 2; ++v) {
      const uint4 raw = __ldg(turns + v);
      memcpy(&rate[2 * v], &raw, sizeof raw);
    }
  } else {
#pragma unroll
    for (int p = 0; p < N; ++p) rate[p] = pair0 + p < a.num_turns ? __ldg(a.turns + pair0 + p) : 0;
  }
}

// Token columns [col, col + count) of K tokens' weight rows (zero for dead tokens and out-of-range
// ids).  kVector: the vector path's precondition holds and count == N.
template <bool kVector, typename T, int N, int K, typename Args>
__device__ __forceinline__ void load_token_spans(const Args& a, const int64_t (&id)[K], int64_t col, int count,
                                                 Span<T, N> (&w)[K]) {
  const T* base = a.weight + col;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!id_in_table(a, id[k])) {
      zero_span(w[k]);
    } else if constexpr (kVector) {
      load_vectors(w[k], reinterpret_cast<const char*>(base) +
                             static_cast<uint64_t>(static_cast<uint32_t>(id[k])) * a.weight_row_bytes);
    } else {
      load_span(w[k], base + id[k] * a.weight_row_stride, count);
    }
  }
}

template <typename T, typename Math>
__device__ __forceinline__ T* out_at(const KernelArgs<T, Math>& a, T* first_row, int k, int64_t col) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(first_row + col) + k * a.out_row_bytes);
}

template <bool kVector, typename T, typename Math, int N>
__device__ __forceinline__ void put_span(T* p, const Math (&values)[N], int count) {
  if constexpr (kVector) {
    store_vectors<T>(p, values);
  } else {
    store_span(p, values, count);
  }
}

// Dropout keep bits of one span (output columns [col, col + count)) of K tokens' rows.  Called
// right after the loads are issued, so that Philox runs while they are in flight and only K words
// stay live through the PE math.
template <bool kDropout, int N, int K, typename Args>
__device__ __forceinline__ void span_keep_bits(const Args& a, const DropoutMask& mask, int64_t first, int live,
                                               int64_t col, int count, uint32_t (&keep)[K]) {
  if constexpr (kDropout) {
#pragma unroll
    for (int k = 0; k < K; ++k) keep[k] = k < live ? mask.keep_bits<N>(first + k, col, count) : 0u;
  }
}

template <bool kDropout, typename Math, int N>
__device__ __forceinline__ void drop_span(uint32_t keep, Math scale, Math (&values)[N]) {
  if constexpr (kDropout) apply_keep_bits(values, keep, scale);
}

// concat: out[t, col:col+V] = embed_scale * W[id, col:col+V].
template <bool kVector, typename T, typename Math, typename IdT, int K, bool kDropout>
__device__ __forceinline__ void copy_token_columns(const KernelArgs<T, Math>& a, const DropoutMask& mask,
                                                   int64_t unit, int64_t first, int live) {
  constexpr int V = vector_elems<T>();
  const int64_t col = unit * V;
  const int count = kVector ? V : elems_inside<V>(col, a.token_width);
  int64_t id[K];
  load_ids<IdT>(a, first, live, id);
  Span<T, V> w[K];
  load_token_spans<kVector>(a, id, col, count, w);
  uint32_t keep[K];
  span_keep_bits<kDropout, V>(a, mask, first, live, col, count, keep);
  T* first_row = a.out + first * a.out_row_stride;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (k >= live) break;
    Math values[V];
    widen_span(w[k], values);
#pragma unroll
    for (int e = 0; e < V; ++e) values[e] *= a.embed_scale;
    drop_span<kDropout>(keep[k], a.dropout_scale, values);
    put_span<kVector>(out_at(a, first_row, k, col), values, count);
  }
}

// values = fma(token, embed_scale, pe * scale), the sum in Math, rounded later at the store.
template <typename Math, typename T, int N>
__device__ __forceinline__ void add_tokens(const Span<T, N>& w, Math embed_scale, Math (&values)[N]) {
  Math tokens[N];
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    widen_bf16_words(w, tokens);
  } else {
    widen_span(w, tokens);
  }
#pragma unroll
  for (int e = 0; e < N; ++e) values[e] = fma(tokens[e], embed_scale, values[e]);
}

// Interleaved layout: PE columns [col, col + N) hold sin, cos of pairs col/2 .. col/2 + N/2.
template <bool kVector, bool kAdd, typename T, typename Math, typename IdT, int K, bool kDropout, bool kPositions>
__device__ __forceinline__ void interleaved_pe_columns(const KernelArgs<T, Math>& a, const DropoutMask& mask,
                                                       int64_t pe_unit, int64_t first, int live) {
  constexpr int N = pe_unit_elems<T>();
  constexpr int P = N / 2;
  const int64_t col = pe_unit * N;
  // An odd D's tail cos (column D) falls outside (never with kVector: the host proved D % N == 0).
  const int count = kVector ? N : elems_inside<N>(col, a.pe_width);
  int64_t rate[P];
  load_rates<kVector>(a, pe_unit * P, rate);
  int64_t id[K], position[K];
  load_tokens<IdT, K, kPositions>(a, first, live, id, position);
  Span<T, N> w[K];
  if constexpr (kAdd) load_token_spans<kVector>(a, id, col, count, w);
  uint32_t keep[K];
  span_keep_bits<kDropout, N>(a, mask, first, live, a.pe_col0 + col, count, keep);
  for_each_token(a, id, first, live, [&](int k, Math scale, T* first_row) {
    Math values[N];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      Math s, c;
      sin_cos_of_turns(phase_of(position[k], rate[p]), s, c);
      // An odd D's tail cos (column D) is past `count`: never stored, so no mask.
      values[2 * p] = s * scale;
      values[2 * p + 1] = c * scale;
    }
    if constexpr (kAdd) add_tokens(w[k], a.embed_scale, values);
    drop_span<kDropout>(keep[k], a.dropout_scale, values);
    put_span<kVector>(out_at(a, first_row, k, col), values, count);
  });
}

// Block layouts: pair slots [pair0, pair0 + N) put their sins at sin_base + i (i < num_sin) and
// their coses at cos_base + i (i < num_cos; a slot at or past h is a zero column).
template <bool kVector, bool kAdd, typename T, typename Math, typename IdT, int K, bool kDropout, bool kPositions>
__device__ __forceinline__ void block_pe_columns(const KernelArgs<T, Math>& a, const DropoutMask& mask,
                                                 int64_t pe_unit, int64_t first, int live) {
  constexpr int N = pe_unit_elems<T>();
  const int64_t pair0 = pe_unit * N;
  // With kVector the host proved num_sin == num_cos == h, a multiple of N: every span is whole.
  const int sin_count = kVector ? N : elems_inside<N>(pair0, a.num_sin);
  const int cos_count = kVector ? N : elems_inside<N>(pair0, a.num_cos);
  const int64_t sin_col = a.sin_base + pair0, cos_col = a.cos_base + pair0;
  int64_t rate[N];
  load_rates<kVector>(a, pair0, rate);
  int64_t id[K], position[K];
  load_tokens<IdT, K, kPositions>(a, first, live, id, position);
  // Slots at or past h have a zero cos column: the count of slots with a cos, once per thread.
  const int with_cos = kVector ? N : elems_inside<N>(pair0, a.num_pairs);
  Span<T, N> w_sin[K], w_cos[K];
  if constexpr (kAdd) {
    load_token_spans<kVector>(a, id, sin_col, sin_count, w_sin);
    load_token_spans<kVector>(a, id, cos_col, cos_count, w_cos);
  }
  uint32_t keep_sin[K], keep_cos[K];
  span_keep_bits<kDropout, N>(a, mask, first, live, a.pe_col0 + sin_col, sin_count, keep_sin);
  span_keep_bits<kDropout, N>(a, mask, first, live, a.pe_col0 + cos_col, cos_count, keep_cos);
  for_each_token(a, id, first, live, [&](int k, Math scale, T* first_row) {
    Math sins[N], coses[N];
#pragma unroll
    for (int p = 0; p < N; ++p) {
      Math s, c;
      sin_cos_of_turns(phase_of(position[k], rate[p]), s, c);
      sins[p] = s * scale;
      coses[p] = p < with_cos ? c * scale : Math(0);
    }
    if constexpr (kAdd) {
      add_tokens(w_sin[k], a.embed_scale, sins);
      add_tokens(w_cos[k], a.embed_scale, coses);
    }
    drop_span<kDropout>(keep_sin[k], a.dropout_scale, sins);
    drop_span<kDropout>(keep_cos[k], a.dropout_scale, coses);
    put_span<kVector>(out_at(a, first_row, k, sin_col), sins, sin_count);
    put_span<kVector>(out_at(a, first_row, k, cos_col), coses, cos_count);
  });
}

// One thread's unit of K tokens (the tokens k < live), on the vector path or the general one.
template <bool kVector, int K, typename T, typename Math, typename IdT, bool kInterleaved, bool kDropout, bool kPositions>
__device__ __forceinline__ void forward_unit(const KernelArgs<T, Math>& a, const DropoutMask& mask, int64_t unit,
                                             int64_t first, int live) {
  if (unit < a.num_copy_units) {
    copy_token_columns<kVector, T, Math, IdT, K, kDropout>(a, mask, unit, first, live);
    return;
  }
  const int64_t pe_unit = unit - a.num_copy_units;
  // One branch on the uniform add_tokens, so that the weight loads and the sums sit on the same side
  // of a single test (as bench/sass_report.py's hot-path search expects).
  if constexpr (kInterleaved) {
    if (a.add_tokens) {
      interleaved_pe_columns<kVector, true, T, Math, IdT, K, kDropout, kPositions>(a, mask, pe_unit, first, live);
    } else {
      interleaved_pe_columns<kVector, false, T, Math, IdT, K, kDropout, kPositions>(a, mask, pe_unit, first, live);
    }
  } else {
    if (a.add_tokens) {
      block_pe_columns<kVector, true, T, Math, IdT, K, kDropout, kPositions>(a, mask, pe_unit, first, live);
    } else {
      block_pe_columns<kVector, false, T, Math, IdT, K, kDropout, kPositions>(a, mask, pe_unit, first, live);
    }
  }
}

// Grid: (token groups, unit blocks); block: (units, tokens).  Thread (x, y) of block (bx, by) has
// unit by * blockDim.x + x of the K tokens from (bx * blockDim.y + y) * K.  No shared memory and no
// barriers, so a thread without a unit or a token simply returns.
template <typename T, typename Math, typename IdT, bool kInterleaved, bool kDropout, bool kPositions>
__global__ void __launch_bounds__(kThreads, (forward_min_blocks<T, Math, kDropout>())) forward_kernel(const KernelArgs<T, Math> a) {
  constexpr int K = tokens_per_thread<kInterleaved>();
  const int64_t unit = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y) * K;
  if (unit >= a.num_units || first >= a.num_tokens) return;
  const int64_t left = a.num_tokens - first;
  const int live = left < K ? static_cast<int>(left) : K;  // tokens of this thread before the end
  DropoutMask mask{};
  // Loaded first, so its latency hides behind the id and weight loads; first used at the stores.
  if constexpr (kDropout) mask = DropoutMask::load(a.dropout_seed, a.dropout_threshold);
  if (a.vector_path) {
    forward_unit<true, K, T, Math, IdT, kInterleaved, kDropout, kPositions>(a, mask, unit, first, live);
  } else {
    // The fallback for unaligned or ragged shapes takes one token at a time, so that it neither
    // raises the kernel's register count (float64 math would spill) nor doubles its code.
#pragma unroll 1
    for (int k = 0; k < live; ++k) {
      forward_unit<false, 1, T, Math, IdT, kInterleaved, kDropout, kPositions>(a, mask, unit, first + k, 1);
    }
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// For 1 < d < 2^31: m = ceil(2^(31 + l) / d), l = ceil(log2 d), so that 2^(31+l) <= m d <= 2^(31+l)
// + 2^l and floor(n / d) = floor(n m / 2^(31 + l)) for every n < 2^31 (Granlund and Montgomery,
// "Division by invariant integers using multiplication", theorem 4.2); m < 2^32.  Other d: unused.
inline void division_multiplier(int64_t d, uint32_t& magic, uint32_t& shift) {
  magic = 0;
  shift = 0;
  if (d <= 1 || d >= (int64_t(1) << 31)) return;
  uint32_t l = 0;
  while ((int64_t(1) << l) < d) ++l;
  magic = static_cast<uint32_t>(((uint64_t(1) << (31 + l)) + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
  shift = l - 1;
}

inline bool vector_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }

// The vector path's precondition (KernelArgs::vector_path): 16-byte aligned weight, output and turns,
// a rate for every pair slot, rows and the PE's first column on 16-byte boundaries, every unit's spans
// whole (D a multiple of the PE unit; block layouts: h sins and h coses, h a multiple of N), and every
// in-range id's row offset a 32-bit id times a 32-bit byte stride.
template <typename T>
bool vector_path_holds(const ForwardArgs& args, int64_t width, bool interleaved) {
  constexpr int64_t V = vector_elems<T>(), N = pe_unit_elems<T>();
  const int64_t h = args.pe_width / 2;
  const bool pe_whole = interleaved ? args.pe_width % N == 0
                                    : (args.pe_width % 2 == 0 && h % N == 0 && args.columns.num_sin == h &&
                                       args.columns.num_cos == h && args.columns.sin_base % V == 0 &&
                                       args.columns.cos_base % V == 0);
  const int64_t slots = interleaved ? args.pe_width / 2 : h;  // pair slots the PE units cover
  return vector_aligned(args.weight) && vector_aligned(args.out) && vector_aligned(args.turns) &&
         args.num_turns >= slots && args.weight_row_stride % V == 0 &&
         width % V == 0 && args.token_width % V == 0 && pe_whole &&
         args.num_embeddings <= (int64_t(1) << 32) &&
         static_cast<uint64_t>(args.weight_row_stride) * sizeof(T) <= UINT32_MAX;
}

template <typename T, typename Math, typename IdT, bool kInterleaved, bool kDropout, bool kPositions>
cudaError_t launch_kernel(const ForwardArgs& args, cudaStream_t stream) {
  constexpr int V = vector_elems<T>(), N = pe_unit_elems<T>();
  constexpr int K = tokens_per_thread<kInterleaved>();
  const int64_t width = args.concat ? args.token_width + args.pe_width : args.token_width;
  const int64_t pair_slots = args.pe_width - args.pe_width / 2;  // ceil(D / 2): includes an odd D's tail
  const int64_t num_copy_units = args.concat ? ceil_div(args.token_width, V) : 0;
  const int64_t num_pe_units = kInterleaved ? ceil_div(args.pe_width, N) : ceil_div(pair_slots, N);

  KernelArgs<T, Math> a;
  a.ids = args.ids;
  a.weight = static_cast<const T*>(args.weight);
  a.out = static_cast<T*>(args.out);
  a.turns = args.turns;
  a.positions = args.positions;
  a.offsets = args.offsets;
  a.offset = args.offset;
  a.seq_len = args.seq_len;
  division_multiplier(args.seq_len, a.seq_magic, a.seq_shift);
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
  a.vector_path = vector_path_holds<T>(args, width, kInterleaved);
  a.weight_row_bytes = a.vector_path ? static_cast<uint32_t>(args.weight_row_stride * sizeof(T)) : 0;
  a.out_row_bytes = width * static_cast<int64_t>(sizeof(T));
  a.embed_scale = static_cast<Math>(args.embed_scale);  // fp32 math: the scales rounded to fp32, as in Triton
  a.pe_scale = static_cast<Math>(args.pe_scale);
  a.add_tokens = !args.concat;
  a.dropout_seed = args.dropout_seed;
  a.dropout_threshold = args.dropout_threshold;
  a.dropout_scale = static_cast<Math>(args.dropout_scale);  // fp32 math: rounded to fp32, like the other scales

  // All units of a row across x (up to the block size, or POSENC_CONCAT_UNITS_X; no idle lanes for
  // widths like 768), as many tokens across y as fill the block.
  const int64_t units_cap = args.concat ? POSENC_CONCAT_UNITS_X : kThreads;
  const int64_t units_x = a.num_units < units_cap ? a.num_units : units_cap;
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
