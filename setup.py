"""Build and install posenc_fast.

``pip install .`` works on any machine with Python and torch (the Triton kernels
are plain Python; Triton itself comes with torch's CUDA wheels, or via the
``[triton]`` extra).

The CUDA C++ extension ``posenc_fast._C`` (backend="cuda") is compiled from csrc/ with
nvcc when the CUDA toolkit is found (CUDA_HOME or CUDA_PATH, PATH, /usr/local/cuda); no GPU
is needed to build it, and it does not link libtorch (docs/cuda_backend.md):

    POSENC_FAST_BUILD_CUDA=0          install without the extension
    POSENC_FAST_BUILD_CUDA=1          the extension is required: no nvcc is an error
    (unset)                           build it if nvcc is found, else install without it
    POSENC_FAST_CUDA_ARCHS="80;90"    target GPUs (default "80;86;89;90+PTX")
    MAX_JOBS=4                        parallel compile jobs (ninja)

The CPU extension ``posenc_fast._cpu`` (backend="cpu", what "auto" runs on CPU tensors) needs only
a C++17 compiler (docs/cpu_backend.md): POSENC_FAST_BUILD_CPU=0 skips it, =1 makes a missing or
failing compiler an error; unset, it is built when c++/g++/clang++ is found, else left out.

The build logic lives in posenc_fast/_build.py (standard library only), shared with the
on-demand build (``python -m posenc_fast._build``).
"""

import importlib.util
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")


def read(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def load_build_helpers():
    """posenc_fast/_build.py, loaded by path: importing the package would need torch, which
    pip's isolated build environment does not have."""
    spec = importlib.util.spec_from_file_location("_posenc_fast_build", os.path.join(HERE, "posenc_fast", "_build.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_build = load_build_helpers()
BUILD_MODE = _build.build_mode()
NVCC = _build.find_nvcc() if BUILD_MODE != "skip" else None
if BUILD_MODE == "require" and NVCC is None:
    raise SystemExit(f"POSENC_FAST_BUILD_CUDA=1 but {_build.no_nvcc_message()}")
CUDA_ARCHS = _build.parse_cuda_archs(os.environ.get("POSENC_FAST_CUDA_ARCHS")) if NVCC else []
if BUILD_MODE == "auto" and NVCC is None:
    print("posenc_fast: nvcc not found, installing without the CUDA extension (backend='cuda'); "
          "set CUDA_HOME or put nvcc on PATH to build it", file=sys.stderr)


CPU_BUILD_MODE = _build.cpu_build_mode()
CXX = _build.find_cxx() if CPU_BUILD_MODE != "skip" else None
if CPU_BUILD_MODE == "require" and CXX is None:
    raise SystemExit("POSENC_FAST_BUILD_CPU=1 but no C++ compiler was found (c++, g++ or clang++ on PATH, or $CXX)")
if CPU_BUILD_MODE == "auto" and CXX is None:
    print("posenc_fast: no C++ compiler found, installing without the CPU extension (backend='cpu'); 'auto' runs "
          "the torch backend on CPU", file=sys.stderr)


class BuildCudaExtension(build_ext):
    """Builds posenc_fast._C with nvcc (through ninja when available) instead of the C compiler,
    and posenc_fast._cpu with the C++ compiler (_build.build_cpu_extension)."""

    def build_extension(self, ext):
        if ext.name == "posenc_fast._cpu":
            try:
                _build.build_cpu_extension(CSRC, os.path.join(self.build_temp, "posenc_fast_cpu"),
                                           self.get_ext_fullpath(ext.name), CXX)
            except RuntimeError as error:
                if CPU_BUILD_MODE == "require":
                    raise SystemExit(f"{error}\n\nposenc_fast: the CPU extension did not build.") from None
                print(f"{error}\nposenc_fast: installing without the CPU extension (backend='cpu'); 'auto' runs "
                      "the torch backend on CPU", file=sys.stderr)
            return None
        if ext.name != "posenc_fast._C":
            return super().build_extension(ext)
        output = self.get_ext_fullpath(ext.name)
        try:
            _build.build_extension(CSRC, os.path.join(self.build_temp, "posenc_fast_C"), output, NVCC, CUDA_ARCHS)
        except RuntimeError as error:
            raise SystemExit(f"{error}\n\nposenc_fast: the CUDA extension did not build. To install without it, "
                             "set POSENC_FAST_BUILD_CUDA=0.") from None


class BuildPyWithSources(build_py):
    """Also ships csrc/ as posenc_fast/_csrc, so an installation without the extension can
    build it on demand later (posenc_fast/_build.py: build_in_cache)."""

    def run(self):
        super().run()
        if self.editable_mode:
            return  # an editable install finds <repo>/csrc directly
        target = os.path.join(self.build_lib, "posenc_fast", "_csrc")
        self.mkpath(target)
        for name in sorted(set(_build.SOURCES + _build.HEADERS + _build.CPU_SOURCES + _build.CPU_HEADERS)):
            self.copy_file(os.path.join(CSRC, name), os.path.join(target, name))


ext_modules = []
if NVCC is not None:
    ext_modules.append(Extension(
        "posenc_fast._C",
        sources=[os.path.join("csrc", name) for name in _build.SOURCES],
        depends=[os.path.join("csrc", name) for name in _build.HEADERS],
    ))
if CXX is not None:
    ext_modules.append(Extension("posenc_fast._cpu", sources=[os.path.join("csrc", n) for n in _build.CPU_SOURCES]))

setup(
    name="posenc_fast",
    version="0.1.0",
    description="Fused token embedding + sinusoidal positional encoding kernels (Triton, PyTorch)",
    long_description=read("README.md"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["posenc_fast", "posenc_fast.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    extras_require={
        "triton": ["triton>=3.0"],
        "plot": ["matplotlib"],
        # pybind11: tests run the CUDA kernels compiled for the host when there is no GPU
        "test": ["pytest", "pytest-benchmark", "matplotlib", "pybind11"],
    },
    entry_points={"console_scripts": ["posenc-fast=posenc_fast.cli:main"]},
    license="BSD-3-Clause",
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildCudaExtension, "build_py": BuildPyWithSources},
)
