// A GPU kernel compiled elsewhere (Triton's forward kernel, by posenc_fast.backends.triton_backend) launched
// through the process's CUDA driver with its parameter block built once per specialization.
//
// Triton's own launch function converts every argument of the kernel (thirty-odd Python objects) on each
// call.  A prepared launch changes only five of them between calls: the ids, weight and out addresses, the
// position offset and the sequence length.  `kept_launches()` returns a function of those (plus what picks
// the specialization: the ids' dtype object, the token count, the table's rows and row stride) that finds
// the parameter block kept for the call's specialization (`keep_launch`), writes the five into a copy and
// calls cuLaunchKernel on the stream it is given, all in one C call (METH_FASTCALL: no pybind11 conversion,
// which alone costs about 0.4 us per call).  `kept_launches()` returns that function with its owner (a capsule
// holding the kept blocks).  The function returns False, launching nothing, where an argument does not
// convert, where no block is kept for the call, where the driver is not loaded in the process, or where the
// calling thread has no current context: the caller then goes through Triton, which handles those cases.
//
// Host code only, no CUDA headers: the three driver functions are looked up in the libcuda.so.1 that
// Triton already loaded (never loaded here), with the driver API's stable C signatures.
#pragma once

#include <Python.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace posenc {
namespace driver_launch {

namespace py = pybind11;

using DriverResult = int;  // CUresult: 0 is CUDA_SUCCESS
using LaunchKernelFunction = DriverResult (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                              unsigned block_x, unsigned block_y, unsigned block_z,
                                              unsigned shared_bytes, void* stream, void** parameters, void** extra);
using CurrentContextFunction = DriverResult (*)(void** context);
using ErrorNameFunction = DriverResult (*)(DriverResult error, const char** name);

struct Driver {
  LaunchKernelFunction launch_kernel = nullptr;
  CurrentContextFunction current_context = nullptr;
  ErrorNameFunction error_name = nullptr;
};

// The driver's functions, once the process has loaded libcuda.so.1 (looked up again until it has).
// Callers hold the GIL.
inline const Driver* loaded_driver() {
  static Driver driver;
  if (driver.launch_kernel == nullptr) {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) return nullptr;
    Driver found;
    found.launch_kernel = reinterpret_cast<LaunchKernelFunction>(dlsym(library, "cuLaunchKernel"));
    found.current_context = reinterpret_cast<CurrentContextFunction>(dlsym(library, "cuCtxGetCurrent"));
    found.error_name = reinterpret_cast<ErrorNameFunction>(dlsym(library, "cuGetErrorName"));
    dlclose(library);  // (RTLD_NOLOAD took a reference; Triton's keeps the library loaded)
    if (found.launch_kernel == nullptr || found.current_context == nullptr) return nullptr;
    driver = found;
  }
  return &driver;
}

// What a compiled kernel is specialised on, of what a prepared launch's calls vary: the shape (the grid and
// the arguments after the varying ones follow from it), the ids' dtype, whether 16 divides each address,
// and each int's kind as Triton's JIT specialises it (the constant 1; i32 or i64, 16 dividing it or not).
struct Key {
  int64_t num_tokens, table_rows, row_stride;
  const void* ids_dtype;  // the torch.dtype object (one per dtype, alive for the process)
  int alignment;          // bit k: 16 divides address k (ids, weight, out)
  int offset_kind, seq_len_kind;
  bool operator==(const Key& other) const {
    return num_tokens == other.num_tokens && table_rows == other.table_rows && row_stride == other.row_stride &&
           ids_dtype == other.ids_dtype && alignment == other.alignment && offset_kind == other.offset_kind &&
           seq_len_kind == other.seq_len_kind;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t hash = std::hash<int64_t>()(key.num_tokens);
    for (size_t part : {std::hash<int64_t>()(key.table_rows), std::hash<int64_t>()(key.row_stride),
                        std::hash<const void*>()(key.ids_dtype),
                        static_cast<size_t>(key.alignment | key.offset_kind << 3 | key.seq_len_kind << 6)}) {
      hash = hash * 1000003u ^ part;
    }
    return hash;
  }
};

// triton.runtime.jit's specialisation of an int (Triton 3.5 to 3.9): 0 the constant 1 (not a kernel parameter);
// 1 or 2 an i32 that 16 does not or does divide; 3 or 4 an i64 likewise (values here are under 2**63).
inline int int_kind(int64_t value) {
  if (value == 1) return 0;
  int divisible = value % 16 == 0 ? 1 : 0;
  return (value >= INT32_MIN && value <= INT32_MAX ? 1 : 3) + divisible;
}

