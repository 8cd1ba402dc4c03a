// posenc_fast._cpu: the pybind11 binding of the CPU kernels (cpu_kernels.h), their threads, and the run-time
// choice of instruction-set variant (docs/cpu_backend.md).  The kernels run on the OpenMP runtime the process
// already has (torch's), never one loaded here, so they share its worker threads; without one, on a std::thread
// pool.  The GIL is released while they run.
#include <pybind11/pybind11.h>

#include <unistd.h>
#ifdef __linux__
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#endif

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "common/launch_arguments.h"

namespace py = pybind11;

namespace posenc {
namespace cpu {
namespace {

// One parallel_for's items, taken in chunks of `grain` from a shared counter by every thread that runs it
// (the pool's workers or an OpenMP team: the split, and so every result, is the same on both).
struct ChunkedJob {
  void (*fn)(void*, int64_t, int64_t);
  void* context;
  int64_t num_items;
  int64_t grain;
  std::atomic<int64_t> next_chunk{0};

  static void run(void* data) {
    auto* job = static_cast<ChunkedJob*>(data);
    for (;;) {
      const int64_t begin = job->next_chunk.fetch_add(1) * job->grain;
      if (begin >= job->num_items) return;
      const int64_t end = begin + job->grain < job->num_items ? begin + job->grain : job->num_items;
      job->fn(job->context, begin, end);
    }
  }
};

// Workers wait for a job's generation number, run their share of the ChunkedJob, and report back.  One job at
// a time; a call that finds the pool busy (another Python thread, the GIL being released) runs on its own
// thread instead of waiting.  Waiting spins briefly before it blocks: waking a blocked thread is a large share
// of a short call, and back-to-back calls (a model's layers) find the workers still spinning.
class ThreadPool {
 public:
  void run(int64_t num_items, int64_t grain, int num_threads, void (*fn)(void*, int64_t, int64_t),
           void* context) {
    const int64_t num_chunks = (num_items + grain - 1) / grain;
    const int64_t helpers_wanted = static_cast<int64_t>(num_threads) - 1 < num_chunks - 1
                                       ? static_cast<int64_t>(num_threads) - 1
                                       : num_chunks - 1;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (helpers_wanted <= 0 || !busy.owns_lock()) {
      fn(context, 0, num_items);
      return;
    }
    const int helpers = static_cast<int>(helpers_wanted);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(workers_.size()) < helpers) {
        const int index = static_cast<int>(workers_.size());
        workers_.emplace_back([this, index] { work(index); });
        workers_.back().detach();  // lives as long as the process (the pool is never destroyed)
      }
      job_.fn = fn;
      job_.context = context;
      job_.num_items = num_items;
      job_.grain = grain;
      job_.next_chunk.store(0);
      helpers_ = helpers;
      finished_.store(0);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    ChunkedJob::run(&job_);
    spin_while([&] { return finished_.load(std::memory_order_acquire) != helpers; });
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return finished_.load() == helpers; });
  }

 private:
  template <typename Condition>
  static void spin_while(Condition busy) {
    for (int i = 0; i < 20000 && busy(); ++i) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#else
      std::this_thread::yield();
#endif
    }
  }

  void work(int index) {
    uint64_t seen = 0;
    for (;;) {
      spin_while([&] { return generation_.load(std::memory_order_acquire) == seen; });
      int helpers;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        helpers = helpers_;
      }
      if (index >= helpers) continue;  // not needed for this job
      ChunkedJob::run(&job_);
      std::lock_guard<std::mutex> lock(mutex_);
      if (finished_.fetch_add(1) + 1 == helpers) done_.notify_one();
    }
  }

  std::mutex busy_;  // held by the running job's caller
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  ChunkedJob job_{nullptr, nullptr, 0, 1};
  int helpers_ = 0;
  std::atomic<int> finished_{0};
};

// The pool of this process.  A forked child has none of the parent's
// threads: it makes its own, and abandons the parent's copy (never destroyed: its mutexes may be
// held by threads that do not exist here).
ThreadPool& pool() {
  static ThreadPool* current = nullptr;
  static pid_t owner = 0;
  static std::mutex guard;
  std::lock_guard<std::mutex> lock(guard);
  if (current == nullptr || owner != getpid()) {
    current = new ThreadPool();
    owner = getpid();
  }
  return *current;
}

// ---- the process's OpenMP runtime ----

// GOMP_parallel is the entry point GCC emits for `#pragma omp parallel`; libgomp defines it, and
// LLVM's libomp and Intel's libiomp5 define it too for GCC-compiled code.  Called through pointers
// looked up in the already-loaded library, so this file needs no -fopenmp and links no runtime:
// linking one would load a second copy beside torch's, with a second set of threads.
struct OpenMPRuntime {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;  // GOMP_parallel
  int (*thread_num)() = nullptr;                                           // omp_get_thread_num
  int (*in_parallel)() = nullptr;                                          // omp_in_parallel
  std::string path;
};

