"""The CUDA C++ backend without a GPU: build, import, error messages, architecture list.

Runs in CI (no GPU, nvcc present).  What needs the *installed* extension runs in a subprocess
started outside the source tree, because ``python -m pytest`` puts the checkout first on
``sys.path`` and a non-editable install keeps ``_C`` in site-packages.  With
POSENC_FAST_BUILD_CUDA=1 in the environment (CI sets it) a missing extension fails instead of
skipping.  The kernels' results are checked by the accuracy suites through ``cases.backend_targets``
(on a GPU, or compiled for the host without one); the chunked-gradient, stride and dropout-alignment
tests at the end run on that same target.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import posenc_fast as pf
from posenc_fast import _build, _dropout, reference
from posenc_fast._dispatch import resolve_backend
from posenc_fast.backends import cuda_backend

from cases import Case, assert_within, backend_targets, make_inputs, output_bound, ulp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXTENSION_REQUIRED = os.environ.get("POSENC_FAST_BUILD_CUDA", "").strip() == "1"
CUDA_TARGETS = [p for p in backend_targets() if p.values[0] == "cuda"]


def _run_installed(script: str, tmp_path, **env_overrides) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter whose cwd is not the checkout (so it imports the installed package)."""
    env = dict(os.environ, **env_overrides)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def real_extension_state(monkeypatch):
    """The backend as users have it: no host emulation, a fresh lookup of the extension."""
    monkeypatch.setattr(cuda_backend, "_host_emulation", False)
    monkeypatch.setattr(cuda_backend._lookup, "state", None)
    monkeypatch.setenv("POSENC_FAST_BUILD_ON_DEMAND", "0")


# ---- the installed extension ----

