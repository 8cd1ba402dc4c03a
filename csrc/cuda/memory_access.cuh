// Element types and row-segment memory access shared by the kernels.
//
// A "span" is N consecutive elements of one row.  It moves as 16-byte vectors when its address is
// 16-byte aligned and all N elements are inside the row; otherwise element by element, touching
// only the elements inside the row.  The test is made per access, so any pointer, row stride and
// column offset is correct.
//
// Loads go into raw storage (Span) and are widened only later, so that a thread can have several
// independent loads in flight before it first waits on one.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/platform.cuh"
#include "cuda/posenc.h"

namespace posenc {

// ---- element types: widen to fp32 (exact); narrow from fp32 or float64, round to nearest even ----

template <typename T>
struct Element;

template <>
struct Element<float> {
  __device__ static float widen(float x) { return x; }
  __device__ static float narrow(float x) { return x; }
  __device__ static float narrow(double x) { return __double2float_rn(x); }
};

template <>
struct Element<__half> {
  __device__ static float widen(__half x) { return __half2float(x); }
  __device__ static __half narrow(float x) { return __float2half_rn(x); }
  __device__ static __half narrow(double x) { return __double2half(x); }  // one rounding, not via fp32
};

template <>
struct Element<__nv_bfloat16> {
  __device__ static float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 narrow(float x) { return __float2bfloat16_rn(x); }
  __device__ static __nv_bfloat16 narrow(double x) { return __double2bfloat16(x); }  // one rounding
};

// ---- spans ----

constexpr int kVectorBytes = 16;

// Elements of T in one 16-byte vector.
template <typename T>
__host__ __device__ constexpr int vector_elems() { return kVectorBytes / static_cast<int>(sizeof(T)); }

template <typename T, int N>
struct alignas(kVectorBytes) Span {
  // Whole 16-byte vectors in the span; 0 if it is not a multiple of 16 bytes (always element-wise).
  static constexpr int kBytes = static_cast<int>(N * sizeof(T));
  static constexpr int kVectors = kBytes % kVectorBytes == 0 ? kBytes / kVectorBytes : 0;
  T elems[N];
};

__device__ __forceinline__ bool is_vector_aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % kVectorBytes) == 0;
}

// Number of the N elements starting at column `col` that lie below `limit` (0..N).
template <int N>
__device__ __forceinline__ int elems_inside(int64_t col, int64_t limit) {
  const int64_t left = limit - col;
  return left >= N ? N : (left > 0 ? static_cast<int>(left) : 0);
}

// Raw load of the whole span at p, 16-byte aligned, as 16-byte vectors (read-only path).
template <typename T, int N>
__device__ __forceinline__ void load_vectors(Span<T, N>& span, const void* p) {
  static_assert(Span<T, N>::kVectors > 0, "a span of whole 16-byte vectors");
  const uint4* vectors = static_cast<const uint4*>(p);
#pragma unroll
  for (int v = 0; v < Span<T, N>::kVectors; ++v) {
    const uint4 raw = __ldg(vectors + v);
    memcpy(static_cast<void*>(&span.elems[v * vector_elems<T>()]), &raw, kVectorBytes);
  }
}

// Raw load of `count` (0..N) elements at p; elements past `count` become zero.  Read-only path
// (__ldg): the kernels never write what they read.
template <typename T, int N>
__device__ __forceinline__ void load_span(Span<T, N>& span, const T* __restrict__ p, int count) {
  if constexpr (Span<T, N>::kVectors > 0) {
    if (count == N && is_vector_aligned(p)) {
      load_vectors(span, p);
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < N; ++e) {
    span.elems[e] = e < count ? p[e] : Element<T>::narrow(0.0f);
  }
}

template <typename T, int N>
__device__ __forceinline__ void zero_span(Span<T, N>& span) {
#pragma unroll
  for (int e = 0; e < N; ++e) span.elems[e] = Element<T>::narrow(0.0f);
}

// The span's values in Math (float or double; widening is exact).
template <typename Math, typename T, int N>
__device__ __forceinline__ void widen_span(const Span<T, N>& span, Math (&values)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) values[e] = static_cast<Math>(Element<T>::widen(span.elems[e]));
}

