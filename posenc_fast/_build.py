"""Building the extensions ``posenc_fast._C`` (CUDA) and, in the section at the end, ``posenc_fast._cpu`` from
csrc/: shared by setup.py and the on-demand build.

    pip install pybind11 ninja              # what the on-demand build needs (ninja: optional, parallel)
    python -m posenc_fast._build            # build (or find) the cached extension, print its path

Standard library only: setup.py loads this file by path inside pip's isolated build environment, where
neither torch nor posenc_fast is importable.  The knobs, the per-user build cache and the flags:
docs/cuda_backend.md and docs/cpu_backend.md, "Building".
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from typing import List, Mapping, NamedTuple, Optional, Sequence, Tuple

# sm_80 (A100), sm_86 (RTX 30xx, A40), sm_89 (L4, RTX 40xx), sm_90 (H100/H200), and PTX of
# sm_90 that the driver JIT-compiles for newer GPUs (Blackwell and later).
DEFAULT_CUDA_ARCHS = "80;86;89;90+PTX"
# Paths under csrc/: common/ (what both extensions share), cuda/ (``_C``), cpu/ (``_cpu``).  Every
# include is written from csrc/ (``#include "common/philox.cuh"``), which each build passes as -I.
COMMON_HEADERS = ("common/kernel_args.h", "common/launch_arguments.h", "common/host_device.h",
                  "common/exact_angle.cuh", "common/philox.cuh")
SOURCES = ("cuda/forward.cu", "cuda/forward_fp32.cu", "cuda/forward_fp16.cu", "cuda/forward_bf16.cu",
           "cuda/weight_grad.cu", "cuda/binding.cpp")
HEADERS = COMMON_HEADERS + ("cuda/posenc.h", "cuda/platform.cuh", "cuda/memory_access.cuh", "cuda/forward_kernels.cuh")
EXTENSION_NAME = "_C"


class CudaArch(NamedTuple):
    """One entry of the architecture list: compute capability "90", "90a", "100f", ...; ptx: also embed PTX."""

    name: str
    ptx: bool

    def gencode(self) -> str:
        codes = [f"sm_{self.name}"] + ([f"compute_{self.name}"] if self.ptx else [])
        return f"arch=compute_{self.name},code=[{','.join(codes)}]"


_ARCH_ENTRY = re.compile(r"^(?:sm_|compute_)?(\d+)(?:\.(\d))?([af]?)(\+ptx)?$", re.IGNORECASE)


def parse_cuda_archs(spec: Optional[str]) -> List[CudaArch]:
    """Parse an architecture list such as ``"80;90"``, ``"8.0 8.6 9.0+PTX"``, ``"sm_90a,100"``.

    Entries are separated by ``;``, ``,`` or spaces; each is a compute capability written as
    ``80``, ``8.0`` or ``sm_80``, optionally with an arch-specific suffix (``90a``, ``100f``)
    and ``+PTX`` to also embed PTX for GPUs newer than the list.  ``None`` or an empty or
    blank string gives the default, ``DEFAULT_CUDA_ARCHS``.  Raises ValueError naming a bad entry.
    """
    if spec is None or not spec.strip():
        spec = DEFAULT_CUDA_ARCHS
    ptx_by_name = {}  # (in the list's order; a repeated entry adds its +PTX)
    for entry in re.split(r"[;,\s]+", spec.strip()):
        if not entry:
            continue
        match = _ARCH_ENTRY.match(entry)
        if match is None:
            raise ValueError(
                f"POSENC_FAST_CUDA_ARCHS: cannot read {entry!r}; expected compute capabilities such as "
                f"'80;86;90', '8.0 9.0', 'sm_90a' or '90+PTX'"
            )
        major_or_all, minor, suffix, ptx = match.groups()
        name = (major_or_all + minor if minor is not None else major_or_all) + suffix.lower()
        if int(re.match(r"\d+", name).group()) < 50:
            raise ValueError(f"POSENC_FAST_CUDA_ARCHS: {entry!r} is not a CUDA compute capability (too small)")
        ptx_by_name[name] = ptx_by_name.get(name, False) or bool(ptx)
    return [CudaArch(name, ptx) for name, ptx in ptx_by_name.items()]


def archs_cover(archs: Sequence[CudaArch], capability: Tuple[int, int]) -> bool:
    """Whether a build for ``archs`` holds code a GPU of compute ``capability`` (major, minor) runs:
    machine code of its major version and a minor no higher, or PTX of a capability no higher, which
    the driver compiles at load.  Arch-specific code ("90a") runs on that capability only, and
    family code ("100f") within its major version."""
    for arch in archs:
        digits = re.match(r"\d+", arch.name).group()
        built, suffix = (int(digits[:-1]), int(digits[-1])), arch.name[len(digits):]
        same_family = built[0] == capability[0] and built[1] <= capability[1]
        if suffix == "a":
            runs = built == capability
        else:
            runs = same_family or (arch.ptx and suffix != "f" and built <= capability)
        if runs:
            return True
    return False


def gencode_flags(archs: Sequence[CudaArch]) -> List[str]:
    return [flag for arch in archs for flag in ("-gencode", arch.gencode())]


def _build_switch(variable: str, what: str, env: Mapping[str, str]) -> str:
    """A build switch: "skip" (0), "require" (1) or "auto" (unset: build if the compiler is found)."""
    value = env.get(variable, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "false", "no", "off"):
        return "skip"
    if value in ("1", "true", "yes", "on"):
        return "require"
    raise ValueError(f"{variable}={value!r}: expected 0 (skip the {what} build) or 1 (require it)")


def build_mode(env: Mapping[str, str] = os.environ) -> str:
    """``POSENC_FAST_BUILD_CUDA``: "skip" (0), "require" (1) or "auto" (unset: build if nvcc is found)."""
    return _build_switch("POSENC_FAST_BUILD_CUDA", "CUDA", env)


def find_nvcc(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """nvcc from CUDA_HOME or CUDA_PATH when set, else from PATH, else from /usr/local/cuda; None if absent."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        root = env.get(variable)
        if root:
            candidate = os.path.join(root, "bin", "nvcc")
            if os.access(candidate, os.X_OK):
                return candidate
    on_path = shutil.which("nvcc", path=env.get("PATH"))
    if on_path:
        return on_path
    candidate = "/usr/local/cuda/bin/nvcc"
    return candidate if os.access(candidate, os.X_OK) else None


