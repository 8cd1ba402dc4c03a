// CPU kernels: the fused forward and the deterministic weight gradient (cpu_kernels.h; design:
// docs/cpu_backend.md).  Compiled once per instruction set (POSENC_CPU_ISA; flags: posenc_fast/_build.py), each
// into its own namespace, with the shared headers' functions always inlined, so no code compiled for one
// variant can be linked into another.
#include "cpu/cpu_kernels.h"

#include <cstdint>
#include <cstring>
#include <new>

#include "common/exact_angle.cuh"
#include "common/philox.cuh"

#ifndef POSENC_CPU_ISA
#error "compile with -DPOSENC_CPU_ISA=isa_baseline (or isa_avx2, isa_avx512)"
#endif

namespace posenc {
namespace cpu {
namespace POSENC_CPU_ISA {
namespace {

#define POSENC_INLINE inline __attribute__((always_inline))

POSENC_INLINE int64_t min_of(int64_t a, int64_t b) { return a < b ? a : b; }
POSENC_INLINE int64_t max_of(int64_t a, int64_t b) { return a > b ? a : b; }

// ---- element types: widen exactly to fp32; narrow from fp32 or float64 with one rounding ----

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

POSENC_INLINE uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

POSENC_INLINE float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// float64 -> fp32 rounded to odd: the neighbour with an odd last bit when inexact.  Rounding that
// once more to nearest even at <= 22 bits (bf16, fp16) equals rounding the double directly, so
// float64 math is rounded once to bf16/fp16 although the hardware has no such conversion.
POSENC_INLINE float round_to_odd_fp32(double x) {
  const float f = static_cast<float>(x);
  if (static_cast<double>(f) == x || x != x) return f;
  uint32_t b = bits_of(f);
  if ((b & 1u) == 0) {  // nearest-even landed on the even neighbour: take the other one, toward x
    const double fa = f < 0 ? -static_cast<double>(f) : static_cast<double>(f);
    const double xa = x < 0 ? -x : x;
    b = fa > xa ? b - 1 : b + 1;  // magnitude down or up (from inf: down to the largest finite)
  }
  return float_of(b);
}

POSENC_INLINE uint16_t bf16_of(float x) {
  const uint32_t b = bits_of(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);  // nearest even (carries to inf)
}

POSENC_INLINE uint16_t fp16_of(float x) {
  const uint32_t b = bits_of(x);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: rounds to inf
  if (a >= 0x38800000u) {  // normal fp16 (>= 2^-14): rebias the exponent, round 13 bits away
    const uint32_t m = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25: rounds to zero (ties to even)
  // Subnormal fp16: the value in units of 2^-24, rounded to nearest even.
  const uint32_t exponent = a >> 23;
  const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14..24
  uint32_t q = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

POSENC_INLINE float float_of_fp16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return float_of(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float v = static_cast<float>(mantissa) * 5.9604644775390625e-08f;  // 2^-24, exact
    return sign ? -v : v;
  }
  return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

template <typename T>
struct Element;

template <>
struct Element<float> {
  static POSENC_INLINE float widen(float x) { return x; }
  static POSENC_INLINE float narrow(float x) { return x; }
  static POSENC_INLINE float narrow(double x) { return static_cast<float>(x); }
};

template <>
struct Element<BFloat16> {
  static POSENC_INLINE float widen(BFloat16 x) { return float_of(static_cast<uint32_t>(x.bits) << 16); }
  static POSENC_INLINE BFloat16 narrow(float x) { return BFloat16{bf16_of(x)}; }
  static POSENC_INLINE BFloat16 narrow(double x) { return narrow(round_to_odd_fp32(x)); }
};

template <>
struct Element<Float16> {
#if defined(__F16C__) && defined(__FLT16_MAX__)
  // The AVX2 and AVX-512 variants convert in hardware (F16C: exact widening, nearest-even narrowing).
  static POSENC_INLINE float widen(Float16 x) {
    _Float16 h;
    std::memcpy(&h, &x.bits, sizeof h);
    return static_cast<float>(h);
  }
  static POSENC_INLINE Float16 narrow(float x) {
    const _Float16 h = static_cast<_Float16>(x);
    Float16 out;
    std::memcpy(&out.bits, &h, sizeof h);
    return out;
  }
#else
  static POSENC_INLINE float widen(Float16 x) { return float_of_fp16(x.bits); }
  static POSENC_INLINE Float16 narrow(float x) { return Float16{fp16_of(x)}; }
#endif
  static POSENC_INLINE Float16 narrow(double x) { return narrow(round_to_odd_fp32(x)); }
};

// ---- scratch: plain new[] (no standard-library templates in a per-ISA file) ----

template <typename V>
struct Scratch {
  V* data = nullptr;
  bool failed = false;  // n > 0 elements were asked for and none were given
  explicit Scratch(int64_t n) : data(n > 0 ? new (std::nothrow) V[n] : nullptr), failed(n > 0 && data == nullptr) {}
  ~Scratch() { delete[] data; }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// ---- dropout ----

// row[c] = keep(token, col0 + c) ? row[c] * scale : 0 for c < count, col0 a multiple of 4.  Each
// chunk's Philox words come first, in a loop over groups that the compiler vectorises.
constexpr int64_t kDropoutGroups = 64;

template <typename Math>
POSENC_INLINE void apply_dropout(const DropoutMask& mask, int64_t token, int64_t col0, int64_t count, Math scale,
                                 Math* row) {
  const uint64_t t = static_cast<uint64_t>(token);
  const uint32_t t_low = static_cast<uint32_t>(t), t_high = static_cast<uint32_t>(t >> 32);
  uint32_t words[4 * kDropoutGroups];
  for (int64_t c0 = 0; c0 < count; c0 += 4 * kDropoutGroups) {
    const int64_t n = min_of(4 * kDropoutGroups, count - c0);
    const int64_t groups = (n + 3) / 4;
    const uint32_t group0 = static_cast<uint32_t>((col0 + c0) >> 2);
    for (int64_t g = 0; g < groups; ++g) {
      const PhiloxWords r = philox4x32_10(group0 + static_cast<uint32_t>(g), t_low, t_high, 0, mask.key);
      words[4 * g] = r.word[0];
      words[4 * g + 1] = r.word[1];
      words[4 * g + 2] = r.word[2];
      words[4 * g + 3] = r.word[3];
    }
    Math* __restrict__ segment = row + c0;
    for (int64_t c = 0; c < n; ++c) segment[c] = words[c] >= mask.threshold ? segment[c] * scale : Math(0);
  }
}

// ---- forward ----

// How the position-major path cuts its work (ForwardPositions, position_work): item i is chunk i / groups
// of positions and group i % groups of sequences.
struct PositionWork {
  int64_t chunk;  // positions per chunk: whole blocks of kPositionBlock
  int64_t groups;  // sequence groups per chunk
  int64_t num_sequences;
  int64_t num_items;  // chunks x groups
};

template <typename Math>
struct ForwardPlan {
  const ForwardArgs* args;
  const int64_t* rates;  // [slots]: turns, then 0 (an odd D's zero tail)
  int64_t slots;  // ceil(D / 2) pair slots
  int64_t num_pairs;  // h = D / 2: slots at or past it have a zero cos
  int64_t width;
  int64_t pe_col0;
  Math embed_scale, pe_scale, dropout_scale;
  DropoutMask mask;
  PositionWork positions;  // the position-major path's cut (position_work)
  bool shared_positions;  // a scalar offset: every token of a column at one position
  int* scratch_failed;  // set to 1 (atomically) by a work item whose scratch could not be allocated
};

// A work item's scratch is allocated in the worker; where that fails, the item is skipped and the forward
// returns an error instead of writing through a null pointer.
template <typename Math, typename V>
POSENC_INLINE bool scratch_missing(const ForwardPlan<Math>& p, const Scratch<V>& scratch) {
  if (!scratch.failed) return false;
  __atomic_store_n(p.scratch_failed, 1, __ATOMIC_RELAXED);
  return true;
}

#if defined(__AVX2__) && !defined(__AVX512DQ__)
// AVX2 has no int64-to-float conversion, so sin_cos_of_turns would not vectorise.  This is the same
// reduction (exact_angle.cuh) with that conversion done in vectorisable steps, bit for bit the same:
// the remainder r (-2^61 <= r < 2^61) splits into two 32-bit words, each exact in double, whose sum is
// exact wherever r has at most 53 significant bits.
POSENC_INLINE double words_to_double(int32_t high_word, uint32_t low_word) {
  const double high = static_cast<double>(high_word) * 4294967296.0;
  const double low = static_cast<double>(static_cast<int32_t>(low_word ^ 0x80000000u)) + 2147483648.0;
  return high + low;
}

template <typename Math>
POSENC_INLINE Math int64_to_math(int64_t r);

// float64 math: the sum of the two words, rounded to nearest even once, is the direct rounding of r.
template <>
POSENC_INLINE double int64_to_math<double>(int64_t r) {
  const uint64_t bits = static_cast<uint64_t>(r);
  return words_to_double(static_cast<int32_t>(bits >> 32), static_cast<uint32_t>(bits));
}

// float32 math: where r >= 2^34 or r < -2^34 (the high word outside [-4, 3]), fp32's ulp is 2^11 or more, so
// its rounding points and representable values are multiples of 2^10, and the bits below 2^9 only tell
// whether r lies on the 2^9 grid.  Folding them into bit 9 (r rounded to odd at 2^9) keeps r in the same
// open interval between multiples of 2^10, so the fp32 rounding is unchanged, and leaves at most 52
// significant bits: the words' sum is exact in double, and the one rounding is double -> float.
// Otherwise r itself is exact in double.  Written as integer 0/1 masks so that GCC vectorises the loop.
template <>
POSENC_INLINE float int64_to_math<float>(int64_t r) {
  const uint64_t bits = static_cast<uint64_t>(r);
  const int32_t high_word = static_cast<int32_t>(bits >> 32);
  const uint32_t low_word = static_cast<uint32_t>(bits);
  const uint32_t past_2_34 = static_cast<uint32_t>(high_word) + 4u > 7u ? 0xFFFFFFFFu : 0u;
  const uint32_t sticky = (low_word & 0x1FFu) != 0 ? 0x200u : 0u;
  const uint32_t folded = (low_word & ~0x1FFu) | sticky;
  return static_cast<float>(words_to_double(high_word, (folded & past_2_34) | (low_word & ~past_2_34)));
}

template <typename Math>
POSENC_INLINE void sin_cos_of_turns_cpu(uint64_t turn_units, Math& sin_out, Math& cos_out) {
  // exact_angle.cuh's reduction, polynomials and quadrant signs, with the conversion above and selects
  // and negations in place of its sign-bit flips, which vectorise here.
  const uint64_t shifted = turn_units + kEighthTurn;
  const unsigned quadrant = static_cast<unsigned>(shifted >> 62);
  const int64_t remainder = static_cast<int64_t>(shifted & kQuarterTurnMask) - static_cast<int64_t>(kEighthTurn);
  const Math a = int64_to_math<Math>(remainder) * static_cast<Math>(kRadiansPerUnit);
  Math sin_a, cos_a;
  taylor_sin_cos(a, sin_a, cos_a);
  const bool odd = (quadrant & 1u) != 0;
  const Math sin_unsigned = odd ? cos_a : sin_a;
  const Math cos_unsigned = odd ? sin_a : cos_a;
  sin_out = quadrant >= 2 ? -sin_unsigned : sin_unsigned;
  cos_out = (quadrant == 1 || quadrant == 2) ? -cos_unsigned : cos_unsigned;
}
#else
template <typename Math>
POSENC_INLINE void sin_cos_of_turns_cpu(uint64_t turn_units, Math& sin_out, Math& cos_out) {
  sin_cos_of_turns<Math>(turn_units, sin_out, cos_out);
}
#endif

// The phases of position + 1 are those of position plus the rates, exactly (mod 2^64), so consecutive
// positions can add instead of multiplying: worth it without a 64-bit vector multiply.  With AVX-512DQ's
// vpmullq, multiplying in the loop is cheaper than storing the phases back.
#if defined(__AVX512DQ__)
constexpr bool kPhasesByAddition = false;
#else
constexpr bool kPhasesByAddition = true;
#endif

// The phases of `position`, for sin_cos_row (nothing to do where the loop multiplies).
POSENC_INLINE void phases_at(int64_t position, const int64_t* __restrict__ rates, int64_t slots,
                             uint64_t* __restrict__ phases) {
  if (!kPhasesByAddition) return;
  for (int64_t i = 0; i < slots; ++i) phases[i] = phase_of(position, rates[i]);
}

// The sin and cos of every slot at `position`.  Where kPhasesByAddition, `phases` holds its phases
// (phases_at, or the previous call's at position - 1) and is advanced to position + 1's.
template <typename Math>
POSENC_INLINE void sin_cos_row(int64_t position, uint64_t* __restrict__ phases, const int64_t* __restrict__ rates,
                               int64_t slots, Math* __restrict__ sins, Math* __restrict__ coses) {
  for (int64_t i = 0; i < slots; ++i) {
    const uint64_t phase = kPhasesByAddition ? phases[i] : phase_of(position, rates[i]);
    Math s, c;
    sin_cos_of_turns_cpu<Math>(phase, s, c);
    sins[i] = s;
    coses[i] = c;
    if (kPhasesByAddition) phases[i] = phase + static_cast<uint64_t>(rates[i]);
  }
}

// A phases buffer and the position whose phases it holds after a sin_cos_row (that position + 1).
struct PhaseRun {
  uint64_t* phases;  // [slots]; null where the loop multiplies (kPhasesByAddition false)
  bool valid = false;
  uint64_t next = 0;

  // Readies `phases` for sin_cos_row at `position`, keeping the previous call's where they follow on.
  POSENC_INLINE void start(int64_t position, const int64_t* __restrict__ rates, int64_t slots) {
    if (!valid || static_cast<uint64_t>(position) != next) phases_at(position, rates, slots, phases);
    valid = true;
    next = static_cast<uint64_t>(position) + 1;
  }
};

POSENC_INLINE int64_t token_position(const ForwardArgs& a, int64_t token) {
  if (a.positions != nullptr) return a.positions[token];
  const int64_t sequence = token / a.seq_len, within = token - sequence * a.seq_len;
  const int64_t start = a.offsets != nullptr ? a.offsets[sequence] : a.offset;
  return static_cast<int64_t>(static_cast<uint64_t>(start) + static_cast<uint64_t>(within));  // wraps
}

template <typename IdT>
POSENC_INLINE int64_t token_id(const ForwardArgs& a, int64_t token) {
  return static_cast<int64_t>(static_cast<const IdT*>(a.ids)[token]);
}

// The PE of one token into pe[0, D), times `scale`, from its slots' sins and coses.
template <typename Math>
POSENC_INLINE void place_pe(const ForwardPlan<Math>& p, const Math* __restrict__ sins,
                            const Math* __restrict__ coses, Math scale, Math* __restrict__ pe) {
  const ForwardArgs& a = *p.args;
  const int64_t h = p.num_pairs;
  if (a.columns.interleaved) {
    for (int64_t i = 0; i < h; ++i) {
      pe[2 * i] = sins[i] * scale;
      pe[2 * i + 1] = coses[i] * scale;
    }
    if (a.pe_width > 2 * h) pe[2 * h] = sins[h] * scale;  // an odd D's tail: a sin or (rate 0) zero
    return;
  }
  Math* __restrict__ sin_out = pe + a.columns.sin_base;
  for (int64_t i = 0; i < a.columns.num_sin; ++i) sin_out[i] = sins[i] * scale;
  Math* __restrict__ cos_out = pe + a.columns.cos_base;
  const int64_t with_cos = min_of(a.columns.num_cos, h);
  for (int64_t i = 0; i < with_cos; ++i) cos_out[i] = coses[i] * scale;
  for (int64_t i = with_cos; i < a.columns.num_cos; ++i) cos_out[i] = Math(0);  // cos slot h: a zero column
}

// One token's output row from its PE row (pe = row + pe_col0, already times its pe scale): the
// token columns times embed_scale, added or placed first, dropout, one rounding, the store.
template <typename T, typename Math>
POSENC_INLINE void emit_row(const ForwardPlan<Math>& p, int64_t t, int64_t id, Math* __restrict__ row) {
  const ForwardArgs& a = *p.args;
  const int64_t tw = a.token_width;
  const bool has_row = id >= 0 && id < a.num_embeddings;
  const T* __restrict__ w = static_cast<const T*>(a.weight) + (has_row ? id * a.weight_row_stride : 0);
  T* __restrict__ y = static_cast<T*>(a.out) + t * p.width;
  if (a.dropout_seed == nullptr) {  // straight to the output: one pass over the row
    if (a.concat) {
      if (has_row) {
        for (int64_t k = 0; k < tw; ++k) y[k] = Element<T>::narrow(static_cast<Math>(Element<T>::widen(w[k])) * p.embed_scale);
      } else {
        for (int64_t k = 0; k < tw; ++k) y[k] = Element<T>::narrow(Math(0));
      }
      for (int64_t k = tw; k < p.width; ++k) y[k] = Element<T>::narrow(row[k]);
    } else if (has_row) {
      // w * es + pe: contracted to one fused multiply-add where the ISA has it (the CUDA kernel's fma).
      for (int64_t k = 0; k < tw; ++k) {
        y[k] = Element<T>::narrow(static_cast<Math>(Element<T>::widen(w[k])) * p.embed_scale + row[k]);
      }
    } else {
      for (int64_t k = 0; k < tw; ++k) y[k] = Element<T>::narrow(row[k]);
    }
    return;
  }
  if (a.concat) {
    if (has_row) {
      for (int64_t k = 0; k < tw; ++k) row[k] = static_cast<Math>(Element<T>::widen(w[k])) * p.embed_scale;
    } else {
      for (int64_t k = 0; k < tw; ++k) row[k] = Math(0);
    }
  } else if (has_row) {
    for (int64_t k = 0; k < tw; ++k) row[k] = static_cast<Math>(Element<T>::widen(w[k])) * p.embed_scale + row[k];
  }
  apply_dropout(p.mask, t, 0, p.width, p.dropout_scale, row);
  for (int64_t k = 0; k < p.width; ++k) y[k] = Element<T>::narrow(row[k]);
}

// fairseq's padding (zero_pe_at_padding): the token gets a PE at scale +0, whatever the pe scale (a NaN or
// -0.0 one included), as on the GPU backends.
POSENC_INLINE bool zero_pe_token(const ForwardArgs& a, int64_t id) {
  return a.pe_zero_id >= 0 && id == a.pe_zero_id;
}

// Lines of a token's weight row requested ahead (see the file comment).
constexpr int64_t kPrefetchLines = 8;
constexpr int64_t kCacheLine = 64;

// A read of the first min(bytes, kPrefetchLines lines) at `start` requested ahead of its use.
POSENC_INLINE void prefetch_lines(const void* start, int64_t bytes) {
  const char* first = static_cast<const char*>(start);
  const int64_t lines = min_of(kPrefetchLines, (bytes + kCacheLine - 1) / kCacheLine);
  for (int64_t line = 0; line < lines; ++line) __builtin_prefetch(first + line * kCacheLine, 0, 3);
}

template <typename T>
POSENC_INLINE void prefetch_row_start(const ForwardArgs& a, int64_t id) {
  if (id < 0 || id >= a.num_embeddings) return;
  prefetch_lines(static_cast<const T*>(a.weight) + id * a.weight_row_stride, a.token_width * static_cast<int64_t>(sizeof(T)));
}

// Token t's output from a PE row that other tokens share: emit_row writes into its row under dropout,
// so there the PE columns are copied first.
template <typename T, typename Math>
POSENC_INLINE void emit_shared_row(const ForwardPlan<Math>& p, int64_t t, int64_t id, Math* shared, Math* row) {
  if (p.args->dropout_seed != nullptr) {
    for (int64_t k = p.pe_col0; k < p.width; ++k) row[k] = shared[k];
    emit_row<T>(p, t, id, row);
  } else {
    emit_row<T>(p, t, id, shared);
  }
}

// A padding token's PE row at pe scale 0: signed zeros, which carry the signs of its position's sines
// and cosines.  fairseq puts every padding token at one position, so the row is remade only when the
// position changes.
template <typename Math>
struct ZeroPERow {
  Math* row;  // [width]: the PE at pe_col0
  bool made = false;
  int64_t position = 0;

  POSENC_INLINE Math* at(const ForwardPlan<Math>& p, int64_t at_position, PhaseRun& run, Math* sins, Math* coses) {
    if (!made || at_position != position) {
      run.start(at_position, p.rates, p.slots);
      sin_cos_row(at_position, run.phases, p.rates, p.slots, sins, coses);
      place_pe(p, sins, coses, Math(0), row + p.pe_col0);
      made = true;
      position = at_position;
    }
    return row;
  }
};

// Token-major: any positions (a positions tensor, per-sequence offsets): one sin/cos row per token.
template <typename T, typename Math, typename IdT>
struct ForwardTokens {
  static void run(void* context, int64_t begin, int64_t end) {
    const ForwardPlan<Math>& p = *static_cast<const ForwardPlan<Math>*>(context);
    const ForwardArgs& a = *p.args;
    Scratch<Math> scratch(2 * p.width + 2 * p.slots);
    Scratch<uint64_t> phases(kPhasesByAddition ? p.slots : 0);  // none where the loop multiplies
    if (scratch_missing(p, scratch) || scratch_missing(p, phases)) return;
    Math* __restrict__ row = scratch.data;
    Math* __restrict__ sins = row + p.width;
    Math* __restrict__ coses = sins + p.slots;
    ZeroPERow<Math> zero_pe{coses + p.slots};
    PhaseRun phase_run{phases.data};  // a sequence's next token (position + 1) continues from the last phases
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) prefetch_row_start<T>(a, token_id<IdT>(a, t + 1));
      const int64_t id = token_id<IdT>(a, t);
      const int64_t position = token_position(a, t);
      if (zero_pe_token(a, id)) {
        emit_shared_row<T>(p, t, id, zero_pe.at(p, position, phase_run, sins, coses), row);
        continue;
      }
      phase_run.start(position, p.rates, p.slots);
      sin_cos_row(position, phase_run.phases, p.rates, p.slots, sins, coses);
      place_pe(p, sins, coses, p.pe_scale, row + p.pe_col0);
      emit_row<T>(p, t, id, row);
    }
  }
};

// Position-major, when the batch's sequences are likely to share their positions (docs/cpu_backend.md,
// "Position-major when positions repeat"): a work item (position_work) takes its columns kPositionBlock at a
// time, the block's PE rows first, then each sequence's rows of that block.
constexpr int64_t kPositionBlock = 8;

template <typename T, typename Math, typename IdT>
struct ForwardPositions {
  static void run(void* context, int64_t begin, int64_t end) {
    const ForwardPlan<Math>& p = *static_cast<const ForwardPlan<Math>*>(context);
    const ForwardArgs& a = *p.args;
    const PositionWork& w = p.positions;
    Scratch<Math> scratch((kPositionBlock + 2) * p.width + 2 * p.slots);
    // The block rows' phases, then a token's own; none where the loop multiplies.
    Scratch<uint64_t> phases(kPhasesByAddition ? 2 * p.slots : 0);
    if (scratch_missing(p, scratch) || scratch_missing(p, phases)) return;
    Math* __restrict__ pe_rows = scratch.data;  // the block's PEs at pe_scale, one row per column
    Math* __restrict__ row = pe_rows + kPositionBlock * p.width;  // a token's working row (dropout, or no PE)
    Math* __restrict__ sins = row + p.width;
    Math* __restrict__ coses = sins + p.slots;
    ZeroPERow<Math> zero_pe{coses + p.slots};
    int64_t row_position[kPositionBlock];  // the position each of pe_rows is at
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / w.groups, group = item - chunk * w.groups;
      // This item's tokens: columns [chunk_begin, chunk_end) of sequences [seq_begin, seq_end).
      const int64_t seq_begin = w.num_sequences * group / w.groups;
      const int64_t seq_end = w.num_sequences * (group + 1) / w.groups;
      const int64_t tokens_end = min_of(seq_end * a.seq_len, a.num_tokens);
      const int64_t chunk_end = min_of((chunk + 1) * w.chunk, a.seq_len);
      PhaseRun block_run{phases.data};  // the first sequence's columns: consecutive positions, as a rule
      PhaseRun token_run{phases.data == nullptr ? nullptr : phases.data + p.slots};
      for (int64_t first = chunk * w.chunk; first < chunk_end; first += kPositionBlock) {
        const int64_t count = min_of(kPositionBlock, chunk_end - first);
        const int64_t first_token = seq_begin * a.seq_len + first;
        // first_token + j is past tokens_end only where a direct op call gave a seq_len that does not divide
        // the tokens and this group's one sequence is the short last one: that column has no token here.
        for (int64_t j = 0; j < count && first_token + j < tokens_end; ++j) {
          for (int64_t t = first_token + j; t < tokens_end; t += a.seq_len) {
            prefetch_row_start<T>(a, token_id<IdT>(a, t));
          }
          const int64_t position = token_position(a, first_token + j);
          block_run.start(position, p.rates, p.slots);
          sin_cos_row(position, block_run.phases, p.rates, p.slots, sins, coses);
          place_pe(p, sins, coses, p.pe_scale, pe_rows + j * p.width + p.pe_col0);
          row_position[j] = position;
        }
        for (int64_t start = first_token; start < tokens_end; start += a.seq_len) {
          const int64_t stop = min_of(start + count, tokens_end);
          for (int64_t t = start; t < stop; ++t) {
            const int64_t id = token_id<IdT>(a, t);
            const int64_t j = t - start;
            Math* __restrict__ pe_row = pe_rows + j * p.width;
            const int64_t position = p.shared_positions ? row_position[j] : token_position(a, t);
            if (zero_pe_token(a, id)) {
              emit_shared_row<T>(p, t, id, zero_pe.at(p, position, token_run, sins, coses), row);
              continue;
            }
            if (position != row_position[j]) {  // not the column's position: its row made again, at this one
              token_run.start(position, p.rates, p.slots);
              sin_cos_row(position, token_run.phases, p.rates, p.slots, sins, coses);
              place_pe(p, sins, coses, p.pe_scale, pe_row + p.pe_col0);
              row_position[j] = position;
            }
            emit_shared_row<T>(p, t, id, pe_row, row);
          }
        }
      }
    }
  }
};

// Tokens per work item of ForwardTokens at least: enough to amortise the per-item scratch, small enough to
// balance threads (and at least kGroupElements output elements: forward_typed).
constexpr int64_t kTokenGrain = 16;

// Output elements per sequence group at least: torch's own grain (at::internal::GRAIN_SIZE), below which
// at::parallel_for stays on one thread.
constexpr int64_t kGroupElements = 32768;

// The cut of position-major work: about four items per thread, each of at least kGroupElements output
// elements where the batch has them.  Items are chunks of whole position blocks; where sequences are too
// short for that many chunks, each chunk's sequences are split into groups too.  `width`: of an output row.
POSENC_INLINE PositionWork position_work(const ForwardArgs& a, int64_t width, int num_threads) {
  PositionWork w;
  const int64_t items = 4 * static_cast<int64_t>(num_threads > 0 ? num_threads : 1);
  w.num_sequences = (a.num_tokens + a.seq_len - 1) / a.seq_len;
  // A chunk holds at least kGroupElements output elements over its sequences too.
  const int64_t min_chunk = (kGroupElements + w.num_sequences * width - 1) / max_of(w.num_sequences * width, 1);
  const int64_t grain = max_of((a.seq_len + items - 1) / items, min_chunk);
  w.chunk = (grain + kPositionBlock - 1) / kPositionBlock * kPositionBlock;
  const int64_t num_chunks = (a.seq_len + w.chunk - 1) / w.chunk;
  // Groups of at least kGroupElements output elements: a smaller split costs more to hand to another thread
  // than it saves.
  const int64_t rows_per_sequence = min_of(w.chunk, a.seq_len);
  const int64_t min_rows = max_of(1, kGroupElements / max_of(width, 1));
  const int64_t most_groups = max_of(1, w.num_sequences * rows_per_sequence / min_rows);
  w.groups = max_of(1, min_of(min_of(w.num_sequences, most_groups), (items + num_chunks - 1) / num_chunks));
  w.num_items = num_chunks * w.groups;
  return w;
}

template <typename T, typename Math, typename IdT>
const char* forward_typed(const ForwardArgs& a, int num_threads) {
  const int64_t slots = a.pe_width - a.pe_width / 2;
  Scratch<int64_t> rates(slots);
  if (rates.failed) return "out of memory (rates)";
  for (int64_t i = 0; i < slots; ++i) rates.data[i] = i < a.num_turns ? a.turns[i] : 0;
  ForwardPlan<Math> p;
  p.args = &a;
  p.rates = rates.data;
  p.slots = slots;
  p.num_pairs = a.pe_width / 2;
  p.width = a.concat ? a.token_width + a.pe_width : a.token_width;
  p.pe_col0 = a.concat ? a.token_width : 0;
  p.embed_scale = static_cast<Math>(a.embed_scale);  // fp32 math: the scales rounded to fp32, as on the GPU
  p.pe_scale = static_cast<Math>(a.pe_scale);
  p.dropout_scale = static_cast<Math>(a.dropout_scale);
  p.mask = a.dropout_seed != nullptr ? DropoutMask::load(a.dropout_seed, a.dropout_threshold) : DropoutMask{};
  int scratch_failed = 0;
  p.scratch_failed = &scratch_failed;
  // Position-major where a column's tokens are likely to share a position (ForwardPositions); otherwise
  // (a decoding step over per-sequence offsets, short sequences, a single sequence) one sin/cos row per token.
  p.shared_positions = a.positions == nullptr && a.offsets == nullptr;
  const bool position_major = p.shared_positions || a.seq_len >= kPositionBlock;
  if (position_major && a.num_tokens / a.seq_len >= 2) {  // seq_len >= 1: forward() checked
    p.positions = position_work(a, p.width, num_threads);
    parallel_for(p.positions.num_items, 1, num_threads, &ForwardPositions<T, Math, IdT>::run, &p);
  } else {
    // Work items of at least kGroupElements output elements too, as in position_work: a small batch stays on
    // the calling thread rather than wait for a second one.
    const int64_t token_grain = max_of(kTokenGrain, (kGroupElements + p.width - 1) / max_of(p.width, 1));
    parallel_for(a.num_tokens, token_grain, num_threads, &ForwardTokens<T, Math, IdT>::run, &p);
  }
  return __atomic_load_n(&scratch_failed, __ATOMIC_RELAXED) ? "out of memory (a work item's scratch)" : nullptr;
}

template <typename T, typename Math>
const char* forward_ids(const ForwardArgs& a, int num_threads) {
  if (a.ids_dtype == DType::kInt64) return forward_typed<T, Math, int64_t>(a, num_threads);
  if (a.ids_dtype == DType::kInt32) return forward_typed<T, Math, int32_t>(a, num_threads);
  return "ids: dtype code is not INT32 or INT64";
}

template <typename T>
const char* forward_math(const ForwardArgs& a, int num_threads) {
  return a.float64_math ? forward_ids<T, double>(a, num_threads) : forward_ids<T, float>(a, num_threads);
}

// ---- weight gradient ----

constexpr int64_t kGradColumns = 128;  // columns per work item (a multiple of 4: whole Philox groups)

struct GradPlan {
  const CpuWeightGradArgs* args;
  const int64_t* run_starts;  // [num_runs + 1]
  int64_t num_runs;
  int64_t column_blocks;
  float scale;  // embed_scale (times the dropout scale), rounded to fp32 once, as on the GPU
  DropoutMask mask;
};

template <typename KeyT>
POSENC_INLINE int64_t sorted_id(const CpuWeightGradArgs& a, int64_t i) {
  return static_cast<int64_t>(static_cast<const KeyT*>(a.sorted_ids)[i]);
}

// Rows [begin, end) of grad_weight set to zero (+0.0 is all-zero bits in every float format).
template <typename W>
POSENC_INLINE void zero_rows(const CpuWeightGradArgs& a, int64_t begin, int64_t end) {
  if (end <= begin) return;
  W* rows = static_cast<W*>(a.grad_weight) + begin * a.token_width;
  std::memset(static_cast<void*>(rows), 0, static_cast<size_t>((end - begin) * a.token_width) * sizeof(W));
}

// One work item's sum (docs/cpu_backend.md, "Deterministic weight gradient"): the run's tokens' gradient
// columns [col0, col0 + count) in sorted order, blocks of kRunBlock tokens in fp32 and their sums in float64.
// kColumns is kGradColumns for a full block (constant loop bounds) or 0 for a row's narrower last block.  The
// next token's columns are prefetched: a run's tokens are rows far apart in grad_out.
constexpr int64_t kRunBlock = 32;

template <typename G, typename W, int64_t kColumns>
POSENC_INLINE void sum_run(const GradPlan& p, int64_t first, int64_t last, int64_t col0, int64_t count,
                           W* __restrict__ out) {
  const CpuWeightGradArgs& a = *p.args;
  const int64_t n = kColumns > 0 ? kColumns : count;
  const G* __restrict__ grad_out = static_cast<const G*>(a.grad_out) + col0;
  float sum[kGradColumns];
  float row[kGradColumns];
  double total[kGradColumns];  // a long run's block sums
  const bool blocked = last - first > kRunBlock;
  for (int64_t block = first; block < last; block += kRunBlock) {
    const int64_t block_end = min_of(block + kRunBlock, last);
    for (int64_t i = block; i < block_end; ++i) {
      const int64_t token = a.order[i];
      const G* __restrict__ g = grad_out + token * a.grad_out_row_stride;
      if (i + 1 < last) prefetch_lines(grad_out + a.order[i + 1] * a.grad_out_row_stride, n * sizeof(G));
      if (a.dropout_seed != nullptr) {
        for (int64_t k = 0; k < n; ++k) row[k] = Element<G>::widen(g[k]);
        // A dropped element adds 0, even if its gradient is not finite (a select, as in the reference).
        apply_dropout(p.mask, token, col0, n, 1.0f, row);
        if (i == block) {
          for (int64_t k = 0; k < n; ++k) sum[k] = row[k];
        } else {
          for (int64_t k = 0; k < n; ++k) sum[k] += row[k];
        }
      } else if (i == block) {
        for (int64_t k = 0; k < n; ++k) sum[k] = Element<G>::widen(g[k]);
      } else {
        for (int64_t k = 0; k < n; ++k) sum[k] += Element<G>::widen(g[k]);
      }
    }
    if (blocked) {
      if (block == first) {
        for (int64_t k = 0; k < n; ++k) total[k] = sum[k];
      } else {
        for (int64_t k = 0; k < n; ++k) total[k] += sum[k];
      }
    }
  }
  if (blocked) {
    for (int64_t k = 0; k < n; ++k) sum[k] = static_cast<float>(total[k]);
  }
  for (int64_t k = 0; k < n; ++k) out[k] = Element<W>::narrow(sum[k] * p.scale);
}

// Items ahead whose first token's columns are prefetched: a run's first row is at an unpredictable place in
// grad_out.  Few enough to stay inside the thread's own chunk (kGradChunkColumns), not another thread's.
constexpr int64_t kGradPrefetchItems = 4;
constexpr int64_t kGradChunkColumns = 32 * kGradColumns;

template <typename G>
POSENC_INLINE void prefetch_item_start(const GradPlan& p, int64_t item) {
  const int64_t run = item / p.column_blocks;
  if (run >= p.num_runs) return;
  const int64_t col0 = (item - run * p.column_blocks) * kGradColumns;
  const CpuWeightGradArgs& a = *p.args;
  prefetch_lines(static_cast<const G*>(a.grad_out) + a.order[p.run_starts[run]] * a.grad_out_row_stride + col0,
                 min_of(kGradColumns, a.token_width - col0) * static_cast<int64_t>(sizeof(G)));
}

template <typename G, typename W, typename KeyT>
struct GradItems {
  static void run(void* context, int64_t begin, int64_t end) {
    const GradPlan& p = *static_cast<const GradPlan*>(context);
    const CpuWeightGradArgs& a = *p.args;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t run = item / p.column_blocks;
      const int64_t col0 = (item - run * p.column_blocks) * kGradColumns;
      const int64_t count = min_of(kGradColumns, a.token_width - col0);
      const int64_t first = p.run_starts[run], last = p.run_starts[run + 1];
      prefetch_item_start<G>(p, item + kGradPrefetchItems);
      const int64_t id = sorted_id<KeyT>(a, first);
      if (id >= a.num_embeddings || id == a.padding_idx) continue;  // the sentinel, or no gradient
      W* out = static_cast<W*>(a.grad_weight) + id * a.token_width + col0;
      if (count == kGradColumns) {
        sum_run<G, W, kGradColumns>(p, first, last, col0, count, out);
      } else {
        sum_run<G, W, 0>(p, first, last, col0, count, out);
      }
    }
  }
};

// The rows of grad_weight in [begin, end) that no run's sums write (ids no token has, padding_idx) set to
// zero, so that each row is written once.
template <typename W, typename KeyT>
struct ZeroUnwrittenRows {
  static void run(void* context, int64_t begin, int64_t end) {
    const GradPlan& p = *static_cast<const GradPlan*>(context);
    const CpuWeightGradArgs& a = *p.args;
    int64_t low = 0, high = p.num_runs;  // the first run whose id is >= begin
    while (low < high) {
      const int64_t middle = low + (high - low) / 2;
      if (sorted_id<KeyT>(a, p.run_starts[middle]) < begin) {
        low = middle + 1;
      } else {
        high = middle;
      }
    }
    int64_t row = begin;  // rows [begin, row) are zeroed or left to a run
    for (int64_t run = low; run < p.num_runs; ++run) {
      const int64_t id = sorted_id<KeyT>(a, p.run_starts[run]);
      if (id >= end) break;
      if (id == a.padding_idx) continue;  // its run writes nothing: zeroed with the gap around it
      zero_rows<W>(a, row, id);
      row = id + 1;
    }
    zero_rows<W>(a, row, end);
  }
};

template <typename G, typename W, typename KeyT>
const char* weight_grad_typed(const CpuWeightGradArgs& a) {
  Scratch<int64_t> starts(a.num_tokens + 1);
  if (starts.failed) return "out of memory (runs)";
  int64_t num_runs = 0;
  int64_t previous = -1;
  for (int64_t i = 0; i < a.num_tokens; ++i) {
    const int64_t id = sorted_id<KeyT>(a, i);
    if (i == 0 || id != previous) starts.data[num_runs++] = i;
    previous = id;
  }
  starts.data[num_runs] = a.num_tokens;
  GradPlan p;
  p.args = &a;
  p.run_starts = starts.data;
  p.num_runs = num_runs;
  p.column_blocks = (a.token_width + kGradColumns - 1) / kGradColumns;
  const bool dropout = a.dropout_seed != nullptr;
  p.scale = static_cast<float>(dropout ? a.embed_scale * a.dropout_scale : a.embed_scale);
  p.mask = dropout ? DropoutMask::load(a.dropout_seed, a.dropout_threshold) : DropoutMask{};
  const int64_t zero_grain = max_of(1, (int64_t(1) << 18) / max_of(1, a.token_width));
  parallel_for(a.num_embeddings, zero_grain, a.num_threads, &ZeroUnwrittenRows<W, KeyT>::run, &p);
  const int64_t items = num_runs * p.column_blocks;
  const int64_t grain = kGradChunkColumns / min_of(a.token_width, kGradColumns);  // items (token_width >= 1 here)
  parallel_for(items, grain, a.num_threads, &GradItems<G, W, KeyT>::run, &p);
  return nullptr;
}

template <typename G, typename W>
const char* weight_grad_keyed(const CpuWeightGradArgs& a) {
  if (a.sorted_ids_dtype == DType::kInt64) return weight_grad_typed<G, W, int64_t>(a);
  if (a.sorted_ids_dtype == DType::kInt32) return weight_grad_typed<G, W, int32_t>(a);
  return "sorted_ids: dtype code is not INT32 or INT64";
}

template <typename W>
const char* weight_grad_of_weight(const CpuWeightGradArgs& a) {
  if (a.grad_dtype == DType::kFloat32) return weight_grad_keyed<float, W>(a);
  if (a.grad_dtype != a.weight_dtype) return "grad_out must have the weight's dtype or FLOAT32";
  if (a.grad_dtype == DType::kFloat16) return weight_grad_keyed<Float16, W>(a);
  return weight_grad_keyed<BFloat16, W>(a);
}

}  // namespace

const char* forward(const ForwardArgs& a, int num_threads) {
  if (a.num_tokens < 0 || a.seq_len < 1 || a.token_width < 0 || a.pe_width < 0 || a.num_turns < 0 ||
      a.num_embeddings < 0 || num_threads < 1 || (!a.concat && a.pe_width != a.token_width)) {
    return "invalid forward arguments";
  }
  if (a.num_tokens == 0) return nullptr;
  switch (a.dtype) {
    case DType::kFloat32: return forward_math<float>(a, num_threads);
    case DType::kFloat16: return forward_math<Float16>(a, num_threads);
    case DType::kBFloat16: return forward_math<BFloat16>(a, num_threads);
    default: return "weight: dtype code is not FLOAT32, FLOAT16 or BFLOAT16";
  }
}

const char* weight_grad(const CpuWeightGradArgs& a) {
  if (a.num_tokens < 0 || a.token_width < 0 || a.num_embeddings < 0 || a.num_threads < 1) {
    return "invalid weight gradient arguments";
  }
  if (a.token_width == 0 || a.num_embeddings == 0) return nullptr;
  switch (a.weight_dtype) {
    case DType::kFloat32: return weight_grad_of_weight<float>(a);
    case DType::kFloat16: return weight_grad_of_weight<Float16>(a);
    case DType::kBFloat16: return weight_grad_of_weight<BFloat16>(a);
    default: return "grad_weight: dtype code is not FLOAT32, FLOAT16 or BFLOAT16";
  }
}

}  // namespace POSENC_CPU_ISA
}  // namespace cpu
}  // namespace posenc
