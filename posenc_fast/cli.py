"""Command line: ``python -m posenc_fast {check,bench,plot,experiment} ...``; each command lives in
its own module (``_COMMAND_MODULES``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

# Each defines ``add_subcommand(subparsers)``, which sets ``func`` on its parser(s).
_COMMAND_MODULES = ("posenc_fast.check", "posenc_fast.benchmark", "posenc_fast.explore.cli")


def print_usage_error(message: str) -> int:
    """For a command given arguments it cannot run with: the message on stderr; returns the exit status, 2
    (as argparse's own errors; ``check`` exits 1 for a missed accuracy bar)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def usage_error(message: str) -> SystemExit:
    """:func:`print_usage_error`, as the exception to raise."""
    return SystemExit(print_usage_error(message))


def output_folder(path: str) -> str:
    """``--out PATH`` made and checked writable before a command does any work (a run whose results cannot
    be written is refused at the start, not after the measurements or training)."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot write into {path}")
    except OSError as error:
        raise usage_error(f"--out {path}: {error.strerror or error}") from None
    return path


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def device_from_arg(name: Optional[str]):
    """The torch.device a ``--device`` option names (None or "auto": cuda if available, else cpu).

    A device this machine cannot run ends the command with a one-line error naming the device and
    backends that can, rather than torch's traceback from the first tensor moved there."""
    import torch

    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise usage_error(f"--device {name!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise usage_error(f"--device {name} but torch sees no CUDA device here (torch {torch.__version__}"
                             f"{', a CPU-only build' if torch.version.cuda is None else ''}); use --device cpu, "
                             "where backend 'cpu' (the native CPU kernels) and 'torch' run")
        if device.index is not None and device.index >= count:
            raise usage_error(f"--device {name} but torch sees {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    elif device.type != "cpu":
        raise usage_error(f"--device {name}: posenc_fast's commands run on cpu or cuda only")
    return device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m posenc_fast",
        description="posenc_fast: check accuracy and speed, benchmark, and explore positional encodings.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_subcommand(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m posenc_fast`` and the ``posenc-fast`` script."""
    import torch

    # Without a GPU, the Triton backend runs through Triton's interpreter (decided before its kernels are
    # defined, at their first launch).
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except OSError as error:  # a file a command reads or writes (--out's files blocked, a full disk): named
        print(f"error: {error.filename}: {error.strerror}" if error.filename else f"error: {error}", file=sys.stderr)
        return 1