def nvcc_version(nvcc: str) -> str:
    """The "release X.Y" line of ``nvcc --version`` (for messages and the cache key)."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release [\d.]+, V[\d.]+", out)
    return match.group(0) if match else out.strip().splitlines()[-1]


def extension_filename(name: str = EXTENSION_NAME) -> str:
    """``_C.cpython-311-x86_64-linux-gnu.so`` (or ``name``'s) for the running interpreter."""
    return name + sysconfig.get_config_var("EXT_SUFFIX")


def _include_dirs() -> List[str]:
    try:
        import pybind11
    except ImportError as error:
        raise RuntimeError("building posenc_fast._C needs pybind11: pip install pybind11") from error
    return [pybind11.get_include(), sysconfig.get_paths()["include"]]


class CompileUnit(NamedTuple):
    """One compile of a build: a source under the source folder, its object's name, its flags."""

    source: str
    name: str
    flags: List[str]


class BuildPlan(NamedTuple):
    """The commands that build an extension: one compile per source, then a link."""

    compiles: List[List[str]]  # each: the compiler command writing objects[i] from sources[i]
    sources: List[str]
    objects: List[str]
    link: List[str]
    output: str
    depends: List[str]  # the headers every compile reads


def _plan(compiler: List[str], units: Sequence[CompileUnit], headers: Sequence[str], source_dir: str, build_dir: str,
          output: str, link: List[str], libraries: Sequence[str] = ()) -> BuildPlan:
    """``compiler`` on each unit into ``build_dir``, then ``link`` of the objects and ``libraries`` into
    ``output``."""
    sources = [os.path.join(source_dir, unit.source) for unit in units]
    objects = [os.path.join(build_dir, unit.name + ".o") for unit in units]
    compiles = [compiler + ["-c", path, "-o", obj] + unit.flags for path, obj, unit in zip(sources, objects, units)]
    return BuildPlan(compiles, sources, objects, link + ["-o", output] + objects + list(libraries), output,
                     [os.path.join(source_dir, h) for h in headers])


def plan_build(source_dir: str, build_dir: str, output: str, nvcc: str, archs: Sequence[CudaArch]) -> BuildPlan:
    """Commands to compile ``SOURCES`` from ``source_dir`` in ``build_dir`` and link ``output``."""
    arch_list = ";".join(a.name + ("+PTX" if a.ptx else "") for a in archs)
    common = [
        "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
        f"-DPOSENC_FAST_CUDA_ARCHS=\"{arch_list}\"", f"-I{source_dir}",
    ] + [f"-I{d}" for d in _include_dirs()]
    device = gencode_flags(archs) + ["-lineinfo"]  # line tables for profilers and compute-sanitizer; no speed cost
    # nvcc links the CUDA runtime statically by default (-cudart static): the module needs only
    # the driver at run time, and does not depend on which libcudart torch ships.
    units = [CompileUnit(source, os.path.basename(source), common + (device if source.endswith(".cu") else []))
             for source in SOURCES]
    return _plan([nvcc], units, HEADERS, source_dir, build_dir, output, [nvcc, "-shared", "-cudart", "static"])


def _ninja_escape(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _write_ninja(plan: BuildPlan, build_dir: str) -> str:
    depends = " ".join(_ninja_escape(h) for h in plan.depends)
    lines = ["ninja_required_version = 1.3", "", "rule run", "  command = $cmd", "  description = $desc", ""]
    for cmd, source, obj in zip(plan.compiles, plan.sources, plan.objects):
        lines += [f"build {_ninja_escape(obj)}: run {_ninja_escape(source)} | {depends}",
                  f"  cmd = {shlex.join(cmd).replace('$', '$$')}",
                  f"  desc = {os.path.basename(cmd[0])} {os.path.basename(obj)}", ""]
    lines += [f"build {_ninja_escape(plan.output)}: run {' '.join(_ninja_escape(o) for o in plan.objects)}",
              f"  cmd = {shlex.join(plan.link).replace('$', '$$')}",
              f"  desc = link {os.path.basename(plan.output)}", ""]
    path = os.path.join(build_dir, "build.ninja")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path


def _find_ninja() -> Optional[str]:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary
    except ImportError:
        return None
    candidate = os.path.join(ninja.BIN_DIR, "ninja")
    return candidate if os.access(candidate, os.X_OK) else None


def run_build(plan: BuildPlan, build_dir: str, log=sys.stderr, progress=None) -> None:
    """Run the plan: through ninja if available (incremental), else its compiles side by side; both in
    parallel, then the link.

    Output goes to ``log``, the ``[n/N]`` step lines also to ``progress`` (a terminal) when given;
    a failing command raises RuntimeError with its output.
    """
    os.makedirs(build_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(plan.output)), exist_ok=True)
    what = "posenc_fast." + os.path.basename(plan.output).split(".")[0]
    ninja = _find_ninja()
    if ninja is not None:
        _write_ninja(plan, build_dir)
        command = [ninja, "-C", build_dir]
        jobs = os.environ.get("MAX_JOBS")
        if jobs:
            command += ["-j", jobs]
        _run(command, what, log, progress)
        return
    steps = len(plan.compiles) + 1
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for cmd in plan.compiles]
    failures = []
    for number, (obj, process) in enumerate(zip(plan.objects, running), 1):
        out, _ = process.communicate()
        print(out, end="", file=log, flush=True)
        _say(f"[{number}/{steps}] {os.path.basename(obj)}", log, progress)
        if process.returncode != 0:
            failures.append(f"$ {shlex.join(process.args)}\n{out[-4000:]}")
    if failures:
        raise RuntimeError(f"building {what} failed:\n" + "\n".join(failures))
    _say(f"[{steps}/{steps}] link", log, progress)
    _run(plan.link, what, log)


