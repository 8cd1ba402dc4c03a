"""The compiled extensions of posenc_fast: what ``pip install .`` adds to the metadata in pyproject.toml.

``posenc_fast._C`` (backend="cuda") is built with nvcc and ``posenc_fast._cpu`` (backend="cpu") with a C++17
compiler, each where its compiler is found, by posenc_fast/_build.py through the per-user build cache.  The
knobs (POSENC_FAST_BUILD_CUDA, POSENC_FAST_CUDA_ARCHS, POSENC_FAST_BUILD_CPU, ...): docs/cuda_backend.md and
docs/cpu_backend.md, "Building".
"""

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")


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
# Said by build_py, which runs once per build: pip runs this file once per step (requirements, metadata, wheel).
NOTICES = []
if BUILD_MODE == "auto" and NVCC is None:
    NOTICES.append("posenc_fast: nvcc not found, installing without the CUDA extension (backend='cuda'); "
                   "set CUDA_HOME or put nvcc on PATH to build it")


CPU_BUILD_MODE = _build.cpu_build_mode()
CXX = _build.find_cxx() if CPU_BUILD_MODE != "skip" else None
if CPU_BUILD_MODE == "require" and CXX is None:
    raise SystemExit("POSENC_FAST_BUILD_CPU=1 but no C++ compiler was found (c++, g++ or clang++ on PATH, or $CXX)")
if CPU_BUILD_MODE == "auto" and CXX is None:
    NOTICES.append("posenc_fast: no C++ compiler found, installing without the CPU extension (backend='cpu'); "
                   "'auto' runs the torch backend on CPU")


class BuildCudaExtension(build_ext):
    """Builds posenc_fast._C with nvcc (through ninja when available) instead of the C compiler,
    in the per-user build cache, and copies it into the build; and posenc_fast._cpu with the C++
    compiler (_build.build_cpu_in_cache), both through the per-user build cache."""

    def build_extension(self, ext):
        if ext.name == "posenc_fast._cpu":
            try:
                try:
                    built = _build.build_cpu_in_cache(source_dir=CSRC, cxx=CXX)
                except OSError as error:  # no writable cache: build here, uncached
                    print(f"posenc_fast: build cache unusable ({error}); building in {self.build_temp}", file=sys.stderr)
                    built = _build.build_cpu_extension(CSRC, os.path.join(self.build_temp, "posenc_fast_cpu"),
                                                       os.path.join(self.build_temp, _build.cpu_extension_filename()),
                                                       CXX)
                self.mkpath(os.path.dirname(self.get_ext_fullpath(ext.name)))
                self.copy_file(built, self.get_ext_fullpath(ext.name))
            except RuntimeError as error:
                if CPU_BUILD_MODE == "require":
                    raise SystemExit(f"{error}\n\nposenc_fast: the CPU extension did not build.") from None
                print(f"{error}\nposenc_fast: installing without the CPU extension (backend='cpu'); 'auto' runs "
                      "the torch backend on CPU", file=sys.stderr)
            return None
        if ext.name != "posenc_fast._C":
            return super().build_extension(ext)
        output = self.get_ext_fullpath(ext.name)
        progress = _build.open_progress_terminal()
        try:
            try:
                built = _build.build_cached(CSRC, NVCC, CUDA_ARCHS, progress=progress)
            except OSError as error:  # no writable cache (e.g. a read-only home): build here, uncached
                print(f"posenc_fast: build cache unusable ({error}); building in {self.build_temp}", file=sys.stderr)
                built = _build.build_extension(CSRC, os.path.join(self.build_temp, "posenc_fast_C"),
                                               os.path.join(self.build_temp, _build.extension_filename()),
                                               NVCC, CUDA_ARCHS, progress=progress)
                _build.strip_debug_symbols(built)
        except RuntimeError as error:
            raise SystemExit(f"{error}\n\nposenc_fast: the CUDA extension did not build. To install without it, "
                             "set POSENC_FAST_BUILD_CUDA=0.") from None
        finally:
            if progress is not None:
                progress.close()
        self.mkpath(os.path.dirname(output))
        self.copy_file(built, output)


class BuildPyWithSources(build_py):
    """Also ships csrc/ as posenc_fast/_csrc, so an installation without the extension can
    build it on demand later (posenc_fast/_build.py: build_in_cache)."""

    def run(self):
        for notice in NOTICES:
            print(notice, file=sys.stderr)
        super().run()
        if self.editable_mode:
            return  # an editable install finds <repo>/csrc directly
        # A module an earlier build left in the build folder, of an extension not built now (BUILD_CUDA=0 or
        # BUILD_CPU=0 in a checkout installed before), would be packed into the wheel again.
        built_now = {ext.name.rsplit(".", 1)[1] for ext in ext_modules}
        for name in ("_C", "_cpu"):
            stale = os.path.join(self.build_lib, "posenc_fast", _build.extension_filename(name))
            if name not in built_now and os.path.exists(stale):
                os.remove(stale)
        target = os.path.join(self.build_lib, "posenc_fast", "_csrc")
        self.mkpath(target)
        for name in sorted(set(_build.SOURCES + _build.HEADERS + _build.EMULATION_HEADERS + _build.CPU_SOURCES
                               + _build.CPU_HEADERS)):
            self.mkpath(os.path.dirname(os.path.join(target, name)))
            self.copy_file(os.path.join(CSRC, name), os.path.join(target, name))


ext_modules = []
if NVCC is not None:
    ext_modules.append(Extension(
        "posenc_fast._C",
        sources=[os.path.join("csrc", name) for name in _build.SOURCES],
        depends=[os.path.join("csrc", name) for name in _build.HEADERS],
    ))
if CXX is not None:
    ext_modules.append(Extension("posenc_fast._cpu", sources=[os.path.join("csrc", n) for n in _build.CPU_SOURCES],
                                 depends=[os.path.join("csrc", n) for n in _build.CPU_HEADERS]))
# The sdist's file list comes from MANIFEST.in (every file of csrc/, LICENSE), not from these
# Extension lists: they name the CUDA sources only when nvcc is found here.

setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildCudaExtension, "build_py": BuildPyWithSources},
)
