"""Triton's real host path on a machine without a GPU: a stand-in CUDA driver (bench/fake_libcuda.c) under
Triton's own NVIDIA driver module, so that its JIT compiles for an H100 (sm_90) and its launcher extracts
the arguments and calls the driver, which returns at once.

What this allows: timing the ``triton`` backend's host time as a GPU would run it, less the driver's own
launch call (as ``bench/host_overhead.py`` times the ``cuda`` backend: its bindings up to
cudaLaunchKernel), and checking what Triton's launcher hands the driver (the stand-in records the last
launch's grid, block and parameter values).  Tensors stay on the CPU: their addresses pass for device
addresses.  Nothing runs on them.

Needs a C compiler, Triton (3.5 to 3.9) with its NVIDIA backend, and ``ptxas`` (Triton ships it).  Not
for use in a process that has a GPU: the stand-in replaces the process's libcuda for Triton.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sysconfig
from typing import Callable, Optional

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_libcuda.c")
_library = None  # the loaded stand-in, once built


def unavailable() -> Optional[str]:
    """None where the stand-in can be built and Triton's NVIDIA backend loaded here, else why not."""
    try:
        import torch
        import triton  # noqa: F401
        from triton.backends.nvidia import driver
    except ImportError as error:
        return f"Triton's NVIDIA backend cannot be imported: {error}"
    if torch.cuda.is_available():
        return "this process has a GPU: time the real driver (bench/host_overhead.py --real cuda)"
    if _compiler() is None:
        return "no C compiler (CC, gcc or clang, as Triton looks for one) to build the stand-in driver"
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "no Python headers (Python.h), which Triton's launcher is compiled with"
    ptxas = os.environ.get("TRITON_PTXAS_PATH") or os.path.join(os.path.dirname(driver.__file__), "bin", "ptxas")
    if not os.access(ptxas, os.X_OK):
        return f"no ptxas at {ptxas} to compile the kernels for sm_90"
    return None


def _compiler() -> Optional[str]:
    """The C compiler Triton builds its launcher with (``triton.runtime.build``): $CC, else gcc, else clang."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def _build() -> str:
    """The stand-in libcuda.so.1, built once per source in posenc_fast's cache folder; returns its folder."""
    from triton.backends.nvidia import driver

    from posenc_fast import _build as package_build

    compiler = _compiler()
    with open(SOURCE, "rb") as f:  # (the headers' folder and the compiler are part of what is built)
        digest = hashlib.sha256(f.read() + repr((driver.include_dirs, compiler)).encode()).hexdigest()[:16]
    folder = os.path.join(package_build.cache_root(), f"fake-libcuda-{digest}")
    library = os.path.join(folder, "libcuda.so.1")
    if not os.path.exists(library):
        os.makedirs(folder, exist_ok=True)
        partial = f"{library}.{os.getpid()}"
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                        *(f"-I{path}" for path in driver.include_dirs), SOURCE, "-o", partial], check=True)
        os.replace(partial, library)  # whole or not at all, if two processes build it
    linker_name = os.path.join(folder, "libcuda.so")  # what Triton 3.5 and 3.6 link with (-lcuda)
    if not os.path.exists(linker_name):
        try:
            os.symlink("libcuda.so.1", linker_name)
        except FileExistsError:
            pass
    return folder


def load() -> str:
    """Build the stand-in and load it into the process, by its soname (libcuda.so.1, RTLD_GLOBAL), so that what
    looks for the process's driver finds it (Triton's modules, which link libcuda.so.1); returns its folder.  Triton's active driver is left as it is (``install``)."""
    global _library
    folder = _build()
    if _library is None:
        _library = ctypes.CDLL(os.path.join(folder, "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    return folder


def install() -> Callable[[], None]:
    """Make Triton's active driver the NVIDIA one over the stand-in, on device 0 (sm_90) and stream 0.
    Returns a function that restores the previous active driver and TRITON_LIBCUDA_PATH; the stand-in
    stays loaded, and what Triton compiled or cached meanwhile (its JIT's per-device caches, its
    library-folder lookup) stays too: a process that used it should not then look for a real GPU."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"the stand-in CUDA driver cannot be used here: {why}")
    import triton
    from triton.backends.nvidia.driver import CudaDriver

    folder = load()
    saved_path = os.environ.get("TRITON_LIBCUDA_PATH")
    os.environ["TRITON_LIBCUDA_PATH"] = folder
    nvidia = CudaDriver()
    # torch (CPU build) answers these for a CUDA driver; the stand-in has one device, 0, and no streams.
    nvidia.get_current_device = lambda: 0
    nvidia.get_current_stream = lambda device=None: 0
    nvidia.get_device_capability = lambda device=None: (9, 0)
    nvidia.set_current_device = lambda device: None
    previous = triton.runtime.driver._active  # (None until asked for: not asked here, where it raises on CPU)
    triton.runtime.driver.set_active(nvidia)

    def restore():
        triton.runtime.driver._active = previous
        if saved_path is None:
            os.environ.pop("TRITON_LIBCUDA_PATH", None)
        else:
            os.environ["TRITON_LIBCUDA_PATH"] = saved_path
    return restore


class LastLaunch(ctypes.Structure):
    """fake_libcuda.c's record of the last launch."""
    _fields_ = [("launches", ctypes.c_uint64), ("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("shared_bytes", ctypes.c_uint32), ("num_params", ctypes.c_uint32), ("params", ctypes.c_uint64 * 64),
                ("function", ctypes.c_uint64), ("stream", ctypes.c_uint64)]


def record_parameters(sizes) -> None:
    """Record the first ``len(sizes)`` kernel parameters of each launch, each ``sizes[i]`` bytes wide."""
    buffer = (ctypes.c_uint8 * max(len(sizes), 1))(*sizes)
    _library.fake_record_params(ctypes.c_uint32(len(sizes)), buffer)


def last_launch() -> dict:
    """The last launch the stand-in saw: launches so far, the function (kernel handle), stream, grid, block, shared
    bytes, recorded parameters."""
    record = LastLaunch.in_dll(_library, "fake_last_launch")
    return {"launches": record.launches, "function": record.function, "stream": record.stream,
            "grid": tuple(record.grid),
            "block": tuple(record.block), "shared_bytes": record.shared_bytes,
            "params": tuple(record.params[:record.num_params])}
