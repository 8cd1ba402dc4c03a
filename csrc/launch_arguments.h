// The forward launch arguments of both bindings (posenc_fast._C, binding.cpp, and posenc_fast._cpu,
// cpu_binding.cpp), described once: their types, order and Python names.  Each binding adds only
// what its device needs last (CUDA: the stream, and the device for a prepared launch; CPU: the
// thread count).  A binding whose functions do not match this description does not compile
// (pybind11 checks the constructor and function signatures against the types listed here).
//
//   forward(ids, ids_dtype, weight, weight_row_stride, dtype, out, turns, num_turns, positions, offsets,
//           offset, seq_len, num_tokens, num_embeddings, token_width, pe_width, concat, interleaved,
//           sin_base, num_sin, cos_base, num_cos, pe_zero_id, embed_scale, pe_scale, float64_math,
//           dropout_seed, dropout_threshold, dropout_scale, <device's own>...)
//   ForwardLaunch(<the fixed arguments: dtype ... float64_math>, <device's own>...)
//   ForwardLaunch.__call__(ids, ids_dtype, weight, weight_row_stride, out, offset, seq_len, num_tokens,
//                          <device's own>)
//
// Pointers are Python ints (uintptr_t), dtypes the modules' codes (FLOAT32, ..., INT64).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace posenc {
namespace binding {

namespace py = pybind11;

// `forward` with every argument.  `Function`'s parameters are the ones listed above, then `last`.
template <typename Function, typename... LastNames>
void def_forward(py::module_& m, Function function, const char* doc, LastNames... last) {
  m.def("forward", function, doc, py::arg("ids"), py::arg("ids_dtype"), py::arg("weight"),
        py::arg("weight_row_stride"), py::arg("dtype"), py::arg("out"), py::arg("turns"), py::arg("num_turns"),
        py::arg("positions"), py::arg("offsets"), py::arg("offset"), py::arg("seq_len"), py::arg("num_tokens"),
        py::arg("num_embeddings"), py::arg("token_width"), py::arg("pe_width"), py::arg("concat"),
        py::arg("interleaved"), py::arg("sin_base"), py::arg("num_sin"), py::arg("cos_base"), py::arg("num_cos"),
        py::arg("pe_zero_id"), py::arg("embed_scale"), py::arg("pe_scale"), py::arg("float64_math"),
        py::arg("dropout_seed"), py::arg("dropout_threshold"), py::arg("dropout_scale"), py::arg(last)...);
}

// `ForwardLaunch`: the arguments a module's calls share bound once (`Launch`'s constructor takes the
// fixed arguments, then `ExtraFixed`, named `extra_fixed`), called with the nine that change
// (positions offset + t % seq_len, no dropout; `call_last` names the ninth, the device's own).
template <typename Launch, typename... ExtraFixed, typename... ExtraNames>
void def_forward_launch(py::module_& m, const char* doc, const char* call_last, ExtraNames... extra_fixed) {
  static_assert(sizeof...(ExtraFixed) == sizeof...(ExtraNames), "one name per extra fixed argument");
  py::class_<Launch>(m, "ForwardLaunch", doc)
      .def(py::init<int, uintptr_t, int64_t, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t,
                    int64_t, int64_t, double, double, bool, ExtraFixed...>(),
           py::arg("dtype"), py::arg("turns"), py::arg("num_turns"), py::arg("num_embeddings"),
           py::arg("token_width"), py::arg("pe_width"), py::arg("concat"), py::arg("interleaved"),
           py::arg("sin_base"), py::arg("num_sin"), py::arg("cos_base"), py::arg("num_cos"), py::arg("pe_zero_id"),
           py::arg("embed_scale"), py::arg("pe_scale"), py::arg("float64_math"), py::arg(extra_fixed)...)
      .def("__call__", &Launch::operator(), py::arg("ids"), py::arg("ids_dtype"), py::arg("weight"),
           py::arg("weight_row_stride"), py::arg("out"), py::arg("offset"), py::arg("seq_len"),
           py::arg("num_tokens"), py::arg(call_last));
}

}  // namespace binding
}  // namespace posenc