_NINJA_STEP = re.compile(r"^\[\d+/\d+\] ")


def _run(command: List[str], what: str, log, progress=None) -> None:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in process.stdout:
        output.append(line)
        print(line, end="", file=log, flush=True)
        if progress is not None and _NINJA_STEP.match(line):
            _say(line.rstrip("\n"), None, progress)
    if process.wait() != 0:
        raise RuntimeError(f"building {what} failed ({os.path.basename(command[0])} exited with "
                           f"{process.returncode}):\n" + "".join(output[-60:]))


def build_extension(source_dir: str, build_dir: str, output: str, nvcc: str, archs: Sequence[CudaArch],
                    log=sys.stderr, progress=None) -> str:
    """Compile csrc/ into the extension file ``output`` with ``nvcc`` for ``archs``; returns it."""
    plan = plan_build(os.path.abspath(source_dir), os.path.abspath(build_dir), os.path.abspath(output), nvcc, archs)
    _say(f"posenc_fast: compiling the CUDA extension with {nvcc} ({nvcc_version(nvcc)}) for "
         f"{', '.join(a.name + ('+PTX' if a.ptx else '') for a in archs)} into {os.path.dirname(output)} "
         "(1-3 minutes on a few cores; POSENC_FAST_CUDA_ARCHS=<your GPU, e.g. 90> makes it faster, "
         "POSENC_FAST_BUILD_CUDA=0 skips it)", log, progress)
    run_build(plan, os.path.abspath(build_dir), log=log, progress=progress)
    return output


