"""Command line: ``python -m posenc_fast {check,plot,experiment} ...``.

Each command lives in its own module and registers itself through an
``add_subcommand(subparsers)`` function listed in ``_COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import List, Optional

# Modules that define ``add_subcommand(subparsers)``; each sets ``func`` on its parser.
_COMMAND_MODULES = ("posenc_fast.check", "posenc_fast.explore.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m posenc_fast", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command not present in this build
                continue
            raise
        module.add_subcommand(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