_PROBE = """
    import json, sys
    import posenc_fast
    assert "posenc_fast._C" not in sys.modules, "import posenc_fast must not import the extension"
    try:
        import posenc_fast._C as C
    except ImportError as error:
        print(json.dumps({"missing": str(error)}))
        sys.exit(0)
    import torch
    from posenc_fast.backends import Dropout, KernelParams, _extension, cuda_backend
    from posenc_fast._spec import PEColumns
    count, why = C.device_status()
    report = dict(file=C.__file__, device_count=count, why=why, runtime=C.CUDA_RUNTIME_VERSION,
                  archs=C.CUDA_ARCHS, emulation=C.HOST_EMULATION)
    # The Python side's argument list matches the binding's: 0 tokens launch nothing and need no GPU.
    params = KernelParams(True, 6, 5, PEColumns(False, 0, 3, 3, 2), 1.5, 0.5, -1, False)
    empty = torch.empty(0, dtype=torch.int64)
    # Without dropout, and with it (a threshold above 2**31 must pass as the binding's uint32).
    for dropout in (None, Dropout(torch.zeros(1, dtype=torch.int64), 2**32 - 1, 10.0)):
        _extension.launch_forward(C, "cuda", empty, torch.zeros(4, 6), torch.empty(0, 11),
                                  torch.zeros(3, dtype=torch.int64), None, None, 7, 1, params, dropout, 0, 0)
        cuda_backend._launch_weight_grad(C, empty, empty, torch.empty(0, 11), torch.zeros(4, 6), torch.empty(0),
                                         -1, 1.5, dropout, 32, 0, 0)
    try:
        C.ForwardLaunch(99, 0, 3, 4, 6, 5, True, False, 0, 3, 3, 2, -1, 1.0, 1.0, False, 0)
    except ValueError as error:
        report["bad_code"] = str(error)
    try:  # one token and null pointers (a zero tensor has no memory): refused before any device work
        C.ForwardLaunch(C.FLOAT32, 0, 3, 4, 6, 5, True, False, 0, 3, 3, 2, -1, 1.0, 1.0, False, 0).run(
            0, C.INT64, 0, 6, 0, 0, 0, 0, 1, 1, 0, 0, 1.0, 0)
    except ValueError as error:
        report["null_pointer"] = str(error)
    # weight_grad's checks, before any memory is read (the addresses are never dereferenced).
    report["weight_grad_errors"] = []
    for codes, chunk in (((C.FLOAT32, C.FLOAT32, C.FLOAT32), 32), ((C.INT64, C.INT64, C.FLOAT32), 32),
                         ((C.INT64, C.FLOAT16, C.BFLOAT16), 32), ((C.INT64, C.FLOAT32, C.FLOAT32), 0)):
        try:
            C.weight_grad(256, codes[0], 256, 256, 8, codes[1], 256, codes[2], 4, 10, 8, -1, 1.0, 0, 0, 1.0, 256,
                          chunk, 0, 0)
        except ValueError as error:
            report["weight_grad_errors"].append(str(error))
    if count == 0:
        # One token on a machine without a GPU: a clean RuntimeError before anything touches memory
        # (the addresses are never dereferenced; nonzero, as null ones are refused first).
        address = 256
        try:
            C.ForwardLaunch(C.FLOAT32, address, 3, 4, 6, 5, True, False, 0, 3, 3, 2, -1, 1.0, 1.0, False, 0).run(
                address, C.INT64, address, 6, address, 0, 0, 0, 1, 1, 0, 0, 1.0, 0)
        except RuntimeError as error:
            report["launch_error"] = str(error)
    print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    result = _run_installed(_PROBE, tmp_path_factory.mktemp("probe"))
    assert result.returncode == 0, f"the extension probe crashed (rc {result.returncode}):\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "missing" in report:
        message = (f"posenc_fast was installed without the CUDA extension ({report['missing']}); "
                   "install with nvcc on PATH (POSENC_FAST_BUILD_CUDA=1 makes that an error)")
        if EXTENSION_REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    return report


def test_extension_imports_and_reports_devices(installed):
    assert installed["emulation"] is False
    assert installed["runtime"] >= 12000
    assert installed["archs"] and installed["archs"] != "unknown"
    if installed["device_count"] == 0:
        assert installed["why"], "no device, but no reason given"
    else:
        assert installed["why"] == ""
    assert "dtype code 99" in installed["bad_code"]
    assert "null data pointer" in installed["null_pointer"]
    assert installed["weight_grad_errors"] == [
        "sorted_ids: dtype code 0 is not INT32 or INT64", "grad_out: dtype code 4 is not FLOAT32, FLOAT16 or BFLOAT16",
        "grad_out must have the weight's dtype or FLOAT32", "chunk must be >= 1, got 0"]


def test_extension_without_gpu_raises_cleanly(installed):
    if installed["device_count"] > 0:
        pytest.skip("a GPU is present")
    assert installed["launch_error"].startswith("posenc_fast CUDA"), installed["launch_error"]


def test_import_without_extension(tmp_path):
    """``import posenc_fast`` works with no extension, and backend='cuda' then says how to build it."""
    script = """
        import sys
        sys.modules["posenc_fast._C"] = None  # as if it had not been built
        import torch
        import posenc_fast as pf
        from posenc_fast.backends import cuda_backend
        out = pf.sinusoidal_embedding(torch.tensor([[1, 2]]), torch.randn(4, 8))  # auto still works
        assert out.shape == (1, 2, 8)
        print(cuda_backend.available(torch.device("cuda")))
    """
    result = _run_installed(script, tmp_path, POSENC_FAST_CACHE_DIR=str(tmp_path / "cache"),
                            POSENC_FAST_BUILD_ON_DEMAND="0")
    assert result.returncode == 0, result.stderr[-4000:]
    message = result.stdout.strip().splitlines()[-1]
    assert "posenc_fast._C" in message and "pip install" in message and "python -m posenc_fast._build" in message


# ---- error messages in this process ----

def test_cuda_backend_on_cpu_tensors_raises(real_extension_state):
    ids, weight = torch.tensor([[1, 2, 3]]), torch.randn(5, 8)
    with pytest.raises(RuntimeError, match=r"CUDA tensors.*backend='cpu'"):
        pf.sinusoidal_embedding(ids, weight, backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_backend_without_gpu_raises(real_extension_state):
    reason = cuda_backend.available(torch.device("cuda"))
    assert reason is not None
    assert ("NVIDIA GPU" in reason) or ("posenc_fast._C" in reason and "pip install" in reason), reason
    with pytest.raises(RuntimeError, match="backend='cuda'"):
        resolve_backend("cuda", torch.device("cuda"), torch.float32)
    from posenc_fast.backends import cpu_backend  # auto on CPU: the CPU kernels when built, else torch

    expected = "cpu" if cpu_backend.extension_problem() is None else "torch"
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == expected


def test_auto_on_cuda_tensors_takes_the_cuda_backend_first_then_triton(monkeypatch):
    """The order measured on an H200 (docs/cuda_backend.md): the CUDA kernels where usable, else Triton,
    else torch; a backend that cannot take the dtype is passed over."""
    from posenc_fast.backends import triton_backend

    gpu = torch.device("cuda")
    monkeypatch.setattr(triton_backend, "available", lambda device: None)
    monkeypatch.setattr(cuda_backend, "available", lambda device: None)
    assert resolve_backend("auto", gpu, torch.bfloat16) == "cuda"
    assert resolve_backend("auto", gpu, torch.float64) == "torch"  # float64 tables: the reference op
    monkeypatch.setattr(cuda_backend, "available", lambda device: "no extension")
    assert resolve_backend("auto", gpu, torch.bfloat16) == "triton"
    monkeypatch.setattr(triton_backend, "available", lambda device: "no triton")
    assert resolve_backend("auto", gpu, torch.bfloat16) == "torch"


def test_availability_traces_under_compile(real_extension_state):
    """torch.compile(fullgraph=True) of code that asks for the cuda backend, before anything loaded the
    extension: the lookup runs once at trace time instead of breaking the graph."""
    torch._dynamo.reset()

    def step(x):
        return x + (1 if cuda_backend.available(torch.device("cuda")) is None else 2)

    expected = 1 if cuda_backend.available(torch.device("cuda")) is None else 2
    cuda_backend._lookup.state = None
    assert torch.equal(torch.compile(step, fullgraph=True, backend="aot_eager")(torch.zeros(2)),
                       torch.full((2,), float(expected)))


# ---- POSENC_FAST_CUDA_ARCHS and the other build knobs ----

@pytest.mark.parametrize("spec,expected", [
    (None, [("80", False), ("86", False), ("89", False), ("90", True)]),
    ("", [("80", False), ("86", False), ("89", False), ("90", True)]),
    ("80;90", [("80", False), ("90", False)]),
    ("8.0 8.6 9.0+PTX", [("80", False), ("86", False), ("90", True)]),
    ("sm_90a, 100+ptx", [("90a", False), ("100", True)]),
    ("90;90+PTX", [("90", True)]),
    ("compute_120f", [("120f", False)]),
])
def test_arch_list_parsing(spec, expected):
    assert [tuple(a) for a in _build.parse_cuda_archs(spec)] == expected


@pytest.mark.parametrize("bad", ["ampere", "8.x", "30", "90;;sm_", "90+SASS"])
def test_arch_list_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="POSENC_FAST_CUDA_ARCHS"):
        _build.parse_cuda_archs(bad)


@pytest.mark.parametrize("spec,capability,runs", [
    ("80;86;89;90+PTX", (7, 5), False),  # the default build on a T4: nothing older than sm_80
    ("80;86;89;90+PTX", (8, 0), True), ("80;86;89;90+PTX", (8, 7), True),  # sm_86 code runs on 8.7
    ("80;86;89;90+PTX", (12, 0), True),  # a newer GPU: the driver compiles the sm_90 PTX
    ("90", (8, 0), False), ("90", (12, 0), False), ("90", (9, 0), True),  # no PTX: sm_90 machines only
    ("86", (8, 0), False), ("80", (8, 9), True),
    ("90a", (9, 0), True), ("90a+PTX", (10, 0), False),  # arch-specific: that capability only
    ("100f", (10, 3), True), ("100f", (12, 0), False),
])
def test_which_gpus_a_build_runs_on(spec, capability, runs):
    assert _build.archs_cover(_build.parse_cuda_archs(spec), capability) is runs


def test_a_build_without_code_for_the_gpu_is_refused_and_auto_takes_triton(monkeypatch):
    """An extension built for sm_90 only, on a GPU of capability 8.0: backend='cuda' says how to rebuild,
    and auto passes over it to Triton instead of failing at launch."""
    from types import SimpleNamespace

    from posenc_fast.backends import triton_backend

    module = SimpleNamespace(CUDA_ARCHS="90")
    monkeypatch.setattr(cuda_backend, "_lookup", lambda: SimpleNamespace(module=module, problem=None))
    monkeypatch.setattr(cuda_backend, "_unusable_reason", lambda: None)
    monkeypatch.setattr(cuda_backend, "_host_emulation", False)
    monkeypatch.setattr(cuda_backend, "_arch_reasons", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA A100")
    reason = cuda_backend.available(torch.device("cuda"))
    assert reason is not None and "built for 90" in reason and "NVIDIA A100" in reason and "8.0" in reason
    assert 'POSENC_FAST_CUDA_ARCHS="80"' in reason
    monkeypatch.setattr(triton_backend, "available", lambda device: None)
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "triton"
    module.CUDA_ARCHS = "80;90"
    monkeypatch.setattr(cuda_backend, "_arch_reasons", {})  # the answer is kept per module and GPU: ask again
    assert cuda_backend.available(torch.device("cuda:0")) is None
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "cuda"


def test_gencode_flags():
    assert _build.gencode_flags(_build.parse_cuda_archs("80;90+PTX")) == [
        "-gencode", "arch=compute_80,code=[sm_80]", "-gencode", "arch=compute_90,code=[sm_90,compute_90]"]


@pytest.mark.parametrize("value,mode", [("", "auto"), ("0", "skip"), ("1", "require"), ("auto", "auto")])
def test_build_mode(value, mode):
    assert _build.build_mode({"POSENC_FAST_BUILD_CUDA": value}) == mode


def test_build_mode_rejects_nonsense():
    with pytest.raises(ValueError, match="POSENC_FAST_BUILD_CUDA"):
        _build.build_mode({"POSENC_FAST_BUILD_CUDA": "maybe"})


def test_find_nvcc_prefers_cuda_home(tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    assert _build.find_nvcc({"CUDA_HOME": str(tmp_path), "PATH": ""}) == str(nvcc)


def test_sources_are_complete():
    """Every file in csrc/ a build needs (CUDA or CPU) is listed (and so compiled, shipped and hashed for the cache)."""
    listed = set(_build.SOURCES + _build.HEADERS + _build.EMULATION_HEADERS + _build.CPU_SOURCES + _build.CPU_HEADERS)
    present = {os.path.relpath(os.path.join(d, f), os.path.join(REPO, "csrc"))
               for d, _, files in os.walk(os.path.join(REPO, "csrc")) for f in files}
    assert present == listed


def _fake_toolkit(tmp_path):
    """A CUDA_HOME whose nvcc only answers --version (the cache key reads it)."""
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    return str(nvcc), {"CUDA_HOME": str(nvcc.parent.parent), "POSENC_FAST_CACHE_DIR": str(tmp_path / "cache")}


def test_a_build_without_pybind11_says_so_before_announcing_a_compile(tmp_path, monkeypatch):
    """The on-demand build names the missing pybind11 first: no "compiling" line promises minutes of work."""
    import builtins
    import io

    nvcc, env = _fake_toolkit(tmp_path)
    real_import = builtins.__import__

    def no_pybind11(name, *args, **kwargs):
        if name == "pybind11":
            raise ImportError("No module named 'pybind11'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pybind11)
    log = io.StringIO()
    with pytest.raises(RuntimeError, match="needs pybind11"):
        _build.build_cached(_build.package_source_dir(), nvcc, _build.parse_cuda_archs("90"), env, log)
    assert "compiling" not in log.getvalue(), log.getvalue()


def test_build_cache_is_reused_and_found_whatever_the_arch_list(tmp_path, monkeypatch):
    """pip install builds into the per-user cache: installing again does not compile again, and an
    installed package finds the build in a new shell with another (or no) POSENC_FAST_CUDA_ARCHS."""
    nvcc, env = _fake_toolkit(tmp_path)
    compiled = []

    def fake_compile(source_dir, build_dir, output, nvcc, archs, log, progress=None):
        compiled.append([a.name for a in archs])
        with open(output, "w") as f:
            f.write(f"module for {compiled[-1]}")
        return output

    monkeypatch.setattr(_build, "build_extension", fake_compile)
    monkeypatch.setattr(_build, "strip_debug_symbols", lambda path, log=None: None)
    source_dir = _build.package_source_dir()
    log = open(os.devnull, "w")
    for_90 = _build.build_cached(source_dir, nvcc, _build.parse_cuda_archs("90"), env, log)
    assert _build.build_cached(source_dir, nvcc, _build.parse_cuda_archs("90"), env, log) == for_90
    assert compiled == [["90"]], "the second build of the same sources, nvcc and archs compiled again"
    assert _build.cached_extension(dict(env, POSENC_FAST_CUDA_ARCHS="90")) == for_90
    assert _build.cached_extension(env) == for_90, "a new shell without the arch list must find the build"
    assert _build.cached_extension(dict(env, POSENC_FAST_CUDA_ARCHS="80")) == for_90
    for_80 = _build.build_cached(source_dir, nvcc, _build.parse_cuda_archs("80"), env, log)
    assert compiled == [["90"], ["80"]] and for_80 != for_90
    assert _build.cached_extension(dict(env, POSENC_FAST_CUDA_ARCHS="90")) == for_90, "the asked-for archs win"
    assert _build.cached_extension(dict(env, POSENC_FAST_CUDA_ARCHS="80")) == for_80


def _source_copy(tmp_path):
    """What an sdist holds, copied from the checkout into ``tmp_path/source`` (no built modules)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy(os.path.join(REPO, name), source / name)
    for folder in ("posenc_fast", "csrc"):
        shutil.copytree(os.path.join(REPO, folder), source / folder,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__", "_csrc"))
    return source


@pytest.mark.slow
def test_a_build_says_what_it_leaves_out_once(tmp_path):
    """pip runs setup.py once per step (requirements, metadata, wheel): the notice of an extension left out
    comes once, from the build."""
    env = {**os.environ, "POSENC_FAST_BUILD_CUDA": "0", "CXX": "no-such-compiler"}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", ".",
                           "-w", str(tmp_path / "dist")], cwd=_source_copy(tmp_path), env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("no C++ compiler found, installing without the CPU extension") == 1


