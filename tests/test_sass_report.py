"""Structural facts of the compiled headline forward kernels (bench/sass_report.py).

The kernels are compiled for sm_90 without a GPU (Triton's compiler with a GPUTarget, nvcc -cubin)
and read as SASS.  Asserted: every global store on the hot path of the PE and token columns is
128-bit, and no register spills.  Speed is never asserted (the report predicts it; a GPU session
measures it).  Skips, with the reason, when a compiler or cuobjdump is missing.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow(reason="compiles every kernel variant to SASS: ~55 s")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REPORT = os.path.join(ROOT, "bench", "sass_report.py")


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
    sys.path.insert(0, ROOT)
    from posenc_fast import _build

    if _build.find_nvcc() is None:
        return "nvcc is not installed"
    if _triton_tools() is not None and not (shutil.which("cuobjdump") or os.path.exists("/usr/local/cuda/bin/cuobjdump")):
        return "no cuobjdump (neither Triton's nor the CUDA toolkit's)"
    return None


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_headline_forward_stores_are_128_bit_without_spills(backend):
    problem = _triton_tools() if backend == "triton" else _cuda_tools()
    if problem:
        pytest.skip(problem)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, REPORT, "--arch", "90", "--backend", backend, "--kernels", "forward",
                             "--only", "bf16-add", "--json"], env=env, capture_output=True, text=True, timeout=900)
    entries = json.loads(result.stdout.strip().splitlines()[-1])
    names = {e["name"] for e in entries}
    assert {f"{backend}-forward-bf16-add-{layout}-{math}" for layout in ("interleaved", "split")
            for math in ("float32", "float64")} <= names, result.stderr[-3000:]
    for entry in entries:
        assert "error" not in entry, entry
        assert entry["spill_instructions"] == 0 and entry["local_bytes"] == 0, entry["name"]
        assert entry["roles"]["pe"]["global"]["stores"], entry["name"]  # the hot path stores
        assert entry["all_stores_128bit"], (entry["name"], {r: v["global"] for r, v in entry["roles"].items()})