def cuda_root(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The CUDA toolkit directory (with include/cuda_runtime_api.h), or None."""
    candidates = [env.get("CUDA_HOME"), env.get("CUDA_PATH")]
    nvcc = find_nvcc(env)
    if nvcc is not None:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for root in candidates:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return root
    return None


def no_nvcc_message() -> str:
    return ("nvcc (the CUDA compiler) was not found: install the CUDA toolkit and put nvcc on PATH, "
            "or set CUDA_HOME to the toolkit directory")


# ---- on-demand build into a per-user cache ----

def _shipped_sources(names: Sequence[str]) -> Optional[str]:
    """csrc/ as shipped, where it holds every file of ``names``: ``posenc_fast/_csrc`` in an installed wheel,
    ``<repo>/csrc`` in a source checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "_csrc"), os.path.join(os.path.dirname(here), "csrc")):
        if all(os.path.exists(os.path.join(candidate, name)) for name in names):
            return candidate
    return None


def package_source_dir() -> Optional[str]:
    """The CUDA sources as shipped (``_shipped_sources``)."""
    return _shipped_sources(SOURCES + HEADERS)


def cache_root(env: Mapping[str, str] = os.environ) -> str:
    """``$POSENC_FAST_CACHE_DIR``, else ``$XDG_CACHE_HOME/posenc_fast``, else ``~/.cache/posenc_fast``."""
    explicit = env.get("POSENC_FAST_CACHE_DIR")
    if explicit:
        return explicit
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "posenc_fast")


