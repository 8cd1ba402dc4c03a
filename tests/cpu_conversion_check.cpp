// Checks the AVX2 variant's int64 -> float conversion of the reduced angle (csrc/cpu/cpu_kernels.cpp,
// int64_to_math) against the hardware's direct conversion, on values where a second rounding would show:
// every magnitude (the fold of the low bits starts at 2^34), and integers at and around fp32 rounding ties
// past 2^53 (where the two words' sum, without the fold, would itself be rounded).
// Built and run by tests/test_cpu_backend.py with the package's AVX2 flags; the
// conversion runs in a loop that GCC vectorises, as in the kernels.  Exit status 0: every value matched.
#include "cpu/cpu_kernels.cpp"

#include <cstdio>
#include <random>
#include <vector>

namespace posenc {
namespace cpu {
// The kernels' thread split is the binding's (cpu_binding.cpp); nothing here runs them.
void parallel_for(int64_t num_items, int64_t, int, void (*fn)(void*, int64_t, int64_t), void* context) {
  fn(context, 0, num_items);
}
}  // namespace cpu
}  // namespace posenc

namespace variant = posenc::cpu::POSENC_CPU_ISA;

template <typename Math>
__attribute__((noinline)) void convert_all(const int64_t* __restrict__ r, Math* __restrict__ out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = variant::int64_to_math<Math>(r[i]);
}

template <typename Math>
int64_t mismatches(const std::vector<int64_t>& values, const char* name) {
  std::vector<Math> out(values.size());
  convert_all<Math>(values.data(), out.data(), static_cast<int64_t>(values.size()));
  int64_t bad = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const Math want = static_cast<Math>(values[i]);  // one rounding, by the hardware
    if (std::memcmp(&want, &out[i], sizeof want) != 0 && bad++ < 5) {
      std::printf("%s: r = %lld gave %.17g, direct conversion %.17g\n", name, static_cast<long long>(values[i]),
                  static_cast<double>(out[i]), static_cast<double>(want));
    }
  }
  return bad;
}

int main() {
  const int64_t limit = int64_t(1) << 61;  // -2^61 <= remainder < 2^61 (an eighth of a turn)
  std::vector<int64_t> values;
  auto add = [&](int64_t v) {
    if (v > -limit && v < limit) {
      values.push_back(v);
      values.push_back(-v);
    }
  };
  values.push_back(-limit);  // a phase of an eighth of a turn (2^61 units): the one r whose negation is out of range
  for (int e = 0; e < 61; ++e) {
    const int64_t p = int64_t(1) << e;
    const int64_t half_ulp = p >> 24;  // half an fp32 ulp at p: a tie
    const int64_t double_ulp = e > 52 ? int64_t(1) << (e - 52) : 1;
    for (int64_t d = -4; d <= 4; ++d) {
      for (int64_t tie : {p, p + half_ulp, p + 3 * half_ulp, p + 2 * half_ulp, 2 * p - half_ulp}) {
        add(tie + d);
        add(tie + d * double_ulp);
        add(tie + d * (double_ulp / 2));
      }
    }
  }
  std::mt19937_64 rng(20261126);
  for (int i = 0; i < 2000000; ++i) {
    const uint64_t word = rng();  // one draw per statement: the same values whatever the compiler's order
    const uint64_t shift = 3 + rng() % 61;
    add(static_cast<int64_t>(word >> shift));
  }
  for (int i = 0; i < 2000000; ++i) {  // near a tie, at a random magnitude past 2^53
    const int e = 53 + static_cast<int>(rng() % 8);
    const int64_t p = int64_t(1) << e, half_ulp = p >> 24;
    const int64_t tie = p + static_cast<int64_t>(rng() % (uint64_t(1) << 23)) * 2 * half_ulp + half_ulp;
    const int64_t double_ulps = static_cast<int64_t>(rng() % 33) - 16;
    const int64_t units = static_cast<int64_t>(rng() % 3) - 1;
    add(tie + double_ulps * (int64_t(1) << (e - 53)) + units);
  }
  const int64_t bad = mismatches<float>(values, "float") + mismatches<double>(values, "double");
  std::printf("%zu values, %lld mismatches\n", values.size(), static_cast<long long>(bad));
  return bad == 0 ? 0 : 1;
}
