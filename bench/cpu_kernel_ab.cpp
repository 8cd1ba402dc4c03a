// Same-process A/B timing of two builds of csrc/cpu/cpu_kernels.cpp (driven by bench/cpu_kernel_ab.py).
//
// The 2-core VMs this project is developed on vary by up to 2x from one process to the next, which hides a
// 5-10% kernel change in any comparison of separate runs.  Here both builds are linked into one program (in
// namespaces isa_a and isa_b, the way the package links its ISA variants), called alternately on the same
// table, ids and output, so that a noisy second hits both alike.  Cold (1), a 96 MiB buffer is written
// (by the same threads) before every call, so that the table rows come from memory, as after other layers;
// fresh (2), the output cycles through three buffers (below).
//
// Timing only: the turns are approximate (long double), nothing is checked.  Each build is compiled with its
// own revision's headers, and this file with the working tree's: the driver refuses a base revision
// whose cpu_kernels.h or kernel_args.h differs (its ForwardArgs could be laid out differently).  Where one version runs on more
// threads than the other (a small batch split or not), load from other processes penalises only that one:
// compare on an idle machine.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.h"

namespace posenc {
namespace cpu {
namespace isa_a {
const char* forward(const ForwardArgs&, int num_threads);
}
namespace isa_b {
const char* forward(const ForwardArgs&, int num_threads);
}

// As the binding's OpenMP path: chunks of `grain` items taken from a shared counter by a team.
void parallel_for(int64_t num_items, int64_t grain, int num_threads, void (*fn)(void*, int64_t, int64_t),
                  void* context) {
  if (num_items <= 0) return;
  if (grain < 1) grain = 1;
  const int64_t num_chunks = (num_items + grain - 1) / grain;
  const int team = num_threads < num_chunks ? num_threads : static_cast<int>(num_chunks);
  if (team <= 1) {
    fn(context, 0, num_items);
    return;
  }
  std::atomic<int64_t> next_chunk{0};
#pragma omp parallel num_threads(team)
  for (;;) {
    const int64_t begin = next_chunk.fetch_add(1) * grain;
    if (begin >= num_items) break;
    fn(context, begin, std::min(begin + grain, num_items));
  }
}
}  // namespace cpu
}  // namespace posenc

