// Exact-angle sin and cos from a fixed-point turn (docs/design.md, "Numerics: exact angles"): the same
// reduction and polynomials as triton_kernels.sin_cos_of_turns, and no math-library sin/cos, so results do not
// depend on one.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace posenc {

// 2*pi radians per 2^64 units of turn.
constexpr double kRadiansPerUnit = 2.0 * 3.14159265358979323846 / 18446744073709551616.0;
// The quadrant split, spelled out by the CPU kernel's AVX2 reduction (cpu_kernels.cpp).
constexpr uint64_t kEighthTurn = uint64_t(1) << 61;
constexpr uint64_t kQuarterTurnMask = (uint64_t(1) << 62) - 1;

// The product mod 2^64, in unsigned arithmetic: the wrap is intended, and signed overflow is undefined.
__device__ __forceinline__ uint64_t phase_of(int64_t position, int64_t turn_rate) {
  return static_cast<uint64_t>(position) * static_cast<uint64_t>(turn_rate);
}

// The angle of `turn_units` reduced to |a| <= pi/4 (in Math), after the nearest quarter turn.
template <typename Math>
__device__ __forceinline__ Math reduced_angle(uint64_t turn_units) {
  // The remainder after the nearest quarter turn is the low 62 bits of turn_units, signed, in
  // [-2^61, 2^61); int64(turn_units << 2) is exactly four times it, with no sign extension needed.
  // Scaling by a power of two commutes with both roundings here (no overflow, no subnormals), so
  // the result equals converting the remainder itself and multiplying by the constant (as Triton does).
  const int64_t remainder_x4 = static_cast<int64_t>(turn_units << 2);
  return static_cast<Math>(remainder_x4) * (static_cast<Math>(kRadiansPerUnit) * Math(0.25));
}

// x with its sign bit flipped where `sign` (0 or 0x80000000) has it: -x without a select.
__device__ __forceinline__ float flip_sign(float x, uint32_t sign) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  bits ^= sign;
  memcpy(&x, &bits, sizeof x);
  return x;
}

__device__ __forceinline__ double flip_sign(double x, uint32_t sign) {
  uint64_t bits;
  memcpy(&bits, &x, sizeof bits);
  bits ^= static_cast<uint64_t>(sign) << 32;
  memcpy(&x, &bits, sizeof x);
  return x;
}

__device__ __forceinline__ void taylor_sin_cos(float a, float& sin_a, float& cos_a) {
  // Coefficients: the double values rounded to fp32.
  constexpr float s3 = static_cast<float>(-1.0 / 6.0), s5 = static_cast<float>(1.0 / 120.0),
                  s7 = static_cast<float>(-1.0 / 5040.0), s9 = static_cast<float>(1.0 / 362880.0);
  constexpr float c2 = -0.5f, c4 = static_cast<float>(1.0 / 24.0), c6 = static_cast<float>(-1.0 / 720.0),
                  c8 = static_cast<float>(1.0 / 40320.0), c10 = static_cast<float>(-1.0 / 3628800.0);
  const float z = a * a;
  sin_a = a + a * z * (s3 + z * (s5 + z * (s7 + z * s9)));
  cos_a = 1.0f + z * (c2 + z * (c4 + z * (c6 + z * (c8 + z * c10))));
}

__device__ __forceinline__ void taylor_sin_cos(double a, double& sin_a, double& cos_a) {
  constexpr double s3 = -1.0 / 6.0, s5 = 1.0 / 120.0, s7 = -1.0 / 5040.0, s9 = 1.0 / 362880.0,
                   s11 = -1.0 / 39916800.0, s13 = 1.0 / 6227020800.0, s15 = -1.0 / 1307674368000.0,
                   s17 = 1.0 / 355687428096000.0;
  constexpr double c2 = -0.5, c4 = 1.0 / 24.0, c6 = -1.0 / 720.0, c8 = 1.0 / 40320.0, c10 = -1.0 / 3628800.0,
                   c12 = 1.0 / 479001600.0, c14 = -1.0 / 87178291200.0, c16 = 1.0 / 20922789888000.0,
                   c18 = -1.0 / 6402373705728000.0;
  const double z = a * a;
  sin_a = a + a * z * (s3 + z * (s5 + z * (s7 + z * (s9 + z * (s11 + z * (s13 + z * (s15 + z * s17)))))));
  cos_a = 1.0 + z * (c2 + z * (c4 + z * (c6 + z * (c8 + z * (c10 + z * (c12 + z * (c14 + z * (c16 + z * c18))))))));
}

// (b, a) if bit 30 of `quarter` is set, else (a, b): the odd quadrants' swap of sin and cos.
__device__ __forceinline__ void swap_if_odd(uint32_t quarter, float a, float b, float& first, float& second) {
#if defined(__CUDA_ARCH__)
  // and + setp.ne, which ptxas fuses into one LOP3; the C++ form compiles to shift, and, compare.
  asm("{\n\t.reg .pred odd;\n\t.reg .b32 bit;\n\t"
      "and.b32 bit, %2, 0x40000000;\n\tsetp.ne.b32 odd, bit, 0;\n\t"
      "selp.f32 %0, %4, %3, odd;\n\tselp.f32 %1, %3, %4, odd;\n\t}"
      : "=f"(first), "=f"(second)
      : "r"(quarter), "f"(a), "f"(b));
#else
  const bool odd = (quarter & 0x40000000u) != 0;
  first = odd ? b : a;
  second = odd ? a : b;
#endif
}

__device__ __forceinline__ void swap_if_odd(uint32_t quarter, double a, double b, double& first, double& second) {
#if defined(__CUDA_ARCH__)
  asm("{\n\t.reg .pred odd;\n\t.reg .b32 bit;\n\t"
      "and.b32 bit, %2, 0x40000000;\n\tsetp.ne.b32 odd, bit, 0;\n\t"
      "selp.f64 %0, %4, %3, odd;\n\tselp.f64 %1, %3, %4, odd;\n\t}"
      : "=d"(first), "=d"(second)
      : "r"(quarter), "d"(a), "d"(b));
#else
  const bool odd = (quarter & 0x40000000u) != 0;
  first = odd ? b : a;
  second = odd ? a : b;
#endif
}

// sin and cos (in Math: float or double) of the angle 2*pi * turn_units / 2^64, for any turn_units.
template <typename Math>
__device__ __forceinline__ void sin_cos_of_turns(uint64_t turn_units, Math& sin_out, Math& cos_out) {
  const Math a = reduced_angle<Math>(turn_units);
  Math sin_a, cos_a;
  taylor_sin_cos(a, sin_a, cos_a);
  // Rotate by quadrant * 90 degrees: (sin, cos) -> (cos, -sin) -> (-sin, -cos) -> (-cos, sin).
  // The quadrant is the top two bits of the high word plus 1/8 turn: odd quadrants swap, sin is
  // negative in quadrants 2 and 3 (bit 31), cos in 1 and 2 (bit 31 of the quadrant plus one).
  const uint32_t high = static_cast<uint32_t>(turn_units >> 32);
  const uint32_t quarter = high + 0x20000000u;
  Math sin_unsigned, cos_unsigned;
  swap_if_odd(quarter, sin_a, cos_a, sin_unsigned, cos_unsigned);
  sin_out = flip_sign(sin_unsigned, quarter & 0x80000000u);
  cos_out = flip_sign(cos_unsigned, (high + 0x60000000u) & 0x80000000u);
}

}  // namespace posenc
