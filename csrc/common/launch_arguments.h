// What both bindings (cuda/binding.cpp, cpu/cpu_binding.cpp) share: the dtype-code checks and the Python
// signatures of ForwardLaunch and weight_grad (def_forward_launch, def_weight_grad), to which each binding
// appends only its device's own arguments (CUDA: the device, and the stream last; CPU: the thread count last);
// a binding whose device part takes other types does not compile.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "common/kernel_args.h"

namespace posenc {
namespace binding {

namespace py = pybind11;

// A table's dtype code from Python, checked; `name` says whose.
inline DType float_code(int code, const char* name) {
  if (code == static_cast<int>(DType::kFloat32) || code == static_cast<int>(DType::kFloat16) ||
      code == static_cast<int>(DType::kBFloat16)) {
    return static_cast<DType>(code);
  }
  throw py::value_error(std::string(name) + ": dtype code " + std::to_string(code) +
                        " is not FLOAT32, FLOAT16 or BFLOAT16");
}

// An index tensor's dtype code from Python, checked.
inline DType id_code(int code, const char* name) {
  if (code == static_cast<int>(DType::kInt32) || code == static_cast<int>(DType::kInt64)) {
    return static_cast<DType>(code);
  }
  throw py::value_error(std::string(name) + ": dtype code " + std::to_string(code) + " is not INT32 or INT64");
}

template <typename T>
T* pointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// The arguments a module's calls share (table dtype and size, PE columns, scales), converted and checked
// once, so that a decoding step passes only the nine that change: pybind11's per-argument conversion is
// most of a binding call's cost.  `Device` is built from the constructor's extra arguments; `Device::Last`
// is a call's last argument (CUDA stream, CPU thread count), and `launch(args, last)` runs the kernel.
template <typename Device>
class ForwardLaunch {
 public:
  template <typename... Extra>
  ForwardLaunch(int dtype, uintptr_t turns, int64_t num_turns, int64_t num_embeddings, int64_t token_width,
                int64_t pe_width, bool concat, bool interleaved, int64_t sin_base, int64_t num_sin, int64_t cos_base,
                int64_t num_cos, int64_t pe_zero_id, double embed_scale, double pe_scale, bool float64_math,
                Extra... extra)
      : device_(extra...) {
    // The launches divide a row into units: a row with no columns would divide by zero.
    if (token_width < 0 || pe_width < 0 || (concat ? token_width + pe_width : token_width) < 1) {
      throw py::value_error("ForwardLaunch: token_width " + std::to_string(token_width) + " and pe_width " +
                            std::to_string(pe_width) + " give no output column");
    }
    args_.dtype = float_code(dtype, "weight");
    args_.turns = pointer<const int64_t>(turns);
    args_.num_turns = num_turns;
    args_.num_embeddings = num_embeddings;
    args_.token_width = token_width;
    args_.pe_width = pe_width;
    args_.concat = concat;
    args_.columns = PEColumns{interleaved, sin_base, num_sin, cos_base, num_cos};
    args_.pe_zero_id = pe_zero_id;
    args_.embed_scale = embed_scale;
    args_.pe_scale = pe_scale;
    args_.float64_math = float64_math;
  }

  // Positions offset + t % seq_len, no dropout: the call a decoding step makes.
  void operator()(uintptr_t ids, int ids_dtype, uintptr_t weight, int64_t weight_row_stride, uintptr_t out,
                  int64_t offset, int64_t seq_len, int64_t num_tokens, typename Device::Last last) const {
    run(ids, ids_dtype, weight, weight_row_stride, out, 0, 0, offset, seq_len, num_tokens, 0, 0, 1.0, last);
  }

  // Every per-call argument: explicit positions or per-sequence offsets (0: none), dropout.
  void run(uintptr_t ids, int ids_dtype, uintptr_t weight, int64_t weight_row_stride, uintptr_t out,
           uintptr_t positions, uintptr_t offsets, int64_t offset, int64_t seq_len, int64_t num_tokens,
           uintptr_t dropout_seed, uint32_t dropout_threshold, double dropout_scale,
           typename Device::Last last) const {
    ForwardArgs args = args_;
    args.ids = pointer<const void>(ids);
    args.ids_dtype = id_code(ids_dtype, "ids");
    args.weight = pointer<const void>(weight);
    args.weight_row_stride = weight_row_stride;
    args.out = pointer<void>(out);
    args.positions = pointer<const int64_t>(positions);
    args.offsets = pointer<const int64_t>(offsets);
    args.offset = offset;
    args.seq_len = seq_len;
    args.num_tokens = num_tokens;
    args.dropout_seed = pointer<const int64_t>(dropout_seed);
    args.dropout_threshold = dropout_threshold;
    args.dropout_scale = dropout_scale;
    if (num_tokens == 0) return;  // nothing to launch; no device needed
    if (seq_len < 1) throw py::value_error("seq_len must be >= 1, got " + std::to_string(seq_len));
    // A null data pointer (an empty torch tensor) would be dereferenced; only a table with no rows may have one.
    if (args.ids == nullptr || args.out == nullptr || (args.weight == nullptr && args.num_embeddings > 0)) {
      throw py::value_error("forward: the ids, weight or output tensor has no memory (a null data pointer)");
    }
    device_.launch(args, last);
  }

