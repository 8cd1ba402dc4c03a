"""What the two compiled backends (``cuda``: ``posenc_fast._C``, ``cpu``: ``posenc_fast._cpu``) share
about finding their extension: the lookup's outcome, loading a build from a file path, and keeping the
availability answer constant under ``torch.compile``."""

from __future__ import annotations

import importlib.util
import sys
from typing import NamedTuple, Optional


class Extension(NamedTuple):
    """Outcome of a backend's extension lookup."""

    module: object  # the loaded extension module, or None
    problem: Optional[str]  # why it is unusable, for the error message; None when loaded


def load_file(module_name: str, path: str):
    """Load the extension built at ``path`` (an on-demand or cached build) as ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module


def constant_under_compile(fn):
    """Mark ``fn`` as torch.compiler.assume_constant_result does (torch.compile calls it once while
    tracing and keeps the answer, instead of tracing the import machinery inside), without
    importing torch._dynamo, which would add about a second to ``import posenc_fast``."""
    fn._dynamo_marked_constant = True
    return fn