@pytest.mark.slow
def test_a_wheel_without_the_cuda_extension_holds_none_from_an_earlier_build(tmp_path):
    """POSENC_FAST_BUILD_CUDA=0 in a checkout built before: the module the earlier build left in setuptools'
    build folder is not packed into the new wheel (the CPU extension, built now, is)."""
    import sysconfig
    import zipfile

    source = _source_copy(tmp_path)
    # setuptools' build folder for a wheel with extensions: build/lib.<platform>-<cache tag>
    build_lib = source / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    (build_lib / "posenc_fast").mkdir(parents=True)
    (build_lib / "posenc_fast" / _build.extension_filename()).write_text("an earlier build's module")
    env = {**os.environ, "POSENC_FAST_BUILD_CUDA": "0", "POSENC_FAST_BUILD_PROGRESS": "0"}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".",
                           "-w", str(tmp_path / "dist")], cwd=source, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    modules = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    assert modules == [f"posenc_fast/{_build.cpu_extension_filename()}"], modules


def test_a_failed_on_demand_build_is_not_tried_again():
    """An on-demand build that failed is tried once per process: each later call gets its error at once
    instead of waiting for another build."""
    from posenc_fast.backends._extension import Lookup

    lookup = Lookup("_not_an_extension", "cached_extension", "missing", "hint")
    attempts = []

    def failing_build():
        attempts.append(1)
        raise RuntimeError("nvcc exited with status 1")

    for _ in range(3):
        state = lookup.load_build(failing_build, "building it on demand failed")
        assert state.module is None and state.problem == "building it on demand failed: nvcc exited with status 1"
        assert lookup.state is state
    assert len(attempts) == 1


