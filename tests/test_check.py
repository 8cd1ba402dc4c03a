"""``python -m posenc_fast check`` (posenc_fast/check.py): its verdict, and what it says about the
backends it could not run."""

import importlib.util
import os
import subprocess
import sys

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
        message = capsys.readouterr().err
        assert raised.value.code == 2  # (1 is check's "an accuracy bar missed")
        assert message.count("\n") == 1 and f"--device {device} but torch sees no CUDA device" in message
        assert "use --device cpu, where backend 'cpu'" in message


@pytest.mark.parametrize("command", [["check", "--batch", "0"], ["check", "--vocab", "-3"],
                                     ["check", "--seq-len", str(2**24 + 1)],
                                     ["bench", "--device", "cpu", "--out", "{file}"],
                                     ["bench", "--summarize", "{file}"], ["bench", "--quick", "--full"],
                                     ["bench", "--device", "cpu", "--time-budget", "0"],
                                     ["bench", "--device", "cpu", "--threads", "0"],
                                     ["experiment", "add-vs-concat", "--device", "cpu", "--seeds", "0"],
                                     ["plot", "--out", "{file}/figures"], ["plot", "--base", "0"],
                                     ["experiment", "add-vs-concat", "--device", "cpu", "--out", "{file}"],
                                     ["experiment", "add-vs-concat", "--device", "cpu", "--lr", "-1"],
                                     ["experiment", "add-vs-concat", "--device", "cpu", "--first-seed", str(2**64)],
                                     ["experiment", "subspace", "--out", "{file}"], ["experiment", "subspace", "--out", ""],
                                     ["experiment", "add-vs-concat", "--device", "cpu", "--out", ""],
                                     ["experiment", "subspace", "--tokens", "0"], ["experiment", "subspace", "--dims", "0"],
                                     ["experiment", "subspace", "--token-stds", ""]], ids=" ".join)
def test_arguments_a_command_cannot_run_with_exit_2_before_any_work(command, tmp_path, capsys, monkeypatch):
    """Sizes below 1, a rate or base that is not positive, an --out that is a file (nothing can be written
    there), a results file that is not one: an error naming it and exit 2, before any measurement or training
    (which would otherwise run to the end and lose its results, or end in a traceback)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for work in ("posenc_fast.check.sinusoidal_embedding", "posenc_fast.benchmark.cli.run_benchmark",
                 "posenc_fast.explore.experiment.run_add_vs_concat", "posenc_fast.explore.subspace.random_tokens_vs_pe"):
        monkeypatch.setattr(work, lambda *args, **kwargs: pytest.fail("the command started its work"))
    try:
        code = cli.main([part.format(file=a_file) for part in command])
    except SystemExit as exit:  # (argparse's errors and usage_error raise; a command's own checks return 2)
        code = exit.code
    assert code == 2
    assert "error:" in capsys.readouterr().err


def test_the_console_script_runs_triton_through_the_interpreter(tmp_path):
    """``posenc-fast`` (pyproject's script, posenc_fast.cli:main) without TRITON_INTERPRET set: cli.main sets it
    where there is no GPU, as ``python -m posenc_fast`` does, so check runs triton too."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton and no GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = "import sys; from posenc_fast.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", script, *TINY], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "triton (interpreter)" in done.stdout and "skipped backend 'triton'" not in done.stdout


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