inline Key make_key(int64_t num_tokens, int64_t table_rows, int64_t row_stride, const void* ids_dtype,
                    uint64_t ids, uint64_t weight, uint64_t out, int64_t offset, int64_t seq_len) {
  int alignment = (ids % 16 == 0 ? 1 : 0) | (weight % 16 == 0 ? 2 : 0) | (out % 16 == 0 ? 4 : 0);
  return Key{num_tokens, table_rows, row_stride, ids_dtype, alignment, int_kind(offset), int_kind(seq_len)};
}

// The slots a call fills, in the order the launch function takes them.
enum Slot { kIds, kWeight, kOut, kOffset, kSeqLen, kNumSlots };
constexpr size_t kMaxParameterBytes = 1024;
constexpr size_t kMaxParameters = 128;
// Kernels kept per launch function (a decoding loop needs one or two); a backstop: the Python side, at its own
// cap of 64, starts a new set (triton_backend._CompiledLaunches.keep).
constexpr size_t kMaxKept = 64;

struct KeptKernel {
  py::object compiled;  // what owns `function` (Triton's compiled kernel unloads its module when it dies)
  void* function;       // CUfunction
  unsigned grid_x, grid_y, block_x, shared_bytes;
  std::vector<unsigned char> block;       // every parameter's bytes, the slots' placeholders included
  std::vector<uint32_t> offsets;          // each parameter's place in `block`
  std::array<int, kNumSlots> slot_index;  // the parameter each slot fills, or -1 (a constant: no parameter)
  std::array<int, kNumSlots> slot_size;   // its size in bytes (4 or 8)
};

struct KeptLaunches {
  std::unordered_map<Key, KeptKernel, KeyHash> kernels;
};

constexpr const char* kCapsuleName = "posenc_fast.kept_launches";

inline bool read_call(PyObject* const* args, uint64_t* addresses, int64_t* ints) {
  // args: stream, ids_dtype, ids, weight, out, offset, seq_len, num_tokens, table_rows, row_stride
  // (Stops at the first that does not convert: no conversion runs with an error set.)
  addresses[0] = PyLong_AsUnsignedLongLong(args[0]);  // the stream
  if (PyErr_Occurred() != nullptr) return false;
  for (int k = 0; k < 3; ++k) {
    addresses[k + 1] = PyLong_AsUnsignedLongLong(args[2 + k]);
    if (PyErr_Occurred() != nullptr) return false;
  }
  for (int k = 0; k < 5; ++k) {
    ints[k] = PyLong_AsLongLong(args[5 + k]);
    if (PyErr_Occurred() != nullptr) return false;
  }
  return true;
}

// launch(stream, ids_dtype, ids, weight, out, offset, seq_len, num_tokens, table_rows, row_stride) -> bool
inline PyObject* launch(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
  if (num_args != 10) {
    PyErr_Format(PyExc_TypeError, "launch takes 10 arguments (%zd given)", num_args);
    return nullptr;
  }
  auto* launches = static_cast<KeptLaunches*>(PyCapsule_GetPointer(self, kCapsuleName));
  if (launches == nullptr) return nullptr;
  uint64_t addresses[4];  // stream, ids, weight, out
  int64_t ints[5];        // offset, seq_len, num_tokens, table_rows, row_stride
  if (!read_call(args, addresses, ints)) {
    PyErr_Clear();  // (not a call a kernel is kept for: Triton's path says what is wrong)
    Py_RETURN_FALSE;
  }
  auto found = launches->kernels.find(make_key(ints[2], ints[3], ints[4], args[1], addresses[1], addresses[2],
                                               addresses[3], ints[0], ints[1]));
  const Driver* driver = loaded_driver();
  if (found == launches->kernels.end() || driver == nullptr || found->second.grid_x == 0 ||
      found->second.grid_y == 0) {
    Py_RETURN_FALSE;  // (an empty grid: Triton's launcher skips it)
  }
  void* context = nullptr;
  if (driver->current_context(&context) != 0 || context == nullptr) Py_RETURN_FALSE;
  const KeptKernel& kept = found->second;
  // A copy on the stack, filled in: the kept block stays as it is for other threads.
  alignas(16) unsigned char block[kMaxParameterBytes];
  void* parameters[kMaxParameters];
  std::memcpy(block, kept.block.data(), kept.block.size());
  for (size_t i = 0; i < kept.offsets.size(); ++i) parameters[i] = block + kept.offsets[i];
  const uint64_t slot_values[kNumSlots] = {addresses[1], addresses[2], addresses[3],
                                           static_cast<uint64_t>(ints[0]), static_cast<uint64_t>(ints[1])};
  for (int slot = 0; slot < kNumSlots; ++slot) {
    int index = kept.slot_index[slot];
    if (index < 0) continue;
    if (kept.slot_size[slot] == 4) {
      int32_t narrow = static_cast<int32_t>(static_cast<int64_t>(slot_values[slot]));  // an i32 by its key
      std::memcpy(parameters[index], &narrow, 4);
    } else {
      std::memcpy(parameters[index], &slot_values[slot], 8);
    }
  }
  // The compiled kernel stays alive through the launch, made without the GIL (another thread may drop
  // the kept entry meanwhile).
  PyObject* compiled = kept.compiled.ptr();
  Py_INCREF(compiled);
  void* function = kept.function;
  unsigned grid_x = kept.grid_x, grid_y = kept.grid_y, block_x = kept.block_x, shared_bytes = kept.shared_bytes;
  void* stream = reinterpret_cast<void*>(static_cast<uintptr_t>(addresses[0]));
  DriverResult result;
  Py_BEGIN_ALLOW_THREADS;
  result = driver->launch_kernel(function, grid_x, grid_y, 1, block_x, 1, 1, shared_bytes, stream, parameters,
                                 nullptr);
  Py_END_ALLOW_THREADS;
  Py_DECREF(compiled);
  if (result != 0) {
    const char* name = nullptr;
    if (driver->error_name == nullptr || driver->error_name(result, &name) != 0) name = nullptr;
    PyErr_Format(PyExc_RuntimeError, "the CUDA driver refused the Triton kernel's launch: error %d (%s)", result,
                 name != nullptr ? name : "unknown");
    return nullptr;
  }
  Py_RETURN_TRUE;
}