def test_build_cache_key_follows_the_sources(tmp_path):
    nvcc, env = _fake_toolkit(tmp_path)
    copy = tmp_path / "csrc"
    shutil.copytree(_build.package_source_dir(), copy)
    before = _build.cache_directory(str(copy), nvcc, _build.parse_cuda_archs("90"), env)
    with open(copy / _build.SOURCES[0], "a") as f:
        f.write("\n// changed\n")
    assert _build.cache_directory(str(copy), nvcc, _build.parse_cuda_archs("90"), env) != before


# ---- kernel behaviour on the cuda target (a GPU, or the host emulation) ----

def _gradients(fn, weight, grad_out):
    w = weight.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(fn(w), w, grad_out)
    return grad


@pytest.mark.parametrize("backend,device", CUDA_TARGETS or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no cuda target here (no GPU, and no host emulation)"))])
@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_cuda_gradient_runs_across_chunks(chunk, backend, device, seed, monkeypatch):
    """Runs of equal ids crossing 1, several and many stage-1 chunks combine exactly once."""
    monkeypatch.setattr(cuda_backend, "GRAD_CHUNK", chunk)
    case = Case("runs", (2, 45), 6, 10, mode="concat", d_pos=3, padding_idx=2, hot_id=True)
    ids, weight, kwargs = make_inputs(case, device, torch.float32, seed)
    ids.view(-1)[:20] = 4  # one long run, one padding run, short runs
    ids.view(-1)[-7:] = 5
    grad_out = torch.randn(ids.shape + (10,), dtype=torch.float64).float().to(device)
    grad = _gradients(lambda w: pf.sinusoidal_embedding(ids, w, backend="cuda", **kwargs), weight, grad_out)
    exact_fn = lambda w: reference.sinusoidal_embedding(ids, w, **kwargs)  # noqa: E731
    exact = _gradients(exact_fn, weight.double(), grad_out.double())
    magnitude = _gradients(exact_fn, weight.double(), grad_out.double().abs())
    assert_within(grad, exact, 1e-5 * magnitude + 1e-30, f"chunk={chunk}")
    assert torch.count_nonzero(grad[2]) == 0

    # Few ids, many tokens: runs over hundreds of chunks (stage 2's galloping search and batched sums).
    ids = torch.randint(0, 5, (4, 500), generator=torch.Generator().manual_seed(seed)).to(device)
    grad_out = torch.randn(ids.shape + (10,), dtype=torch.float64).float().to(device)
    grad = _gradients(lambda w: pf.sinusoidal_embedding(ids, w, backend="cuda", **kwargs), weight, grad_out)
    exact = _gradients(exact_fn, weight.double(), grad_out.double())
    magnitude = _gradients(exact_fn, weight.double(), grad_out.double().abs())
    assert_within(grad, exact, 1e-5 * magnitude + 1e-30, f"long runs, chunk={chunk}")
    again = _gradients(lambda w: pf.sinusoidal_embedding(ids, w, backend="cuda", **kwargs), weight, grad_out)
    assert torch.equal(grad, again)


@pytest.mark.parametrize("backend,device", CUDA_TARGETS or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no cuda target here (no GPU, and no host emulation)"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode,layout", [("add", "interleaved"), ("add", "split"), ("concat", "interleaved"),
                                         ("concat", "split_cos_first")])
def test_cuda_unaligned_strided_weight(mode, layout, dtype, backend, device, seed):
    """Weight rows that are not 16-byte aligned (a column slice): the scalar path, same results;
    and a wide aligned table: the vector path, with a partial last vector."""
    g = torch.Generator().manual_seed(seed)
    table = lambda width: torch.randn(50, width, generator=g, dtype=torch.float64).to(dtype).to(device)  # noqa: E731
    big = table(77)
    ids = torch.randint(0, 50, (3, 13), generator=g).to(device)
    for weight in (big[:, 1:40], big[::2, 3:70], table(72), table(76)):
        kwargs = dict(mode=mode, layout=layout, d_pos=9 if mode == "concat" else None, offset=2**24 - 5,
                      embed_scale=1.5)
        ids_w = ids % weight.shape[0]
        out = pf.sinusoidal_embedding(ids_w, weight, backend="cuda", **kwargs)
        exact = reference.sinusoidal_embedding(ids_w, weight.double(), **kwargs)
        assert_within(out, exact, output_bound(exact, dtype), f"weight stride {weight.stride()}")


@pytest.mark.parametrize("backend,device", CUDA_TARGETS or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no cuda target here (no GPU, and no host emulation)"))])
def test_cuda_id_minus_one_keeps_its_pe(backend, device):
    """With the range check off, id -1 is out of range (zero token vector) but still gets its PE
    unless zero_pe_at_padding names it: -1 is never confused with 'no pe_zero_id'."""
    weight = torch.randn(6, 8, device=device)
    ids = torch.tensor([[0, -1, 3]], device=device)
    with pf.id_check(False):
        out = pf.sinusoidal_embedding(ids, weight, backend="cuda")
    pe = reference.sinusoidal_table(torch.arange(3), 8, dtype=torch.float32).to(device)
    torch.testing.assert_close(out[0, 1], pe[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend,device", CUDA_TARGETS or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no cuda target here (no GPU, and no host emulation)"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["interleaved", "split", "split_cos_first"])
@pytest.mark.parametrize("token_width", [8, 9, 10, 11, 16, 21])
def test_cuda_dropout_spans_off_group_boundaries(token_width, layout, dtype, backend, device, seed):
    """Fused dropout where a unit's 16-byte span does not start on a group of four columns: concat PE
    columns start at token_width, and the split layouts' sin/cos spans at sin_base/cos_base (odd
    D: ceil(D / 2)).  Each such span needs one Philox call more than an aligned one; every element's
    mask must still be the reference's, across spans of 4 (fp32) and 8 (bf16) columns."""
    g = torch.Generator().manual_seed(seed)
    d_pos = 3 + token_width % 5 + 2 * (seed % 7)  # odd and even D: odd cos_base, odd tails
    ids = torch.randint(0, 30, (3, 11), generator=g).to(device)
    weight = torch.randn(30, token_width, generator=g, dtype=torch.float64).to(dtype).to(device)
    kwargs = dict(mode="concat", d_pos=d_pos, layout=layout, offset=2**20 + 7, embed_scale=1.5)
    for p in (0.3, 0.9):
        torch.manual_seed(seed)
        out = pf.sinusoidal_embedding(ids, weight, dropout_p=p, backend="cuda", **kwargs)
        torch.manual_seed(seed)
        dropout_seed = _dropout.draw_seed(torch.device(device))
        exact = reference.sinusoidal_embedding(ids, weight.double(), dropout_p=p, dropout_seed=dropout_seed,
                                               **kwargs)
        what = f"width {token_width} + {d_pos} {layout} p={p}"
        assert_within(out, exact, output_bound(exact, dtype), what)
        keep = reference.dropout_keep(dropout_seed, ids.numel(), token_width + d_pos, _dropout.threshold_of(p))
        assert bool((out.reshape(keep.shape)[~keep] == 0).all()), f"{what}: a dropped element is not 0"


@pytest.mark.parametrize("backend,device", CUDA_TARGETS or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no cuda target here (no GPU, and no host emulation)"))])
@pytest.mark.parametrize("chunk", [1, 3, 32])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_dropout_gradient_across_chunks(chunk, grad_dtype, backend, device, seed, monkeypatch):
    """Stage 1 masks each gradient row of token order[i] as it reads it (spans of 4 or 8 columns), and the
    dropout scale is folded into the final scaling: runs over many chunks match the reference."""
    monkeypatch.setattr(cuda_backend, "GRAD_CHUNK", chunk)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (4, 120), generator=g).to(device)
    weight = torch.randn(5, 13, generator=g, dtype=torch.float64).to(grad_dtype).to(device)
    kwargs = dict(mode="concat", d_pos=6, padding_idx=2, embed_scale=2.0)
    grad_out = torch.randn(ids.shape + (19,), generator=g, dtype=torch.float64).to(grad_dtype).to(device)

    def fused(w):
        torch.manual_seed(seed)
        return pf.sinusoidal_embedding(ids, w, dropout_p=0.4, backend="cuda", **kwargs)

    grad = _gradients(fused, weight, grad_out)
    torch.manual_seed(seed)
    dropout_seed = _dropout.draw_seed(torch.device(device))
    exact_fn = lambda w: reference.sinusoidal_embedding(  # noqa: E731
        ids, w, dropout_p=0.4, dropout_seed=dropout_seed, **kwargs)
    exact = _gradients(exact_fn, weight.double(), grad_out.double())
    magnitude = _gradients(exact_fn, weight.double(), grad_out.double().abs()).abs()
    bound = 1e-5 * magnitude + 1e-30
    if grad_dtype != torch.float32:
        bound = bound + 0.5 * ulp(exact, grad_dtype)
    assert_within(grad, exact, bound, f"chunk={chunk}")
    assert torch.count_nonzero(grad[2]) == 0
    assert torch.equal(grad, _gradients(fused, weight, grad_out))
