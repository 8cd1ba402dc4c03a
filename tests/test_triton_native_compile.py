"""posenc_fast.backends.triton_kernels compiled natively for NVIDIA GPUs (sm_80, sm_90), on any machine.

Triton's interpreter (how CI runs the kernels) accepts some programs the GPU compiler
rejects.  ``native_compile.py`` compiles every kernel family ahead of time down to a
cubin with the ptxas Triton itself uses for that GPU (no GPU or driver needed;
``native_compile.triton_ptxas``), in a separate process with
the interpreter off; here each variant must compile with no register spills.  This
proves the kernels *compile* for the GPU, not that they compute correctly there: on a
GPU the rest of the suite checks that.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow(reason="native Triton compiles for sm_80/sm_90: ~70 s")

triton = pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
if not os.path.exists(PTXAS):
    pytest.skip("Triton's NVIDIA backend (ptxas) is not installed", allow_module_level=True)

sys.path.insert(0, HERE)
import native_compile  # noqa: E402  (its kernels are compiled only in the subprocess)

VARIANTS = [(native_compile.forward_name(*v), arch) for arch in native_compile.ARCHS
            for v in native_compile.FORWARD_VARIANTS]
VARIANTS += [(native_compile.forward_name(*v, ints_one=True), arch) for arch in native_compile.ARCHS
             for v in native_compile.ONE_VALUED_FORWARD]
VARIANTS += [(native_compile.grad_name(*v, ints_one=ones), arch) for arch in native_compile.ARCHS
             for v in native_compile.GRAD_VARIANTS for ones in (False, True)]


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, os.path.join(HERE, "native_compile.py")], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    entries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {(e["name"], e["arch"]): e for e in entries}


@pytest.mark.parametrize("name,arch", VARIANTS, ids=[f"{n}-sm{a}" for n, a in VARIANTS])
def test_kernel_compiles_natively_without_spills(compiled, name, arch):
    entry = compiled.get((name, arch))
    assert entry is not None, f"{name} sm_{arch} was not compiled"
    if entry.get("skip"):
        pytest.skip(entry["skip"])
    assert entry["ok"], entry.get("error")
    print(f"{name} {entry['target']} ({entry['ptxas']}): {entry['registers']} registers, {entry['vector_memory_ops']} vector ld/st")
    assert entry["spill_bytes"] == 0, entry
