"""examples/: the scripts run end to end (at a tiny size)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("pe,dropout", [("add", "0"), ("concat", "0.1"), ("none", "0.1")])
def test_train_tiny_lm_runs(pe, dropout):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_tiny_lm.py"), "--pe", pe, "--steps", "6",
         "--batch", "4", "--length", "5", "--d-model", "16", "--d-pos", "8", "--device", "cpu", "--dropout", dropout],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"pe={pe}" in result.stdout and "held-out reversed half" in result.stdout


def test_train_tiny_lm_help_and_device_errors():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(ROOT, "examples", "train_tiny_lm.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert shown.returncode == 0 and "(default: 300)" in shown.stdout and "(default: add)" in shown.stdout
    if not __import__("torch").cuda.is_available():
        refused = subprocess.run([sys.executable, script, "--device", "cuda"], capture_output=True, text=True,
                                 timeout=120, env=env)
        assert refused.returncode == 2 and "sees no CUDA GPU" in refused.stderr and "--device cpu" in refused.stderr
