// posenc_fast._C: the pybind11 binding of the CUDA core (posenc.h).
//
// It deliberately does not link libtorch or include ATen: arguments are device pointers (Python
// ints), sizes, strides, dtype codes, a device index and a CUDA stream handle
// (torch.cuda.current_stream().cuda_stream).  So one build works with any torch version, and the
// module imports on a machine without a GPU or driver (the CUDA runtime is linked statically and
// loads the driver only when first used).  Input validation happens in Python before the call;
// here only the codes are checked, and every CUDA error becomes a Python RuntimeError.
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

using posenc::binding::float_code;
using posenc::binding::id_code;
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

void weight_grad(uintptr_t sorted_ids, int sorted_ids_dtype, uintptr_t order, uintptr_t grad_out,
                 int64_t grad_out_row_stride, int grad_dtype, uintptr_t grad_weight, int weight_dtype,
                 uintptr_t partials, int64_t num_tokens, int64_t num_embeddings, int64_t token_width,
                 int64_t padding_idx, double embed_scale, uintptr_t dropout_seed, uint32_t dropout_threshold,
                 double dropout_scale, int64_t chunk, uintptr_t stream, int device) {
  posenc::WeightGradArgs args;
  args.sorted_ids = pointer<const void>(sorted_ids);
  args.sorted_ids_dtype = id_code(sorted_ids_dtype, "sorted_ids");
  args.order = pointer<const int64_t>(order);
  args.grad_out = pointer<const void>(grad_out);
  args.grad_out_row_stride = grad_out_row_stride;
  args.grad_dtype = float_code(grad_dtype, "grad_out");
  args.grad_weight = pointer<void>(grad_weight);
  args.weight_dtype = float_code(weight_dtype, "grad_weight");
  args.partials = pointer<float>(partials);
  args.num_tokens = num_tokens;
  args.num_embeddings = num_embeddings;
  args.token_width = token_width;
  args.padding_idx = padding_idx;
  args.embed_scale = embed_scale;
  args.chunk = chunk;
  args.dropout_seed = pointer<const int64_t>(dropout_seed);
  args.dropout_threshold = dropout_threshold;
  args.dropout_scale = dropout_scale;
  if (args.grad_dtype != args.weight_dtype && args.grad_dtype != posenc::DType::kFloat32) {
    throw py::value_error("grad_out must have the weight's dtype or FLOAT32");
  }
  if (chunk < 1) throw py::value_error("chunk must be >= 1, got " + std::to_string(chunk));
  if (num_tokens == 0 || num_embeddings == 0 || token_width == 0) return;
  py::gil_scoped_release no_gil;
  DeviceGuard guard(device);
  check_cuda(posenc::launch_weight_grad(args, pointer<CUstream_st>(stream)), "weight gradient launch");
}

// Visible CUDA devices; 0 (not an error) when there is no GPU or no driver.
int device_count() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

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

// CUDA driver version as an int (e.g. 13000), 0 when no driver is installed.
int driver_version() {
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return version;
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
  m.def("weight_grad", &weight_grad,
        "Launch both stages of the deterministic weight gradient (ids sorted by the caller); with a "
        "dropout_seed pointer (0: none), of the gradient through the forward's dropout mask.",
        py::arg("sorted_ids"), py::arg("sorted_ids_dtype"), py::arg("order"), py::arg("grad_out"),
        py::arg("grad_out_row_stride"), py::arg("grad_dtype"), py::arg("grad_weight"), py::arg("weight_dtype"),
        py::arg("partials"),
        py::arg("num_tokens"), py::arg("num_embeddings"), py::arg("token_width"), py::arg("padding_idx"),
        py::arg("embed_scale"), py::arg("dropout_seed"), py::arg("dropout_threshold"), py::arg("dropout_scale"),
        py::arg("chunk"), py::arg("stream"), py::arg("device"));
  m.def("device_count", &device_count, "Visible CUDA devices (0 without a GPU or driver; never raises).");
  m.def("device_status", &device_status,
        "(count, reason): reason says why no CUDA device is usable, '' when count > 0.");
  m.def("driver_version", &driver_version, "CUDA driver version (e.g. 13000), 0 without a driver.");
}