inline PyMethodDef* launch_method() {
  static PyMethodDef method = {
      "launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&launch)), METH_FASTCALL,
      "launch(stream, ids_dtype, ids, weight, out, offset, seq_len, num_tokens, table_rows, row_stride): launch the "
      "kernel kept for this call's specialization (keep_launch) and return True; False, launching nothing, where "
      "none is kept or the driver or a current context is missing."};
  return &method;
}

// (capsule owning the kept kernels, their launch function)
inline py::tuple kept_launches() {
  auto* launches = new KeptLaunches();
  PyObject* capsule = PyCapsule_New(launches, kCapsuleName, [](PyObject* owner) {
    delete static_cast<KeptLaunches*>(PyCapsule_GetPointer(owner, kCapsuleName));
  });
  if (capsule == nullptr) {
    delete launches;
    throw py::error_already_set();
  }
  py::object owner = py::reinterpret_steal<py::object>(capsule);
  PyObject* function = PyCFunction_NewEx(launch_method(), capsule, nullptr);
  if (function == nullptr) throw py::error_already_set();
  return py::make_tuple(owner, py::reinterpret_steal<py::object>(function));
}

// Bytes and size of one kernel parameter of Triton's type `kind` ("*..." a pointer, or i32, u32, i64, u64,
// fp32, fp64: the kinds Triton's launcher packs as themselves; a float as its fp32 or fp64 bits).
inline size_t pack(const std::string& kind, py::handle value, unsigned char* into) {
  if (!kind.empty() && kind[0] == '*') {
    uint64_t address = value.is_none() ? 0 : value.cast<uint64_t>();
    std::memcpy(into, &address, 8);
    return 8;
  }
  if (kind == "i32" || kind == "u32") {
    uint32_t word = kind == "i32" ? static_cast<uint32_t>(value.cast<int32_t>()) : value.cast<uint32_t>();
    std::memcpy(into, &word, 4);
    return 4;
  }
  if (kind == "i64" || kind == "u64") {
    uint64_t word = kind == "i64" ? static_cast<uint64_t>(value.cast<int64_t>()) : value.cast<uint64_t>();
    std::memcpy(into, &word, 8);
    return 8;
  }
  if (kind == "fp32") {
    float single = static_cast<float>(value.cast<double>());
    std::memcpy(into, &single, 4);
    return 4;
  }
  if (kind == "fp64") {
    double full = value.cast<double>();
    std::memcpy(into, &full, 8);
    return 8;
  }
  throw py::value_error("keep_launch: a kernel parameter of type '" + kind + "', which this launch does not pack");
}

