"""``python -m posenc_fast check`` (posenc_fast/check.py): its verdict, and what it says about the
backends it could not run."""

import importlib.util

import pytest
import torch

from posenc_fast import check, cli
from posenc_fast.backends import cuda_backend, triton_backend

@pytest.fixture(autouse=True)
def backends_as_users_have_them(monkeypatch):
    """Other tests may have switched the cuda backend to its host-emulation build (a test setting)."""
    monkeypatch.setattr(cuda_backend, "_host_emulation", False)


TINY = ["check", "--device", "cpu", "--batch", "1", "--seq-len", "8", "--d-model", "16", "--vocab", "64"]


def test_check_passes_and_names_each_skipped_backend(capsys):
    assert cli.main(TINY) == 0
    printed = capsys.readouterr().out
    assert "all bars met" in printed and "versions: torch " in printed
    assert "skipped backend 'cuda': needs an NVIDIA GPU (this run is on the CPU)" in printed
    assert "torch                 float32" in printed
    assert "err/bar = the worst element's error divided by its bar" in printed  # the columns are explained


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_unrunnable_device_is_one_line_naming_the_one_that_runs(device, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for command in (["check", "--device", device], ["bench", "--device", device],
                    ["experiment", "add-vs-concat", "--device", device]):
        with pytest.raises(SystemExit) as raised:
            cli.main(command)
        message = str(raised.value.code)
        assert "\n" not in message and f"--device {device} but torch sees no CUDA device" in message
        assert "use --device cpu, where backend 'cpu'" in message


def test_check_without_triton_says_so(monkeypatch, capsys):
    why = "backend='triton' needs Triton (a test's stand-in reason)"
    monkeypatch.setattr(triton_backend, "available", lambda device: why)
    assert cli.main(TINY) == 0
    printed = capsys.readouterr().out
    assert f"skipped backend 'triton': {why}" in printed
    assert "triton (interpreter)" not in printed


def test_triton_on_cpu_without_numpy_is_a_reason_not_a_crash(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numpy" else real_find_spec(name, *a))
    reason = triton_backend.available(torch.device("cpu"))
    if importlib.util.find_spec("triton") is None and triton_backend._Kernels.state is None:
        assert "needs Triton" in reason
    else:
        assert "needs numpy" in reason and "pip install numpy" in reason
    assert check.skipped_backends(torch.device("cpu"))["triton"] == reason