def _digest_files(source_dir: str, names: Sequence[str]):
    """A sha256 of ``names`` (paths under ``source_dir``) and their contents, to be updated further."""
    digest = hashlib.sha256()
    for name in names:
        with open(os.path.join(source_dir, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest


def _compiler_cache_dir(kind: str, source_dir: str, names: Sequence[str], compiler: str, extra: tuple,
                        env: Mapping[str, str]) -> str:
    """``<cache root>/<kind>-<hash>``, one build per content of ``names``, ``compiler --version`` and ``extra``."""
    digest = _digest_files(source_dir, names)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest.update(repr((version, *extra)).encode())
    return os.path.join(cache_root(env), f"{kind}-{digest.hexdigest()[:16]}")


def source_key(source_dir: str) -> str:
    """Changes whenever the sources or the Python ABI change (the first level of the cache)."""
    digest = _digest_files(source_dir, SOURCES + HEADERS)
    digest.update(extension_filename().encode())
    return digest.hexdigest()[:16]


def toolchain_key(nvcc: str, archs: Sequence[CudaArch]) -> str:
    """Changes whenever the compiler or the arch list changes (the second level of the cache)."""
    return hashlib.sha256(repr((nvcc_version(nvcc), [tuple(a) for a in archs])).encode()).hexdigest()[:16]


def cache_directory(source_dir: str, nvcc: str, archs: Sequence[CudaArch], env: Mapping[str, str] = os.environ) -> str:
    """``<cache root>/cuda-<source key>/<toolchain key>``: one build per sources, Python ABI, nvcc and archs."""
    return os.path.join(cache_root(env), "cuda-" + source_key(source_dir), toolchain_key(nvcc, archs))


def cached_extension(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """Path of an extension already built (by ``pip install`` or on demand) from these sources for
    this interpreter, or None.

    Needs neither nvcc nor the ``POSENC_FAST_CUDA_ARCHS`` of the build: a build for the arch list
    in the environment wins, else the newest build of these sources is taken (a new shell with
    another or no arch list still finds what ``python -m posenc_fast._build`` made)."""
    source_dir = package_source_dir()
    if source_dir is None:
        return None
    sources_dir = os.path.join(cache_root(env), "cuda-" + source_key(source_dir))
    try:
        builds = [os.path.join(sources_dir, entry, extension_filename()) for entry in os.listdir(sources_dir)]
    except OSError:
        return None
    builds = [path for path in builds if os.path.exists(path)]
    if not builds:
        return None
    nvcc = find_nvcc(env)
    if nvcc is not None and env.get("POSENC_FAST_CUDA_ARCHS", "").strip():
        try:
            wanted = os.path.join(cache_directory(source_dir, nvcc, parse_cuda_archs(env["POSENC_FAST_CUDA_ARCHS"]),
                                                  env), extension_filename())
        except (ValueError, OSError, subprocess.CalledProcessError):
            wanted = None
        if wanted in builds:
            return wanted
    return max(builds, key=os.path.getmtime)


def build_cached(source_dir: str, nvcc: str, archs: Sequence[CudaArch], env: Mapping[str, str] = os.environ,
                 log=sys.stderr, progress=None) -> str:
    """The extension built from ``source_dir`` in the per-user cache, compiled only if that cache has
    no build for these sources, Python ABI, nvcc version and archs; returns its path.  Shared by
    ``pip install`` (setup.py copies the result into the wheel) and the on-demand build."""
    directory = cache_directory(source_dir, nvcc, archs, env)

    def build(output: str, build_dir: str) -> None:
        build_extension(source_dir, build_dir, output, nvcc, archs, log, progress)
    return _build_once(directory, extension_filename(), "the CUDA extension", build, log, progress)


def _build_once(directory: str, filename: str, what: str, build, log, progress=None) -> str:
    """``directory/filename``, made by ``build(output, build_dir)`` unless an earlier build left it there.
    Concurrent processes (one per rank) wait on a file lock and reuse one build; the module appears in one
    rename, so a reader never sees a half-written one; its objects are not kept."""
    output = os.path.join(directory, filename)
    os.makedirs(directory, exist_ok=True)
    import fcntl

    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(output):
            _say(f"posenc_fast: reusing {what} built earlier from these sources: {output}", log, progress)
            return output
        build_dir = os.path.join(directory, "build")
        build(output + ".partial", build_dir)
        strip_debug_symbols(output + ".partial", log)
        os.replace(output + ".partial", output)
        shutil.rmtree(build_dir, ignore_errors=True)
        _say(f"posenc_fast: built {output}", log, progress)
    return output


def strip_debug_symbols(path: str, log=sys.stderr) -> None:
    """Remove the host debug sections and local symbols of the built module (``strip --strip-unneeded``;
    the device code, its line tables included, is untouched).  Skipped, with a note, without binutils."""
    strip = shutil.which("strip")
    if strip is None:
        print("posenc_fast: `strip` (binutils) not found; the extension keeps its host symbols", file=log)
        return
    result = subprocess.run([strip, "--strip-unneeded", path], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"posenc_fast: strip failed, the extension keeps its host symbols: {result.stderr.strip()}", file=log)


def open_progress_terminal():
    """The user's terminal, for the few progress lines of a build that pip runs with its output
    captured (without ``-v`` pip shows none of it); None when stderr already is the terminal, when
    there is none (CI), or with ``POSENC_FAST_BUILD_PROGRESS=0``."""
    if os.environ.get("POSENC_FAST_BUILD_PROGRESS", "1").strip() == "0":
        return None
    try:
        if sys.stderr.isatty():
            return None
        return open("/dev/tty", "w")
    except OSError:
        return None


def _say(line: str, log, progress=None) -> None:
    if log is not None:
        print(line, file=log, flush=True)
    if progress is not None:
        try:  # "\r": start at the line's beginning, over pip's spinner
            print("\r" + line, file=progress, flush=True)
        except OSError:
            pass


def build_in_cache(env: Mapping[str, str] = os.environ, log=sys.stderr) -> str:
    """Build the extension into the per-user cache (once per sources/compiler/archs/Python) and return its path."""
    source_dir = package_source_dir()
    if source_dir is None:
        raise RuntimeError("the CUDA sources (csrc/) are not part of this installation of posenc_fast; "
                           "reinstall it from a source checkout or an sdist with nvcc on PATH")
    nvcc = find_nvcc(env)
    if nvcc is None:
        raise RuntimeError(no_nvcc_message())
    return build_cached(source_dir, nvcc, parse_cuda_archs(env.get("POSENC_FAST_CUDA_ARCHS")), env, log)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        path = build_in_cache()
    except RuntimeError as error:
        print(f"posenc_fast: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---- test support: the kernels compiled for the host (csrc/cuda/platform.cuh, POSENC_FAST_HOST_EMULATION) ----

EMULATION_HEADERS = ("cuda/emulation/host_platform.h",)


def build_host_emulation(env: Mapping[str, str] = os.environ, log=sys.stderr) -> str:
    """Compile csrc/ with the host C++ compiler into a CPU-only ``_C`` whose kernels run thread by
    thread on host memory (cached like ``build_in_cache``); returns its path.

    For tests on machines without a GPU: the same kernel source as the real extension, so their
    indexing, layouts and numerics are checked against the reference.  Needs a C++17 compiler
    (``$CXX``, else ``c++``), the CUDA headers and static runtime, and pybind11.
    """
    source_dir = package_source_dir()
    root = cuda_root(env)
    if source_dir is None or root is None:
        raise RuntimeError("host emulation needs csrc/ and the CUDA toolkit headers")
    compiler = env.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("host emulation needs a C++ compiler (c++ or $CXX)")
    flags = ["-std=c++17", "-O1", "-fPIC", "-DPOSENC_FAST_HOST_EMULATION", f"-I{source_dir}",
             f"-I{os.path.join(root, 'include')}"] + [f"-I{d}" for d in _include_dirs()]
    libdirs = [os.path.join(root, d) for d in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"))]
    link = [compiler, "-shared"] + [f"-L{d}" for d in libdirs if os.path.isdir(d)]

    def build(output: str, build_dir: str) -> None:
        _say(f"posenc_fast: compiling the host emulation of the CUDA kernels into {os.path.dirname(output)} "
             "(about 20 s on two cores, once per source change)", log)
        units = [CompileUnit(source, os.path.basename(source), flags) for source in SOURCES]
        plan = _plan([compiler, "-x", "c++"], units, HEADERS + EMULATION_HEADERS, source_dir, build_dir, output, link,
                     ["-l:libcudart_static.a", "-ldl", "-lpthread", "-lrt"])
        run_build(plan, build_dir, log)
    directory = _compiler_cache_dir("host-emulation", source_dir, SOURCES + HEADERS + EMULATION_HEADERS, compiler,
                                    (root, extension_filename()), env)
    return _build_once(directory, extension_filename(), "the host emulation", build, log)


# ---- the CPU extension posenc_fast._cpu (csrc/cpu/): any C++17 compiler, no CUDA ----

CPU_SOURCES = ("cpu/cpu_kernels.cpp", "cpu/cpu_binding.cpp")
CPU_HEADERS = COMMON_HEADERS + ("cpu/cpu_kernels.h",)
CPU_EXTENSION_NAME = "_cpu"
# cpu_kernels.cpp is compiled once per variant (its namespace, its flags); cpu_binding.cpp picks the
# best the CPU supports at import.  Explicit -m flags rather than -march=x86-64-v4, which older
# compilers lack; FMA contraction is on in every variant that has FMA (GCC's default).
CPU_X86_VARIANTS = (
    ("isa_avx512", ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mbmi2", "-mf16c",
                    "-mprefer-vector-width=512"]),
    ("isa_avx2", ["-mavx2", "-mfma", "-mbmi2", "-mf16c"]),
    ("isa_baseline", []),
)


def cpu_build_mode(env: Mapping[str, str] = os.environ) -> str:
    """``POSENC_FAST_BUILD_CPU``: "skip" (0), "require" (1) or "auto" (unset: build if a C++ compiler is found)."""
    return _build_switch("POSENC_FAST_BUILD_CPU", "CPU", env)


def find_cxx(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The C++ compiler: ``$CXX``, else c++, g++ or clang++ on PATH; None if there is none."""
    explicit = env.get("CXX")
    if explicit:
        return shutil.which(shlex.split(explicit)[0], path=env.get("PATH"))
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return found
    return None


def cpu_extension_filename() -> str:
    return extension_filename(CPU_EXTENSION_NAME)


def _x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def plan_cpu_build(source_dir: str, build_dir: str, output: str, cxx: str) -> BuildPlan:
    """Commands that compile the CPU kernels (once per variant) and the binding, and link ``output``."""
    common = ["-std=c++17", "-O3", "-fPIC", "-fvisibility=hidden", "-pthread", f"-I{source_dir}"]
    variants = CPU_X86_VARIANTS if _x86() else (("isa_baseline", []),)
    units = [CompileUnit(CPU_SOURCES[0], f"cpu_kernels.{namespace}", common + flags + [f"-DPOSENC_CPU_ISA={namespace}"])
             for namespace, flags in variants]
    units.append(CompileUnit(CPU_SOURCES[1], "cpu_binding", common + [f"-I{d}" for d in _include_dirs()]
                             + [f"-DPOSENC_CPU_HAVE_X86_VARIANTS={1 if _x86() else 0}"]))
    libraries = []
    if sys.platform.startswith("linux"):
        libraries.append("-ldl")  # dlopen/dlsym of the process's OpenMP runtime (in libc itself from glibc 2.34)
    if sys.platform == "darwin":
        libraries += ["-undefined", "dynamic_lookup"]
    return _plan([cxx], units, CPU_HEADERS, source_dir, build_dir, output, [cxx, "-shared", "-pthread"], libraries)


def build_cpu_extension(source_dir: str, build_dir: str, output: str, cxx: str, log=sys.stderr) -> str:
    """Compile the CPU extension into ``output`` with ``cxx``; returns it."""
    plan = plan_cpu_build(os.path.abspath(source_dir), os.path.abspath(build_dir), os.path.abspath(output), cxx)
    print(f"posenc_fast: building the CPU extension with {cxx} ({len(plan.compiles)} compiles)", file=log, flush=True)
    run_build(plan, os.path.abspath(build_dir), log)
    return output


def cpu_source_dir() -> Optional[str]:
    """The CPU sources as shipped (``_shipped_sources``)."""
    return _shipped_sources(CPU_SOURCES + CPU_HEADERS)


def _cpu_cache_dir(source_dir: str, cxx: str, env: Mapping[str, str]) -> str:
    return _compiler_cache_dir("cpu", source_dir, CPU_SOURCES + CPU_HEADERS, cxx,
                               (list(CPU_X86_VARIANTS), cpu_extension_filename()), env)


def cached_cpu_extension(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """Path of a CPU extension already built on demand for these sources and this interpreter, or None."""
    source_dir, cxx = cpu_source_dir(), find_cxx(env)
    if source_dir is None or cxx is None:
        return None
    path = os.path.join(_cpu_cache_dir(source_dir, cxx, env), cpu_extension_filename())
    return path if os.path.exists(path) else None


def build_cpu_in_cache(env: Mapping[str, str] = os.environ, log=sys.stderr, source_dir: Optional[str] = None,
                       cxx: Optional[str] = None) -> str:
    """Build the CPU extension into the per-user cache (once per sources/compiler/Python); returns its path.
    Shared by the on-demand build and ``pip install``, as ``build_cached`` is."""
    source_dir, cxx = source_dir or cpu_source_dir(), cxx or find_cxx(env)
    if source_dir is None:
        raise RuntimeError("the C++ sources (csrc/) are not part of this installation of posenc_fast")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (c++, g++ or clang++ on PATH, or $CXX)")
    return _build_once(_cpu_cache_dir(source_dir, cxx, env), cpu_extension_filename(), "the CPU extension",
                       lambda output, build_dir: build_cpu_extension(source_dir, build_dir, output, cxx, log), log)