// Keep `function`'s launch for calls like this one (the arguments as `launch` takes them, less the stream),
// and a reference to `compiled`, its owner:
// `parameters` is every kernel parameter in order, (Triton's type, value), the values of the slots' parameters
// ignored; `slots` the parameter index each slot fills (ids, weight, out, offset, seq_len), -1 for none.
inline void keep_launch(py::capsule owner, py::handle ids_dtype, uint64_t ids, uint64_t weight, uint64_t out,
                        int64_t offset, int64_t seq_len, int64_t num_tokens, int64_t table_rows, int64_t row_stride,
                        py::object compiled, uint64_t function, unsigned grid_x, unsigned grid_y, unsigned block_x,
                        unsigned shared_bytes, py::list parameters, std::array<int, kNumSlots> slots) {
  auto* launches = static_cast<KeptLaunches*>(PyCapsule_GetPointer(owner.ptr(), kCapsuleName));
  if (launches == nullptr) throw py::error_already_set();
  if (parameters.size() > kMaxParameters) throw py::value_error("keep_launch: too many kernel parameters");
  KeptKernel kept;
  kept.compiled = std::move(compiled);
  kept.function = reinterpret_cast<void*>(static_cast<uintptr_t>(function));
  kept.grid_x = grid_x;
  kept.grid_y = grid_y;
  kept.block_x = block_x;
  kept.shared_bytes = shared_bytes;
  std::vector<std::string> kinds;
  for (py::handle item : parameters) {
    py::tuple pair = py::reinterpret_borrow<py::tuple>(item);
    std::string kind = pair[0].cast<std::string>();
    unsigned char bytes[8];
    size_t offset_in_block = (kept.block.size() + 7) / 8 * 8;  // each parameter 8-byte aligned in the copy
    size_t size = pack(kind, pair[1], bytes);
    if (offset_in_block + size > kMaxParameterBytes) throw py::value_error("keep_launch: kernel parameters too large");
    kept.block.resize(offset_in_block + size);
    std::memcpy(kept.block.data() + offset_in_block, bytes, size);
    kept.offsets.push_back(static_cast<uint32_t>(offset_in_block));
    kinds.push_back(kind);
  }
  for (int slot = 0; slot < kNumSlots; ++slot) {
    int index = slots[slot];
    if (index >= static_cast<int>(kinds.size())) throw py::value_error("keep_launch: a slot past the parameters");
    kept.slot_index[slot] = index;
    kept.slot_size[slot] = 0;
    if (index < 0) continue;
    const std::string& kind = kinds[index];
    bool pointer_slot = slot <= kOut;
    if (pointer_slot ? kind[0] != '*' : kind != "i32" && kind != "i64") {
      throw py::value_error("keep_launch: slot " + std::to_string(slot) + " fills a parameter of type '" + kind + "'");
    }
    kept.slot_size[slot] = kind == "i32" ? 4 : 8;
  }
  Key key = make_key(num_tokens, table_rows, row_stride, ids_dtype.ptr(), ids, weight, out, offset, seq_len);
  // The int slots' kinds must be the ones the key names (a constant has no parameter; i32 is 4 bytes).
  const int kinds_of_key[2] = {key.offset_kind, key.seq_len_kind};
  for (int k = 0; k < 2; ++k) {
    int size = kept.slot_size[kOffset + k];
    int expected = kinds_of_key[k] == 0 ? 0 : kinds_of_key[k] <= 2 ? 4 : 8;
    if (size != expected) throw py::value_error("keep_launch: an int parameter does not match its specialization");
  }
  if (launches->kernels.size() >= kMaxKept) launches->kernels.clear();
  launches->kernels[key] = std::move(kept);
}

inline void define(py::module_& m) {
  m.attr("MAX_KEPT_LAUNCHES") = kMaxKept;  // (the Python side's cap stays at or below it: tests/test_triton_backend.py)
  m.def("kept_launches", &kept_launches,
        "(owner, launch): a new set of kept kernel launches and its launch function (csrc/driver_launch.h).");
  m.def("keep_launch", &keep_launch, py::arg("owner"), py::arg("ids_dtype"), py::arg("ids"), py::arg("weight"),
        py::arg("out"), py::arg("offset"), py::arg("seq_len"), py::arg("num_tokens"), py::arg("table_rows"),
        py::arg("row_stride"), py::arg("compiled"), py::arg("function"), py::arg("grid_x"), py::arg("grid_y"),
        py::arg("block_x"),
        py::arg("shared_bytes"), py::arg("parameters"), py::arg("slots"),
        "Keep a compiled kernel's launch for calls specialised as this one (csrc/driver_launch.h).");
}

}  // namespace driver_launch
}  // namespace posenc
