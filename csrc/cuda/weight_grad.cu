// Weight gradient, deterministic and sort-based, in two stages (design: docs/cuda_backend.md, "Weight
// gradient"; docs/design.md, "Backward").  The caller sorts the ids stably.  With dropout (kDropout), stage 1
// zeroes each element the forward dropped as the row is read; a thread's first column is a multiple of its 4 or 8
// columns, so its groups of four are whole.
#include <cstdint>

#include "cuda/memory_access.cuh"
#include "common/philox.cuh"
#include "cuda/platform.cuh"
#include "cuda/posenc.h"

namespace posenc {
namespace {

constexpr int kGradThreads = 128;
constexpr int kRowsInFlight = 8;  // grad_out rows loaded per thread before they are summed

struct GradKernelArgs {
  const void* sorted_ids;  // KeyT: int32 or int64
  const int64_t* order;
  const void* grad_out;
  int64_t grad_out_row_stride;
  void* grad_weight;
  float* partials;
  int64_t num_tokens;
  int64_t num_embeddings;
  int64_t token_width;
  int64_t padding_idx;
  int64_t chunk;
  int64_t num_chunks;
  float embed_scale;  // times the dropout scale with dropout
  const int64_t* dropout_seed;  // read only by the kDropout stage 1
  uint32_t dropout_threshold;
};

// Sorted id i, widened to 64 bits (id * token_width can pass 2^31).
template <typename KeyT>
__device__ __forceinline__ int64_t sorted_id(const GradKernelArgs& a, int64_t i) {
  return static_cast<int64_t>(__ldg(static_cast<const KeyT*>(a.sorted_ids) + i));
}

__device__ __forceinline__ bool writable(const GradKernelArgs& a, int64_t id) {
  return id != a.padding_idx && id < a.num_embeddings;  // never the padding row or the sentinel
}

template <typename W, int N>
__device__ __forceinline__ void store_gradient(const GradKernelArgs& a, int64_t id, int64_t col, int count,
                                               const float (&sum)[N]) {
  float scaled[N];
#pragma unroll
  for (int e = 0; e < N; ++e) scaled[e] = sum[e] * a.embed_scale;
  store_span(static_cast<W*>(a.grad_weight) + id * a.token_width + col, scaled, count);
}

__device__ __forceinline__ float* partial_row(const GradKernelArgs& a, int64_t chunk, int slot) {
  return a.partials + (chunk * 2 + slot) * a.token_width;
}

// Block: (column spans, chunks); grid: (chunk groups, column blocks).
template <typename G, typename W, typename KeyT, bool kDropout>
__global__ void __launch_bounds__(kGradThreads) grad_chunk_kernel(const GradKernelArgs a) {
  constexpr int V = vector_elems<G>();
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (col >= a.token_width || chunk >= a.num_chunks) return;
  const int count = elems_inside<V>(col, a.token_width);
  const G* grad_out = static_cast<const G*>(a.grad_out) + col;
  const int64_t start = chunk * a.chunk;
  const int64_t end = start + a.chunk < a.num_tokens ? start + a.chunk : a.num_tokens;

  DropoutMask mask{};
  if constexpr (kDropout) mask = DropoutMask::load(a.dropout_seed, a.dropout_threshold);
  int64_t current = sorted_id<KeyT>(a, start);
  bool started_here = start == 0 || sorted_id<KeyT>(a, start - 1) != current;
  float sum[V];
#pragma unroll
  for (int e = 0; e < V; ++e) sum[e] = 0.0f;

  for (int64_t group = start; group < end; group += kRowsInFlight) {
    Span<G, V> rows[kRowsInFlight];
    uint32_t keep[kRowsInFlight];
#pragma unroll
    for (int g = 0; g < kRowsInFlight; ++g) {
      if (group + g < end) {
        const int64_t token = __ldg(a.order + group + g);
        load_span(rows[g], grad_out + token * a.grad_out_row_stride, count);
        if constexpr (kDropout) keep[g] = mask.keep_bits<V>(token, col, count);
      }
    }
#pragma unroll
    for (int g = 0; g < kRowsInFlight; ++g) {
      const int64_t i = group + g;
      if (i >= end) break;
      float row[V];
      widen_span(rows[g], row);
      if constexpr (kDropout) zero_dropped(row, keep[g]);
#pragma unroll
      for (int e = 0; e < V; ++e) sum[e] += row[e];
      const bool is_last = i == end - 1;
      const int64_t next = i + 1 < a.num_tokens ? sorted_id<KeyT>(a, i + 1) : -1;
      if (next != current || is_last) {  // the run of `current` ends here (in this chunk)
        const bool continues_after = is_last && next == current;
        if (started_here && !continues_after) {
          if (writable(a, current)) store_gradient<W>(a, current, col, count, sum);
        } else {
          store_span(partial_row(a, chunk, started_here ? 1 : 0) + col, sum, count);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) sum[e] = 0.0f;
        started_here = true;
        current = next;
      }
    }
  }
}

template <typename W, typename KeyT>
__global__ void __launch_bounds__(kGradThreads) grad_carry_kernel(const GradKernelArgs a) {
  constexpr int V = vector_elems<W>();
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (col >= a.token_width || chunk >= a.num_chunks) return;
  const int count = elems_inside<V>(col, a.token_width);
  const int64_t start = chunk * a.chunk;
  const int64_t end = start + a.chunk < a.num_tokens ? start + a.chunk : a.num_tokens;
  if (end >= a.num_tokens) return;  // nothing crosses the last chunk's end
  const int64_t run_id = sorted_id<KeyT>(a, end - 1);
  if (sorted_id<KeyT>(a, end) != run_id) return;  // no run crosses this chunk's end
  const bool started_before = start > 0 && sorted_id<KeyT>(a, start) == run_id &&
                              sorted_id<KeyT>(a, start - 1) == run_id;
  if (started_before || !writable(a, run_id)) return;  // owned by an earlier chunk, or never written

  // The run's last token: gallop from this chunk's end, then bisect (ids are sorted, so "== run_id"
  // holds on one contiguous range): O(log run length) dependent loads.
  int64_t inside = end;  // sorted_ids[inside] == run_id
  int64_t outside = a.num_tokens;  // first index known past the run
  for (int64_t step = a.chunk;; step *= 2) {
    const int64_t probe = inside + step;
    if (probe >= a.num_tokens) break;
    if (sorted_id<KeyT>(a, probe) != run_id) {
      outside = probe;
      break;
    }
    inside = probe;
  }
  while (outside - inside > 1) {
    const int64_t middle = inside + (outside - inside) / 2;
    if (sorted_id<KeyT>(a, middle) == run_id) {
      inside = middle;
    } else {
      outside = middle;
    }
  }
  const int64_t last_chunk = inside / a.chunk;

  // Slot 1 of this chunk, then slot 0 of each later chunk the run reaches, added in chunk order.
  constexpr int kInFlight = 32 / V;
  Span<float, V> partial[kInFlight];
  float sum[V], more[V];
  load_span(partial[0], partial_row(a, chunk, 1) + col, count);
  widen_span(partial[0], sum);
  for (int64_t base = chunk + 1; base <= last_chunk; base += kInFlight) {
#pragma unroll
    for (int g = 0; g < kInFlight; ++g) {
      if (base + g <= last_chunk) load_span(partial[g], partial_row(a, base + g, 0) + col, count);
    }
#pragma unroll
    for (int g = 0; g < kInFlight; ++g) {
      if (base + g > last_chunk) break;
      widen_span(partial[g], more);
#pragma unroll
      for (int e = 0; e < V; ++e) sum[e] += more[e];
    }
  }
  store_gradient<W>(a, run_id, col, count, sum);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Column spans of `span_elems` across x (all of a row's, up to the block size), chunks across y.
cudaError_t launch_over_chunks(void (*kernel)(GradKernelArgs), const GradKernelArgs& a, int span_elems,
                               cudaStream_t stream) {
  const int64_t spans = ceil_div(a.token_width, span_elems);
  const int64_t spans_x = spans < kGradThreads ? spans : kGradThreads;
  const int64_t chunks_y = kGradThreads / spans_x;
  const int64_t grid_x = ceil_div(a.num_chunks, chunks_y);
  const int64_t grid_y = ceil_div(spans, spans_x);
  if (grid_x > INT32_MAX || grid_y > 65535) return cudaErrorInvalidConfiguration;
  return launch(kernel, dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)),
                dim3(static_cast<unsigned>(spans_x), static_cast<unsigned>(chunks_y)), stream, a);
}

template <typename G, typename W, typename KeyT>
cudaError_t launch_stages(const GradKernelArgs& a, cudaStream_t stream) {
  cudaError_t status = a.dropout_seed != nullptr
                           ? launch_over_chunks(grad_chunk_kernel<G, W, KeyT, true>, a, vector_elems<G>(), stream)
                           : launch_over_chunks(grad_chunk_kernel<G, W, KeyT, false>, a, vector_elems<G>(), stream);
  if (status != cudaSuccess) return status;
  return launch_over_chunks(grad_carry_kernel<W, KeyT>, a, vector_elems<W>(), stream);
}

template <typename G, typename W>
cudaError_t launch_typed(const GradKernelArgs& a, DType key_dtype, cudaStream_t stream) {
  if (key_dtype == DType::kInt32) return launch_stages<G, W, int32_t>(a, stream);
  if (key_dtype == DType::kInt64) return launch_stages<G, W, int64_t>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_weight_grad(const WeightGradArgs& args, float* partials, int64_t chunk, cudaStream_t stream) {
  if (args.num_tokens < 0 || args.num_embeddings < 0 || args.token_width < 0 || chunk < 1) {
    return cudaErrorInvalidValue;
  }
  if (args.num_tokens == 0 || args.num_embeddings == 0 || args.token_width == 0) return cudaSuccess;
  GradKernelArgs a;
  a.sorted_ids = args.sorted_ids;
  a.order = args.order;
  a.grad_out = args.grad_out;
  a.grad_out_row_stride = args.grad_out_row_stride;
  a.grad_weight = args.grad_weight;
  a.partials = partials;
  a.num_tokens = args.num_tokens;
  a.num_embeddings = args.num_embeddings;
  a.token_width = args.token_width;
  a.padding_idx = args.padding_idx;
  a.chunk = chunk;
  a.num_chunks = ceil_div(args.num_tokens, chunk);
  // The dropout scale joins the final scaling: the product in double, rounded to fp32 once.
  a.embed_scale = static_cast<float>(args.dropout_seed != nullptr ? args.embed_scale * args.dropout_scale
                                                                  : args.embed_scale);
  a.dropout_seed = args.dropout_seed;
  a.dropout_threshold = args.dropout_threshold;

  // The gradient arrives in the weight's dtype, or (converted by the caller) in fp32.
  cudaError_t status = cudaErrorInvalidValue;
  const bool known = dispatch_float(args.weight_dtype, [&](auto element) {
    using W = decltype(element);
    if (args.grad_dtype == args.weight_dtype) {
      status = launch_typed<W, W>(a, args.sorted_ids_dtype, stream);
    } else if (args.grad_dtype == DType::kFloat32) {
      status = launch_typed<float, W>(a, args.sorted_ids_dtype, stream);
    }
  });
  return known ? status : cudaErrorInvalidValue;
}

}  // namespace posenc