bool is_openmp_library(const char* path) {
  const char* slash = std::strrchr(path, '/');
  const char* name = slash != nullptr ? slash + 1 : path;
  for (const char* prefix : {"libgomp", "libomp", "libiomp5"}) {
    if (std::strncmp(name, prefix, std::strlen(prefix)) == 0) return true;
  }
  return false;
}

OpenMPRuntime find_loaded_openmp() {
  OpenMPRuntime found;
#ifdef __linux__
  std::vector<std::string> candidates;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        if (info->dlpi_name != nullptr && is_openmp_library(info->dlpi_name)) {
          static_cast<std::vector<std::string>*>(data)->emplace_back(info->dlpi_name);
        }
        return 0;
      },
      &candidates);
  for (const std::string& path : candidates) {
    // RTLD_NOLOAD: a handle to the copy already in the process, or nothing; never a new copy.
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    OpenMPRuntime runtime;
    runtime.parallel = reinterpret_cast<decltype(runtime.parallel)>(dlsym(handle, "GOMP_parallel"));
    runtime.thread_num = reinterpret_cast<decltype(runtime.thread_num)>(dlsym(handle, "omp_get_thread_num"));
    runtime.in_parallel = reinterpret_cast<decltype(runtime.in_parallel)>(dlsym(handle, "omp_in_parallel"));
    if (runtime.parallel != nullptr && runtime.thread_num != nullptr && runtime.in_parallel != nullptr) {
      runtime.path = path;
      return runtime;  // the handle stays open: the runtime lives as long as the process
    }
    dlclose(handle);
  }
#endif
  return found;
}

// Looked up on first use (torch, imported before any kernel runs, has loaded its runtime by then).
// "pool" forces the std::thread pool (POSENC_FAST_CPU_THREADS=pool, or set_threading): for
// comparisons and for a runtime that misbehaves.
struct Threading {
  OpenMPRuntime openmp;
  bool use_openmp = false;
  pid_t owner = 0;  // a forked child uses the pool: libgomp's team does not survive fork
};

Threading& threading() {
  static Threading* current = [] {
    auto* t = new Threading();
    t->openmp = find_loaded_openmp();
    const char* requested = std::getenv("POSENC_FAST_CPU_THREADS");
    const bool pool_requested = requested != nullptr && std::strcmp(requested, "pool") == 0;
    t->use_openmp = t->openmp.parallel != nullptr && !pool_requested;
    t->owner = getpid();
    return t;
  }();
  return *current;
}

// Asks Linux to back a buffer about to be written for the first time with transparent huge pages
// (where THP is "madvise"): a large fresh buffer (the [V, d] weight gradient) then takes one page
// fault per 2 MiB instead of per 4 KiB.  Only a hint: no effect on contents.
void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  if (bytes < static_cast<int64_t>(2 * kHuge)) return;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

int64_t element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// ---- instruction-set variants ----

struct Variant {
  const char* name;
  const char* (*forward)(const ForwardArgs&, int num_threads);
  const char* (*weight_grad)(const CpuWeightGradArgs&);
};

#ifndef POSENC_CPU_HAVE_X86_VARIANTS
#define POSENC_CPU_HAVE_X86_VARIANTS 0
#endif

std::vector<Variant> supported_variants() {
  std::vector<Variant> variants;
#if POSENC_CPU_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2")) {
    variants.push_back({"avx512", &isa_avx512::forward, &isa_avx512::weight_grad});
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") &&
      __builtin_cpu_supports("f16c")) {
    variants.push_back({"avx2", &isa_avx2::forward, &isa_avx2::weight_grad});
  }
#endif
  variants.push_back({"baseline", &isa_baseline::forward, &isa_baseline::weight_grad});
  return variants;  // best first
}

Variant selected;

// POSENC_FAST_CPU_ISA=baseline|avx2|avx512 caps the choice (for comparisons); default: the best.
void select_variant(const std::string& name) {
  for (const Variant& v : supported_variants()) {
    if (name.empty() || name == v.name) {
      selected = v;
      return;
    }
  }
  throw py::value_error("POSENC_FAST_CPU_ISA / set_isa: '" + name + "' is not supported on this CPU or build");
}

py::list isa_names() {
  py::list names;
  for (const Variant& v : supported_variants()) names.append(v.name);
  return names;
}

using binding::pointer;

void check(const char* error, const char* what) {
  if (error != nullptr) throw std::runtime_error(std::string("posenc_fast CPU ") + what + ": " + error);
}

// The CPU side of a ForwardLaunch: the selected variant's kernel on the calling thread and its pool.
struct CpuLaunch {
  using Last = int;  // the thread count
  void launch(const ForwardArgs& args, int num_threads) const {
    const char* error;
    {
      py::gil_scoped_release no_gil;
      error = selected.forward(args, num_threads < 1 ? 1 : num_threads);
    }
    check(error, "forward");
  }
};

using ForwardLaunch = binding::ForwardLaunch<CpuLaunch>;