namespace {
using posenc::DType;
using posenc::ForwardArgs;

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1))];
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr, "usage: %s vocab d batch length threads repeats cold(0 warm|1 cold|2 fresh outputs) "
                 "[offsets (0 a scalar offset|1 per-sequence offsets, equal|2 per-sequence offsets, distinct|"
                 "3 padded: fairseq's positions of right-padded sequences, zero PE at padding)]\n",
                 argv[0]);
    return 2;
  }
  const int64_t vocab = atoll(argv[1]), d = atoll(argv[2]), batch = atoll(argv[3]), length = atoll(argv[4]);
  const int threads = atoi(argv[5]), repeats = atoi(argv[6]), cold = atoi(argv[7]);
  const int offsets_kind = argc > 8 ? atoi(argv[8]) : 0;
  if (offsets_kind < 0 || offsets_kind > 3) {
    std::fprintf(stderr, "offsets must be 0 (a scalar offset), 1 (per-sequence, equal), 2 (per-sequence, distinct) "
                 "or 3 (padded)\n");
    return 2;
  }
  if (offsets_kind == 3 && atoll(argv[1]) < 3) {
    std::fprintf(stderr, "padded needs vocab >= 3 (padding id 1 and another id)\n");
    return 2;
  }
  if (cold < 0 || cold > 2) {
    std::fprintf(stderr, "cold must be 0 (warm), 1 (cold) or 2 (fresh outputs)\n");
    return 2;
  }
  if (vocab < 1 || d < 2 || batch < 1 || length < 1 || threads < 1 || repeats < 1) {
    std::fprintf(stderr, "vocab, batch, length, threads and repeats must be >= 1, d >= 2\n");
    return 2;
  }
  const int64_t tokens = batch * length;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> table(static_cast<size_t>(vocab * d));
  for (float& x : table) x = normal(rng);
  std::vector<int64_t> ids(static_cast<size_t>(tokens));
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  std::vector<int64_t> turns(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) {
    const long double turns_per_position = powl(10000.0L, -2.0L * i / d) / (2.0L * 3.14159265358979323846L);
    turns[i] = static_cast<int64_t>(static_cast<uint64_t>(llroundl(turns_per_position * 0x1p64L)));
  }
  // cold 2 ("fresh"): warm tables, but the output cycles through three buffers, as a module's newly
  // allocated outputs do (the allocator hands out two or three addresses in turn).  At the default 4096-token
  // d 512 shapes that is 24 MiB of outputs, which do not all stay in a 32 MiB last-level cache beside the
  // rows; at small shapes "fresh" is "warm".
  const int num_outputs = cold == 2 ? 3 : 1;
  std::vector<std::vector<float>> outputs(num_outputs, std::vector<float>(static_cast<size_t>(tokens * d), 0.0f));
  std::vector<float> flush(cold == 1 ? (size_t{24} << 20) : 0, 0.0f);

  ForwardArgs a{};
  a.ids = ids.data();
  a.ids_dtype = DType::kInt64;
  a.weight = table.data();
  a.weight_row_stride = d;
  a.dtype = DType::kFloat32;
  a.out = outputs[0].data();
  a.turns = turns.data();
  a.num_turns = d / 2;
  a.seq_len = length;
  a.num_tokens = tokens;
  a.num_embeddings = vocab;
  a.token_width = d;
  a.pe_width = d;
  a.columns.interleaved = true;
  a.pe_zero_id = -1;
  a.embed_scale = std::sqrt(static_cast<double>(d));
  a.pe_scale = 1.0;
  a.dropout_scale = 1.0;
  // Per-sequence offsets: all 0 (the scalar offset's positions, through the per-token path), or each
  // sequence 1000 positions past the previous one (no two tokens of a column at one position).
  std::vector<int64_t> offsets(static_cast<size_t>(batch), 0);
  for (int64_t b = 0; offsets_kind == 2 && b < batch; ++b) offsets[static_cast<size_t>(b)] = 1000 * b;
  if (offsets_kind == 1 || offsets_kind == 2) a.offsets = offsets.data();
  // Padded (make_positions with padding_idx 1, zero_pe_at_padding): sequence b's first length - b * length /
  // (2 * batch) tokens are real, at positions 2, 3, ...; the rest are padding (id 1) at position 1, with zero PE.
  std::vector<int64_t> positions(offsets_kind == 3 ? static_cast<size_t>(tokens) : 0);
  if (offsets_kind == 3) {
    constexpr int64_t kPaddingIdx = 1;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t real = length - b * length / (2 * batch);
      for (int64_t j = 0; j < length; ++j) {
        const size_t t = static_cast<size_t>(b * length + j);
        if (j >= real) ids[t] = kPaddingIdx;
        else if (ids[t] == kPaddingIdx) ids[t] = kPaddingIdx + 1;
        positions[t] = j < real ? kPaddingIdx + 1 + j : kPaddingIdx;
      }
    }
    a.positions = positions.data();
    a.pe_zero_id = kPaddingIdx;
  }

  std::vector<double> times[2];
  const int warmup = 10;
  for (int r = 0; r < repeats + warmup; ++r) {
    for (int k = 0; k < 2; ++k) {
      const int which = (r + k) & 1;  // alternate which build goes first
      a.out = outputs[static_cast<size_t>(2 * r + k) % outputs.size()].data();
      if (cold == 1) {
#pragma omp parallel for num_threads(threads)
        for (size_t i = 0; i < flush.size(); i += 16) flush[i] += 1.0f;
      }
      const double start = now_ms();
      const char* error = which ? posenc::cpu::isa_b::forward(a, threads) : posenc::cpu::isa_a::forward(a, threads);
      const double elapsed = now_ms() - start;
      if (error != nullptr) {
        std::fprintf(stderr, "forward failed: %s\n", error);
        return 1;
      }
      if (r >= warmup) times[which].push_back(elapsed);
    }
  }
  // The two builds' outputs of the same call, poisoned first, compared bit for bit: a kernel change that
  // claims the same values is checked on every shape it is timed on.
  std::vector<float> check[2];
  for (int k = 0; k < 2; ++k) {
    check[k].assign(static_cast<size_t>(tokens * d), std::numeric_limits<float>::quiet_NaN());
    a.out = check[k].data();
    const char* error = k ? posenc::cpu::isa_b::forward(a, threads) : posenc::cpu::isa_a::forward(a, threads);
    if (error != nullptr) {
      std::fprintf(stderr, "forward failed: %s\n", error);
      return 1;
    }
  }
  const bool same = std::memcmp(check[0].data(), check[1].data(), check[0].size() * sizeof(float)) == 0;
  std::printf("%.6f %.6f %.6f %.6f %d\n", quantile(times[0], 0.1), quantile(times[0], 0.5), quantile(times[1], 0.1),
              quantile(times[1], 0.5), same ? 1 : 0);
  return 0;
}
