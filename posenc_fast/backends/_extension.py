"""What the two compiled backends (``cuda``: ``posenc_fast._C``, ``cpu``: ``posenc_fast._cpu``) share
about finding their extension (the lookup's outcome, loading a build from a file path, keeping the
availability answer constant under ``torch.compile``) and about calling it (pointers, dtype codes,
int64 index vectors).  The calling helpers run on every launch, so they avoid per-call allocations:
a decoding step's host time is mostly this kind of Python."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from typing import Callable, NamedTuple, Optional

import torch

from .._validate import check_id_range
from . import ID_DTYPES, PreparedLaunch, new_buffer


class Extension(NamedTuple):
    """Outcome of a backend's extension lookup."""

    module: object  # the loaded extension module, or None
    problem: Optional[str]  # why it is unusable, for the error message; None when loaded


class Lookup:
    """One backend's extension (``posenc_fast.<name>``), looked for at its first use (``find``), once, under a
    lock (threads); calling it gives the outcome.  ``state`` is that outcome: the backend replaces it where it
    builds or loads another extension (``load_build``), tests where they stand one in; a prepared launch keeps the
    outcome it was made with and is current while ``state`` is still that object.  ``cached_build``: the
    ``posenc_fast._build`` function giving the path of an earlier on-demand build, or None."""

    def __init__(self, name: str, cached_build: str, missing: str, hint: str):
        self.name, self.cached_build, self.missing, self.hint = name, cached_build, missing, hint
        self.state: Optional[Extension] = None
        self._lock = threading.Lock()

    def __call__(self) -> Extension:
        state = self.state
        if state is None:
            with self._lock:
                if self.state is None:
                    self.state = find(self.name, self._cached_path, self.missing, self.hint)
                state = self.state
        return state

    def require(self):
        """The extension module, or a RuntimeError saying why there is none."""
        state = self()
        if state.module is None:
            raise RuntimeError(state.problem)
        return state.module

    def _cached_path(self) -> Optional[str]:
        from .. import _build  # here, not at import: `python -m posenc_fast._build` must find it unimported

        return getattr(_build, self.cached_build)()

    def load_build(self, build: Callable[[], str], failure: str) -> Extension:
        """``build()`` (an on-demand build; its path) loaded as the extension, or ``failure`` and the error."""
        try:
            self.state = Extension(load_file(f"posenc_fast.{self.name}", build()), None)
        except (RuntimeError, ImportError, OSError, ValueError) as error:
            self.state = Extension(None, f"{failure}: {error}")
        return self.state


def find(name: str, cached_build, missing: str, hint: str) -> Extension:
    """Import ``posenc_fast.<name>`` (built by ``pip install .``), else load the per-user cache's on-demand build
    (``cached_build()``: its path, or None); else an outcome naming why not: ``missing``, the errors, ``hint``."""
    try:
        return Extension(importlib.import_module(f"posenc_fast.{name}"), None)
    except ImportError as error:
        import_error = str(error) or type(error).__name__
    cached = None
    try:
        cached = cached_build()
        if cached is not None:
            return Extension(load_file(f"posenc_fast.{name}", cached), None)
    except (ImportError, OSError, RuntimeError, ValueError) as error:
        import_error += f"; the cached build {cached} did not load either: {error}"
    return Extension(None, f"{missing}, which this installation does not have ({import_error}). {hint}")


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


_DTYPE_CODES = {}  # id(extension module) -> {torch dtype: the binding's dtype code}


def dtype_code(module, dtype: torch.dtype, backend: str) -> int:
    """The binding's code for ``dtype`` (``module.FLOAT32``...), from a table built once per module."""
    codes = _DTYPE_CODES.get(id(module))
    if codes is None or codes[0] is not module:
        codes = _DTYPE_CODES[id(module)] = (module, {
            torch.float32: module.FLOAT32, torch.float16: module.FLOAT16, torch.bfloat16: module.BFLOAT16,
            torch.int32: module.INT32, torch.int64: module.INT64})
    code = codes[1].get(dtype)
    if code is None:
        raise TypeError(f"backend={backend!r} does not support dtype {dtype}")
    return code


# Above this many ids the range check goes back to torch.aminmax (multithreaded): the scan runs on the
# calling thread, and is for the batches where two small allocations beside the output matter.
ID_RANGE_SERIAL_MAX = 1 << 16


def prepare_forward(lookup: Lookup, backend: str, dtype: torch.dtype, num_rows: int, turns: torch.Tensor, params,
                    last_argument: Callable[[], int], *device_arguments) -> Optional[PreparedLaunch]:
    """A compiled backend's ``PreparedLaunch``: its binding's ``ForwardLaunch`` (csrc/common/launch_arguments.h)
    for tables of ``num_rows`` rows of ``dtype`` with ``params`` (a ``KernelParams``) and ``turns`` bound, current
    while ``lookup`` holds the extension it was made with; the id check through the binding's one-pass scan where
    it has one (the CPU's, up to ID_RANGE_SERIAL_MAX ids).  ``device_arguments``: what the binding's device part
    takes at the end (the CUDA one: the device index).  None when the extension is missing."""
    state = lookup()
    module = state.module
    if module is None:
        return None
    turns = int64_vector(turns)
    columns = params.columns
    bound = module.ForwardLaunch(
        dtype_code(module, dtype, backend), turns.data_ptr(), turns.numel(), num_rows, params.token_width,
        params.pe_width, bool(params.concat), bool(columns.interleaved), columns.sin_base, columns.num_sin,
        columns.cos_base, columns.num_cos, int(params.pe_zero_id), float(params.embed_scale), float(params.pe_scale),
        bool(params.float64_math), *device_arguments)
    id_codes = {dtype: dtype_code(module, dtype, backend) for dtype in ID_DTYPES}
    scan = getattr(module, "id_range", None)

    def launch(ids, weight, weight_row_stride, out, offset, seq_len, num_tokens, last_argument, check_ids):
        if check_ids:
            bounds = None
            if scan is not None and 0 < num_tokens <= ID_RANGE_SERIAL_MAX:
                bounds = scan(ids.data_ptr(), id_codes[ids.dtype], num_tokens)
            check_id_range(ids, num_rows, 0, bounds)
        bound(ids.data_ptr(), id_codes[ids.dtype], weight.data_ptr(), weight_row_stride, out.data_ptr(), offset,
              seq_len, num_tokens, last_argument)
    return PreparedLaunch(launch, ID_DTYPES, last_argument, lookup, state, turns)


def start_forward(ids, weight, params, require):
    """What a compiled backend's ``forward`` starts with: its ``[N, width]`` output, and unless there are no
    tokens (then None) the extension (``require()``), ids contiguous and the table with unit column stride, as
    the kernels read them."""
    out = new_buffer((ids.numel(), params.width), weight.dtype, weight.device)
    if ids.numel() == 0:
        return out, None, ids, weight
    module = require()
    return out, module, (ids if ids.is_contiguous() else ids.contiguous()), (
        weight if weight.stride(1) == 1 else weight.contiguous())


def pointer(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def int64_vector(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as a contiguous int64 vector (the kernels' index type), or None."""
    if t is None:
        return None
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t if t.is_contiguous() else t.contiguous()