// bf16 widens by placing its bits in the high half of an fp32 word: per 32-bit word of two elements,
// one shift and one mask, fewer instructions than the generic form.  Forward only: it makes the
// weight gradient's stage 1 spill.
template <typename Math, int N>
__device__ __forceinline__ void widen_bf16_words(const Span<__nv_bfloat16, N>& span, Math (&values)[N]) {
  static_assert(N % 2 == 0, "whole 32-bit words");
#pragma unroll
  for (int w = 0; w < N / 2; ++w) {
    uint32_t word;
    memcpy(&word, &span.elems[2 * w], sizeof word);
    const uint32_t low = word << 16, high = word & 0xFFFF0000u;
    float low_value, high_value;
    memcpy(&low_value, &low, sizeof low_value);
    memcpy(&high_value, &high, sizeof high_value);
    values[2 * w] = static_cast<Math>(low_value);
    values[2 * w + 1] = static_cast<Math>(high_value);
  }
}

// Two elements of T packed into one 32-bit word, `lo` at the lower address.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(T lo, T hi) {
  static_assert(sizeof(T) == 2, "pairs of 16-bit elements");
  uint16_t l, h;
  memcpy(&l, &lo, sizeof l);
  memcpy(&h, &hi, sizeof h);
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

// 16 bytes of T rounded from values[first .. first + vector_elems), built word by word into a uint4
// so that the store stays one 128-bit store (a byte copy into a uint4 becomes four 32-bit stores).
template <typename T, typename Math, int N>
__device__ __forceinline__ uint4 pack_vector(const Math (&values)[N], int first) {
  uint32_t words[4];
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const T x = Element<T>::narrow(values[first + w]);
      memcpy(&words[w], &x, sizeof x);
    }
  } else {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      words[w] = pack_pair(Element<T>::narrow(values[first + 2 * w]), Element<T>::narrow(values[first + 2 * w + 1]));
    }
  }
  uint4 vector;
  vector.x = words[0];
  vector.y = words[1];
  vector.z = words[2];
  vector.w = words[3];
  return vector;
}

// One 16-byte store.  On the GPU an explicit st.global.v4: the compiler may split the store of a
// uint4 built from separately computed words into four 32-bit stores.
__device__ __forceinline__ void store_vector(uint4* p, const uint4& v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#else
  *p = v;
#endif
}

// Rounds `values` (float or double) to T, to nearest even, once, and stores them all at p, 16-byte
// aligned, as 16-byte vectors.
template <typename T, typename Math, int N>
__device__ __forceinline__ void store_vectors(T* p, const Math (&values)[N]) {
  static_assert(Span<T, N>::kVectors > 0, "a span of whole 16-byte vectors");
  uint4* vectors = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int v = 0; v < Span<T, N>::kVectors; ++v) store_vector(vectors + v, pack_vector<T>(values, v * vector_elems<T>()));
}

// Rounds `values` (float or double) to T, to nearest even, once, and stores the first `count`
// (0..N) of them at p.
template <typename T, typename Math, int N>
__device__ __forceinline__ void store_span(T* __restrict__ p, const Math (&values)[N], int count) {
  if constexpr (Span<T, N>::kVectors > 0) {
    if (count == N && is_vector_aligned(p)) {
      store_vectors<T>(p, values);
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < N; ++e) {
    if (e < count) p[e] = Element<T>::narrow(values[e]);
  }
}

// ---- dtype dispatch ----

// Calls fn(T{}) with T the element type of a floating-point code; false for any other code.
template <typename Fn>
bool dispatch_float(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); return true;
    case DType::kFloat16: fn(__half{}); return true;
    case DType::kBFloat16: fn(__nv_bfloat16{}); return true;
    default: return false;
  }
}

}  // namespace posenc