 private:
  ForwardArgs args_{};
  Device device_;
};

// The dtype codes (FLOAT32, ..., INT64) as module attributes.
inline void def_dtype_codes(py::module_& m) {
  m.attr("FLOAT32") = static_cast<int>(DType::kFloat32);
  m.attr("FLOAT16") = static_cast<int>(DType::kFloat16);
  m.attr("BFLOAT16") = static_cast<int>(DType::kBFloat16);
  m.attr("INT32") = static_cast<int>(DType::kInt32);
  m.attr("INT64") = static_cast<int>(DType::kInt64);
}

// `ForwardLaunch`: constructed from the fixed arguments, then `ExtraFixed` (named `extra_fixed`); called with
// the nine that change (a prepared launch), or run with every per-call argument; `call_last` names the
// device's own last argument of both.
template <typename Launch, typename... ExtraFixed, typename... ExtraNames>
void def_forward_launch(py::module_& m, const char* call_last, ExtraNames... extra_fixed) {
  static_assert(sizeof...(ExtraFixed) == sizeof...(ExtraNames), "one name per extra fixed argument");
  py::class_<Launch>(
      m, "ForwardLaunch",
      "The forward with the arguments that stay fixed between a module's calls bound once: out[N, width] = "
      "embed_scale * W[ids] (+) pe_scale * PE(pos), in fp32 arithmetic (or float64 with float64_math), rounded "
      "once. Called with the nine arguments that change (positions offset + t % seq_len, no dropout), or `run` "
      "with every per-call argument: explicit positions or per-sequence offsets (0: none), and a dropout_seed "
      "pointer (0: none) whose Philox words below dropout_threshold zero an element, the others scaled by "
      "dropout_scale.")
      .def(py::init<int, uintptr_t, int64_t, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t,
                    int64_t, int64_t, double, double, bool, ExtraFixed...>(),
           py::arg("dtype"), py::arg("turns"), py::arg("num_turns"), py::arg("num_embeddings"),
           py::arg("token_width"), py::arg("pe_width"), py::arg("concat"), py::arg("interleaved"),
           py::arg("sin_base"), py::arg("num_sin"), py::arg("cos_base"), py::arg("num_cos"), py::arg("pe_zero_id"),
           py::arg("embed_scale"), py::arg("pe_scale"), py::arg("float64_math"), py::arg(extra_fixed)...)
      .def("__call__", &Launch::operator(), py::arg("ids"), py::arg("ids_dtype"), py::arg("weight"),
           py::arg("weight_row_stride"), py::arg("out"), py::arg("offset"), py::arg("seq_len"),
           py::arg("num_tokens"), py::arg(call_last))
      .def("run", &Launch::run, py::arg("ids"), py::arg("ids_dtype"), py::arg("weight"),
           py::arg("weight_row_stride"), py::arg("out"), py::arg("positions"), py::arg("offsets"), py::arg("offset"),
           py::arg("seq_len"), py::arg("num_tokens"), py::arg("dropout_seed"), py::arg("dropout_threshold"),
           py::arg("dropout_scale"), py::arg(call_last));
}

// `weight_grad(<the common arguments>, <Launch's>)`: WeightGradArgs converted and checked, then
// `Launch::weight_grad(args, extra...)` (named `extra_names`) runs both stages.
template <typename Launch, typename... Extra, typename... ExtraNames>
void def_weight_grad(py::module_& m, const char* doc, ExtraNames... extra_names) {
  static_assert(sizeof...(Extra) == sizeof...(ExtraNames), "one name per extra argument");
  m.def(
      "weight_grad",
      [](uintptr_t sorted_ids, int sorted_ids_dtype, uintptr_t order, uintptr_t grad_out, int64_t grad_out_row_stride,
         int grad_dtype, uintptr_t grad_weight, int weight_dtype, int64_t num_tokens, int64_t num_embeddings,
         int64_t token_width, int64_t padding_idx, double embed_scale, uintptr_t dropout_seed,
         uint32_t dropout_threshold, double dropout_scale, Extra... extra) {
        const WeightGradArgs args{pointer<const void>(sorted_ids), id_code(sorted_ids_dtype, "sorted_ids"),
                                  pointer<const int64_t>(order), pointer<const void>(grad_out), grad_out_row_stride,
                                  float_code(grad_dtype, "grad_out"), pointer<void>(grad_weight),
                                  float_code(weight_dtype, "grad_weight"), num_tokens, num_embeddings, token_width,
                                  padding_idx, embed_scale, pointer<const int64_t>(dropout_seed), dropout_threshold,
                                  dropout_scale};
        if (args.grad_dtype != args.weight_dtype && args.grad_dtype != DType::kFloat32) {
          throw py::value_error("grad_out must have the weight's dtype or FLOAT32");
        }
        Launch::weight_grad(args, extra...);
      },
      doc, py::arg("sorted_ids"), py::arg("sorted_ids_dtype"), py::arg("order"), py::arg("grad_out"),
      py::arg("grad_out_row_stride"), py::arg("grad_dtype"), py::arg("grad_weight"), py::arg("weight_dtype"),
      py::arg("num_tokens"), py::arg("num_embeddings"), py::arg("token_width"), py::arg("padding_idx"),
      py::arg("embed_scale"), py::arg("dropout_seed"), py::arg("dropout_threshold"), py::arg("dropout_scale"),
      py::arg(extra_names)...);
}

}  // namespace binding
}  // namespace posenc
