"""What the compiled kernels look like, without a GPU: ptxas' report of every CUDA kernel, and the SASS of
the headline forward kernels (bench/sass_report.py).

Every CUDA kernel source is compiled once per arch, sm_80 and sm_90, to a cubin (``sass_report.compile_cuda``,
the extension's flags); ptxas' report of that compile is checked for spills, and the SASS report reads the
sm_90 cubins.  The Triton kernels are compiled for sm_90 by Triton's compiler with a GPUTarget.  Asserted:
no CUDA kernel spills or uses a stack frame, on either arch; every global store on the hot path of the
headline forward's PE and token columns is 128-bit, with no register spills.  Speed is never asserted
(the report predicts it; a GPU session measures it).  Skips, with the reason, when a compiler or
cuobjdump is missing; with POSENC_FAST_BUILD_CUDA=1 (CI) a missing nvcc fails the ptxas check instead.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from filelock import FileLock

from posenc_fast import _build

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REPORT = os.path.join(ROOT, "bench", "sass_report.py")
sys.path.insert(0, os.path.dirname(REPORT))
import sass_report  # noqa: E402

pytestmark = pytest.mark.slow(reason="nvcc compiles every CUDA kernel source for sm_80 and sm_90: ~150 s")

ARCHS = (80, 90)
CUDA_SOURCES = [s for s in _build.SOURCES if s.endswith(".cu") and s != "cuda/forward.cu"]  # forward.cu: no kernels


def _triton_tools():
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for tool in ("ptxas", "cuobjdump"):
        if not os.path.exists(os.path.join(bin_dir, tool)):
            return f"Triton's NVIDIA backend has no {tool}"
    return None


def _cuda_tools():
    if _build.find_nvcc() is None:
        return "nvcc is not installed"
    if _triton_tools() is not None and not (shutil.which("cuobjdump") or os.path.exists("/usr/local/cuda/bin/cuobjdump")):
        return "no cuobjdump (neither Triton's nor the CUDA toolkit's)"
    return None


def _ptxas_kernels(source, report):
    kernels = []
    for name, arch, body in re.findall(r"Compiling entry function '(\w+)' for 'sm_(\d+)'\n(.*?)(?=ptxas info\s+: Compiling|\Z)",
                                       report, re.S):
        registers = re.search(r"Used (\d+) registers", body)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
        stack = re.search(r"(\d+) bytes stack frame", body)
        kernels.append(dict(arch=arch, source=source, kernel=name, registers=int(registers.group(1)),
                            spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                            stack=int(stack.group(1))))
    return kernels


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory):
    """Every CUDA kernel source compiled for each of ARCHS: the cubins' directory and ptxas' report per kernel.

    Two tests read it, on the same xdist worker or on two: the first to get here compiles, under a lock,
    into a directory the session's workers share, and the other waits for it instead of compiling again.
    """
    if _build.find_nvcc() is None:
        if _build.build_mode() == "require":
            pytest.fail(_build.no_nvcc_message())
        pytest.skip(_build.no_nvcc_message())
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's basetemp is a folder in the session's
        shared = shared.parent
    out = shared / "cuda-cubins"
    with FileLock(f"{out}.lock"):
        if not (out / "kernels.json").exists():  # written last: a failed compile leaves none
            out.mkdir(exist_ok=True)
            jobs = [(source, arch) for source in CUDA_SOURCES for arch in ARCHS]
            with ThreadPoolExecutor(os.cpu_count()) as pool:
                reports = pool.map(lambda job: sass_report.compile_cuda(*job, str(out)), jobs)
                kernels = [k for (source, _), report in zip(jobs, reports) for k in _ptxas_kernels(source, report)]
            (out / "kernels.json").write_text(json.dumps(kernels))
    return str(out), json.loads((out / "kernels.json").read_text())


def test_kernels_compile_without_spills(cuda_build):
    _, kernels = cuda_build
    # forward: dtype (3) x math (2) x ids (2) x layout (2) x dropout (2) x positions (offsets or explicit, 2);
    # chunk: 5 dtype pairs x keys (2) x dropout (2)
    assert len(kernels) == 2 * (3 * 32 + 2 * (10 + 3)), "expected 96 forward, 20 chunk and 6 carry kernels per arch"
    for k in kernels:
        print(f"sm_{k['arch']} {k['kernel']}: {k['registers']} registers, {k['stack']} bytes stack")
    spilled = [k for k in kernels if k["spill_stores"] or k["spill_loads"] or k["stack"]]
    assert not spilled, spilled


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_headline_forward_stores_are_128_bit_without_spills(backend, request):
    problem = _triton_tools() if backend == "triton" else _cuda_tools()
    if problem:
        pytest.skip(problem)
    command = [sys.executable, REPORT, "--arch", "90", "--backend", backend, "--kernels", "forward",
               "--only", "bf16-add", "--json"]
    if backend == "cuda":
        command += ["--cubin-dir", request.getfixturevalue("cuda_build")[0]]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    entries = json.loads(result.stdout.strip().splitlines()[-1])
    names = {e["name"] for e in entries}
    assert {f"{backend}-forward-bf16-add-{layout}-{math}" for layout in ("interleaved", "split")
            for math in ("float32", "float64")} <= names, result.stderr[-3000:]
    for entry in entries:
        assert "error" not in entry, entry
        assert entry["spill_instructions"] == 0 and entry["local_bytes"] == 0, entry["name"]
        assert entry["roles"]["pe"]["global"]["stores"], entry["name"]  # the hot path stores
        assert entry["all_stores_128bit"], (entry["name"], {r: v["global"] for r, v in entry["roles"].items()})


def test_every_triton_forward_variant_compiles_in_the_report():
    """The report builds each Triton forward as a call of the headline shape gets it (``_forward_tiles`` on the
    launch's own parameters), concat included: no variant ends in an error."""
    problem = _triton_tools()
    if problem:
        pytest.skip(problem)
    command = [sys.executable, REPORT, "--arch", "90", "--backend", "triton", "--kernels", "forward", "--only",
               "bf16", "--json"]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    entries = json.loads(result.stdout.strip().splitlines()[-1])
    assert [e for e in entries if "error" in e] == []
    assert len(entries) == 8 and {e["mode"] for e in entries} == {"add", "concat"}, result.stderr[-3000:]
