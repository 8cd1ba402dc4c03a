"""Command line: ``python -m posenc_fast {check,bench,plot,experiment} ...``.

Each command lives in its own module and registers itself through an
``add_subcommand(subparsers)`` function; the modules are listed in ``_COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import List, Optional

# Modules that define ``add_subcommand(subparsers)``; each sets ``func`` on its parser(s).
_COMMAND_MODULES = ("posenc_fast.check", "posenc_fast.benchmark", "posenc_fast.explore.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m posenc_fast",
        description="posenc_fast: check accuracy and speed, benchmark, and explore positional encodings.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_subcommand(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
