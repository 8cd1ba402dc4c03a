// Philox4x32-10 and the fused dropout's keep mask (posenc_fast/reference.py: philox4x32_10,
// dropout_keep; docs/cuda_backend.md, "Dropout").
//
// Philox (Salmon et al., SC 2011) is counter-based: its words are a pure function of (counter, key),
// so the mask is recomputed wherever it is needed (forward, weight gradient) and never stored.  Same
// rounds and constants as Random123 and cuRAND, written out so that no curand header is needed.
//
// The mask: element (t, c) of the flat output [N, width] (c counts the token columns first in
// concat mode) is kept iff word c % 4 of Philox(counter (c / 4, t mod 2^32, t >> 32, 0), key
// (seed mod 2^32, seed >> 32)) is >= threshold.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace posenc {

struct PhiloxKey {
  uint32_t k0, k1;
};

struct PhiloxWords {
  uint32_t word[4];
};

constexpr uint32_t kPhiloxMultiplier0 = 0xD2511F53u;
constexpr uint32_t kPhiloxMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxKeyIncrement0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxKeyIncrement1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// High and low halves of the 64-bit product a * b.
__host__ __device__ __forceinline__ uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t& high) {
#ifdef __CUDA_ARCH__
  high = __umulhi(a, b);  // avoids a 64-bit multiply
  return a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * b;
  high = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
#endif
}

__host__ __device__ __forceinline__ PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                             PhiloxKey key) {
#pragma unroll
  for (int round = 0; round < kPhiloxRounds; ++round) {
    if (round > 0) {
      key.k0 += kPhiloxKeyIncrement0;  // unsigned: wraps mod 2^32 as specified
      key.k1 += kPhiloxKeyIncrement1;
    }
    uint32_t high0, high1;
    const uint32_t low0 = mulhilo32(kPhiloxMultiplier0, c0, high0);
    const uint32_t low1 = mulhilo32(kPhiloxMultiplier1, c2, high1);
    c0 = high1 ^ c1 ^ key.k0;
    c1 = low1;
    c2 = high0 ^ c3 ^ key.k1;
    c3 = low0;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// The dropout mask of one launch: the key from the seed, and the keep threshold.
struct DropoutMask {
  PhiloxKey key;
  uint32_t threshold;

  // The seed stays in device memory: no host synchronisation, and a replayed CUDA graph reads the
  // seed drawn for that replay.  (The CPU kernels load it the same way, from host memory.)
  __device__ __forceinline__ static DropoutMask load(const int64_t* seed, uint32_t threshold) {
    const uint64_t s = static_cast<uint64_t>(__ldg(seed));
    return DropoutMask{{static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32)}, threshold};
  }

  // Bit e (e < count <= N) set iff element (token, col + e) is kept; bits at or past `count` are
  // unspecified.  One Philox call per group of four columns the span touches: at most N / 4 + 1.
  template <int N>
  __device__ __forceinline__ uint32_t keep_bits(int64_t token, int64_t col, int count) const {
    static_assert(N % 4 == 0 && N <= 16, "spans cover whole groups of four columns, and 4 * (N / 4 + 1) bits fit");
    const uint64_t t = static_cast<uint64_t>(token);
    const uint32_t t_low = static_cast<uint32_t>(t), t_high = static_cast<uint32_t>(t >> 32);
    const uint32_t group0 = static_cast<uint32_t>(col >> 2);
    const int skip = static_cast<int>(col & 3);  // columns of the first group before the span
    uint32_t bits = 0;  // bit 4g + w: word w of group group0 + g passes
#pragma unroll
    for (int g = 0; g < N / 4 + 1; ++g) {
      if (4 * g >= skip + count) break;
      const PhiloxWords r = philox4x32_10(group0 + g, t_low, t_high, 0, key);
#pragma unroll
      for (int w = 0; w < 4; ++w) bits |= static_cast<uint32_t>(r.word[w] >= threshold) << (4 * g + w);
    }
    return bits >> skip;
  }
};

// values[e] *= scale where bit e of `keep` is set, else 0 (dropped elements are exactly zero).
template <typename Math, int N>
__device__ __forceinline__ void apply_keep_bits(Math (&values)[N], uint32_t keep, Math scale) {
#pragma unroll
  for (int e = 0; e < N; ++e) values[e] = ((keep >> e) & 1u) != 0 ? values[e] * scale : Math(0);
}

// values[e] = 0 where bit e of `keep` is clear.  A select, not a multiply by the mask: a dropped
// element contributes 0 even if it is inf or NaN, as torch.where does in the reference.
template <typename Math, int N>
__device__ __forceinline__ void zero_dropped(Math (&values)[N], uint32_t keep) {
#pragma unroll
  for (int e = 0; e < N; ++e) values[e] = ((keep >> e) & 1u) != 0 ? values[e] : Math(0);
}

}  // namespace posenc
