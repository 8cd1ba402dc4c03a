"""examples/: the scripts run end to end (at a tiny size)."""

import os
import subprocess
import sys

import pytest

from cases import BACKEND_TRAITS, cuda_extension_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Every backend is accepted by the example: on the CPU (triton through its interpreter) without a GPU,
# triton and cuda on the GPU where there is one.
EXAMPLE_RUNS = [("add", "0", "auto"), ("concat", "0.1", "auto"), ("none", "0.1", "auto")] + [
    pytest.param(*traits.example, name, id=f"{traits.example[0]}-{traits.example[1]}-{name}",
                 marks=[pytest.mark.slow(reason=traits.example_slow), pytest.mark.interpreter]
                 if traits.example_slow else [])
    for name, traits in BACKEND_TRAITS.items()]


@pytest.mark.parametrize("pe,dropout,backend", EXAMPLE_RUNS)
def test_train_tiny_lm_runs(pe, dropout, backend):
    on_gpu = __import__("torch").cuda.is_available()
    if backend == "cuda" and (not on_gpu or cuda_extension_problem() is not None):
        pytest.skip("backend='cuda' needs a GPU and the CUDA extension")
    device = "cuda" if backend in ("triton", "cuda") and on_gpu else "cpu"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_tiny_lm.py"), "--pe", pe, "--steps", "6",
         "--batch", "4", "--length", "5", "--d-model", "16", "--d-pos", "8", "--device", device, "--dropout", dropout,
         "--backend", backend],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"pe={pe}" in result.stdout and f"backend={backend}" in result.stdout
    assert "held-out reversed half" in result.stdout


def test_train_tiny_lm_help_and_device_errors():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(ROOT, "examples", "train_tiny_lm.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert shown.returncode == 0 and "(default: 300)" in shown.stdout and "(default: add)" in shown.stdout
    if not __import__("torch").cuda.is_available():
        refused = subprocess.run([sys.executable, script, "--device", "cuda"], capture_output=True, text=True,
                                 timeout=120, env=env)
        assert refused.returncode == 2 and "sees no CUDA GPU" in refused.stderr and "--device cpu" in refused.stderr
        wrong_backend = subprocess.run([sys.executable, script, "--device", "cpu", "--backend", "cuda"],
                                       capture_output=True, text=True, timeout=120, env=env)
        assert wrong_backend.returncode == 2 and "use backend='cpu'" in wrong_backend.stderr