// The weight gradient's CPU part: the thread count.
struct CpuWeightGrad {
  static void weight_grad(const WeightGradArgs& args, int num_threads) {
    if (args.num_embeddings == 0 || args.token_width == 0) return;
    const CpuWeightGradArgs a{args, num_threads < 1 ? 1 : num_threads};
    const char* error;
    {
      py::gil_scoped_release no_gil;
      advise_huge_pages(a.grad_weight, a.num_embeddings * a.token_width * element_bytes(a.weight_dtype));
      error = selected.weight_grad(a);
    }
    check(error, "weight gradient");
  }
};

}  // namespace

void parallel_for(int64_t num_items, int64_t grain, int num_threads, void (*fn)(void*, int64_t, int64_t),
                  void* context) {
  if (num_items <= 0) return;
  if (grain < 1) grain = 1;
  const Threading& t = threading();
  if (!t.use_openmp || t.owner != getpid()) {
    pool().run(num_items, grain, num_threads, fn, context);
    return;
  }
  const int64_t num_chunks = (num_items + grain - 1) / grain;
  const int64_t team = num_threads < num_chunks ? num_threads : num_chunks;
  // Inside a parallel region already (called from an OpenMP worker): run here, as torch's own
  // at::parallel_for does, rather than nest a team.
  if (team <= 1 || t.openmp.in_parallel()) {
    fn(context, 0, num_items);
    return;
  }
  ChunkedJob job{fn, context, num_items, grain};
  t.openmp.parallel(&ChunkedJob::run, &job, static_cast<unsigned>(team), 0);
}

// The smallest and largest of num_ids contiguous ids (int32 or int64), for the id range check of a
// prepared launch: no tensor allocated, where torch.aminmax's two small result tensors can move the
// caching allocator off the output block it just freed.
py::tuple id_range(uintptr_t ids, int ids_dtype, int64_t num_ids) {
  if (num_ids < 1) throw py::value_error("id_range: num_ids must be >= 1");
  if (ids == 0) throw py::value_error("id_range: ids is a null pointer");
  int64_t low = 0, high = 0;
  const auto scan = [&](auto* values) {
    low = high = static_cast<int64_t>(values[0]);
    for (int64_t i = 1; i < num_ids; ++i) {
      const int64_t v = static_cast<int64_t>(values[i]);
      low = v < low ? v : low;
      high = v > high ? v : high;
    }
  };
  if (ids_dtype == static_cast<int>(DType::kInt64)) {
    scan(reinterpret_cast<const int64_t*>(ids));
  } else if (ids_dtype == static_cast<int>(DType::kInt32)) {
    scan(reinterpret_cast<const int32_t*>(ids));
  } else {
    throw py::value_error("id_range: ids_dtype is not INT32 or INT64");
  }
  return py::make_tuple(low, high);
}

std::string threading_name() {
  const Threading& t = threading();
  return t.use_openmp && t.owner == getpid() ? "openmp:" + t.openmp.path : std::string("pool");
}

void set_threading(const std::string& name) {
  Threading& t = threading();
  if (name == "pool") {
    t.use_openmp = false;
  } else if (name == "openmp") {
    if (t.openmp.parallel == nullptr) throw std::invalid_argument("no OpenMP runtime is loaded in this process");
    t.use_openmp = true;
  } else {
    throw std::invalid_argument("threading must be 'openmp' or 'pool', got '" + name + "'");
  }
}

}  // namespace cpu
}  // namespace posenc

PYBIND11_MODULE(_cpu, m) {
  namespace cpu = posenc::cpu;
  m.doc() =
      "posenc_fast CPU kernels (fused embedding + exact sinusoidal PE, forward and deterministic weight "
      "gradient), multithreaded and vectorised.  Framework-free: host pointers as ints, dtype codes.  Called by "
      "posenc_fast.backends.cpu_backend; not a public API.";
  posenc::binding::def_dtype_codes(m);
  const char* requested = std::getenv("POSENC_FAST_CPU_ISA");
  cpu::select_variant(requested != nullptr ? requested : "");

  posenc::binding::def_forward_launch<cpu::ForwardLaunch>(m, "num_threads");
  posenc::binding::def_weight_grad<cpu::CpuWeightGrad, int>(
      m,
      "The deterministic weight gradient (ids sorted by the caller; every element of grad_weight is written); with "
      "a dropout_seed pointer (0: none), through the forward's dropout mask.",
      "num_threads");
  m.def("id_range", &cpu::id_range, py::arg("ids"), py::arg("ids_dtype"), py::arg("num_ids"),
        "(smallest, largest) of num_ids >= 1 contiguous ids, allocating no tensor.");
  m.def("threading", &cpu::threading_name,
        "Where the kernels' threads come from: 'openmp:<library>' (the process's OpenMP runtime, torch's "
        "threads) or 'pool' (posenc_fast's own).");
  m.def("set_threading", &cpu::set_threading, py::arg("name"),
        "Use 'openmp' (the loaded runtime) or 'pool' (our own threads); benchmarks compare them.");
  m.def("isa", [] { return std::string(cpu::selected.name); }, "The instruction-set variant in use.");
  m.def("supported_isas", &cpu::isa_names, "Variants this CPU and build can run, best first.");
  m.def("set_isa", &cpu::select_variant, py::arg("name"),
        "Use variant `name` ('' for the best); tests and benchmarks compare them.");
}
