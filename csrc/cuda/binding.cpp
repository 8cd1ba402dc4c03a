// posenc_fast._C: the pybind11 binding of the CUDA kernels (posenc.h).  No libtorch or ATen: pointers are Python
// ints (docs/cuda_backend.md).  Python validates the inputs; here only the codes are checked, and every CUDA
// error becomes a RuntimeError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "common/launch_arguments.h"
#include "cuda/posenc.h"

namespace py = pybind11;

namespace {

#ifndef POSENC_FAST_CUDA_ARCHS
#define POSENC_FAST_CUDA_ARCHS "unknown"
#endif

[[noreturn]] void throw_cuda_error(cudaError_t status, const std::string& what) {
  cudaGetLastError();  // clear a non-sticky error so later calls start clean
  throw std::runtime_error("posenc_fast CUDA " + what + " failed: " + cudaGetErrorName(status) + " (" +
                           cudaGetErrorString(status) + ")");
}

void check_cuda(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) throw_cuda_error(status, what);
}

using posenc::binding::pointer;

#ifdef POSENC_FAST_HOST_EMULATION
// Test build (csrc/cuda/emulation/): the kernels run on the host and the pointers are host memory.
class DeviceGuard {
 public:
  explicit DeviceGuard(int) {}
};
#else
// Makes `device` current for the launch and restores the previous device afterwards, as
// torch's device guards do: tensors on cuda:1 launch on cuda:1 whatever the current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};
#endif

// The CUDA side of a ForwardLaunch: the launch on a stream, on the tensors' device.
struct CudaLaunch {
  using Last = uintptr_t;  // the stream
  explicit CudaLaunch(int device) : device(device) {}
  void launch(const posenc::ForwardArgs& args, uintptr_t stream) const {
    py::gil_scoped_release no_gil;
    DeviceGuard guard(device);
    check_cuda(posenc::launch_forward(args, pointer<CUstream_st>(stream)), "forward launch");
  }
  int device;
};

using ForwardLaunch = posenc::binding::ForwardLaunch<CudaLaunch>;

// The weight gradient's device part: its scratch, the chunk size, the stream and device.
struct CudaWeightGrad {
  static void weight_grad(const posenc::WeightGradArgs& args, uintptr_t partials, int64_t chunk, uintptr_t stream,
                          int device) {
    if (chunk < 1) throw py::value_error("chunk must be >= 1, got " + std::to_string(chunk));
    if (args.num_tokens == 0 || args.num_embeddings == 0 || args.token_width == 0) return;
    py::gil_scoped_release no_gil;
    DeviceGuard guard(device);
    check_cuda(posenc::launch_weight_grad(args, pointer<float>(partials), chunk, pointer<CUstream_st>(stream)),
               "weight gradient launch");
  }
};

// (device count, message): why there is no usable device, in words, or "" when there is one.
py::tuple device_status() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess && count > 0) return py::make_tuple(count, std::string());
  cudaGetLastError();
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
    cudaGetLastError();
    return py::make_tuple(0, std::string("no NVIDIA driver is installed (libcuda.so.1 not found): no GPU here"));
  }
  if (status == cudaErrorInsufficientDriver) {
    return py::make_tuple(0, "the NVIDIA driver supports CUDA " + std::to_string(driver / 1000) + "." +
                                 std::to_string(driver % 1000 / 10) + ", older than the CUDA " +
                                 std::to_string(CUDART_VERSION / 1000) + "." +
                                 std::to_string(CUDART_VERSION % 1000 / 10) +
                                 " runtime this extension was built with: update the driver, or rebuild "
                                 "with an older CUDA toolkit");
  }
  if (status != cudaSuccess) {
    return py::make_tuple(0, std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
  }
  return py::make_tuple(0, std::string("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "posenc_fast CUDA kernels (fused embedding + exact sinusoidal PE, forward and deterministic weight "
      "gradient).  Framework-free: device pointers as ints, dtype codes, a stream handle.  Called by "
      "posenc_fast.backends.cuda_backend; not a public API.";
  posenc::binding::def_dtype_codes(m);
  m.attr("CUDA_RUNTIME_VERSION") = CUDART_VERSION;  // the statically linked runtime
  m.attr("CUDA_ARCHS") = POSENC_FAST_CUDA_ARCHS;  // what the build compiled for (nvcc -gencode list)
#ifdef POSENC_FAST_HOST_EMULATION
  m.attr("HOST_EMULATION") = true;  // test build: kernels run on the CPU, pointers are host memory
#else
  m.attr("HOST_EMULATION") = false;
#endif

  posenc::binding::def_forward_launch<ForwardLaunch, int>(m, "stream", "device");
  posenc::binding::def_weight_grad<CudaWeightGrad, uintptr_t, int64_t, uintptr_t, int>(
      m,
      "Launch both stages of the deterministic weight gradient (ids sorted by the caller); with a dropout_seed "
      "pointer (0: none), of the gradient through the forward's dropout mask.",
      "partials", "chunk", "stream", "device");
  m.def("device_status", &device_status,
        "(count, reason): reason says why no CUDA device is usable, '' when count > 0.");
}
