"""What the two compiled backends (``cuda``: ``posenc_fast._C``, ``cpu``: ``posenc_fast._cpu``) share: finding,
loading and building on demand their extension (``Lookup``; when each happens: docs/cuda_backend.md, "On
demand", and docs/cpu_backend.md, "Building"), the start of their ``backward``, and the calls into the bindings'
``ForwardLaunch`` and ``weight_grad`` (csrc/common/launch_arguments.h).  The argument helpers run on every
general-path call, so they copy or allocate only what the kernels cannot read as given."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .._validate import check_id_range
from . import ID_DTYPES, PreparedLaunch, gradient_rows, new_buffer, sort_ids_for_gradient


class Extension(NamedTuple):
    """Outcome of a backend's extension lookup."""

    module: object  # the loaded extension module, or None
    problem: Optional[str]  # why it is unusable, for the error message; None when loaded


class Lookup:
    """One backend's extension (``posenc_fast.<name>``), looked for once, at its first use and under a lock
    (``find``); calling the lookup gives the outcome.  ``state`` is that outcome, and a prepared launch's
    ``source.state`` (``backends.PreparedLaunch``): the backend replaces it when it builds or loads another
    extension (``load_build``), tests when they stand one in.  ``cached_build``, ``build`` and ``needs``: names of
    ``posenc_fast._build`` functions: the path of an earlier on-demand build (None if there is none), the build
    into the per-user cache, and what it needs (None where absent: the compiler, the sources); ``failure``: what a
    failed build's error starts with; ``on_load``: called with each module the lookup loads."""

    def __init__(self, name: str, cached_build: str, missing: str, hint: str, on_load=None, build: str = "",
                 needs: Sequence[str] = (), failure: str = ""):
        self.name, self.cached_build, self.missing, self.hint = name, cached_build, missing, hint
        self.on_load, self.build, self.needs, self.failure = on_load, build, needs, failure
        self.state: Optional[Extension] = None
        self.failed_build: Optional[Extension] = None  # (load_build)
        self._lock = threading.Lock()

    def __call__(self) -> Extension:
        state = self.state
        if state is None:
            with self._lock:
                if self.state is None:
                    self.state = self._loaded(find(self.name, self._cached_path, self.missing, self.hint))
                state = self.state
        return state

    def _loaded(self, state: Extension) -> Extension:
        if state.module is not None and self.on_load is not None:
            self.on_load(state.module)
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
        """``build()`` (an on-demand build; its path) loaded as the extension, or ``failure`` and the error.  A
        build that failed is not tried again in this process: every later call would wait for it again."""
        if self.failed_build is None:
            try:
                self.state = self._loaded(Extension(load_file(f"posenc_fast.{self.name}", build()), None))
            except (RuntimeError, ImportError, OSError, ValueError) as error:
                self.failed_build = Extension(None, f"{failure}: {error}")
        if self.failed_build is not None:
            self.state = self.failed_build
        return self.state

    def build_on_demand(self) -> Optional[str]:
        """Build the missing extension into the per-user cache and load it (progress on stderr); None when it is
        loaded, else why not."""
        if self().module is not None:
            return None
        from .. import _build

        return self.load_build(getattr(_build, self.build), self.failure).problem

    def prepare(self, device: torch.device, device_type: str, can_run: Callable[[], bool] = lambda: True) -> None:
        """A backend's ``prepare``: ``build_on_demand`` where the extension is missing for a ``device`` of
        ``device_type`` that ``can_run()``, nothing is being traced, POSENC_FAST_BUILD_ON_DEMAND is not 0 and
        what the build ``needs`` is present."""
        if torch.compiler.is_compiling() or device.type != device_type or self().module is not None:
            return
        if not can_run() or os.environ.get("POSENC_FAST_BUILD_ON_DEMAND", "1").strip() == "0":
            return
        from .. import _build

        if all(getattr(_build, need)() is not None for need in self.needs):
            self.build_on_demand()


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
    tracing and keeps the answer, instead of tracing the import machinery inside), without importing
    torch._dynamo, which would make ``import posenc_fast`` slow."""
    fn._dynamo_marked_constant = True
    return fn


# id(extension module) -> (module, {torch dtype: the binding's dtype code}); the entry holds its module, so
# no other module takes its id.
_DTYPE_CODES = {}


def dtype_code(module, dtype: torch.dtype, backend: str) -> int:
    """The binding's code for ``dtype`` (``module.FLOAT32``...); a TypeError naming ``backend`` for a dtype it
    does not take."""
    codes = _DTYPE_CODES.get(id(module))
    if codes is None or codes[0] is not module:
        codes = _DTYPE_CODES[id(module)] = (module, {
            torch.float32: module.FLOAT32, torch.float16: module.FLOAT16, torch.bfloat16: module.BFLOAT16,
            torch.int32: module.INT32, torch.int64: module.INT64})
    code = codes[1].get(dtype)
    if code is None:
        raise TypeError(f"backend={backend!r} does not support dtype {dtype}")
    return code


# The most ids a prepared launch range-checks with the binding's scan, which runs on the calling thread and
# allocates no tensor, so that a module's freshly freed output stays where the next call allocates it; more
# ids go to torch.aminmax, which is multithreaded.
ID_RANGE_SERIAL_MAX = 1 << 16


def bind_forward(module, backend: str, dtype: torch.dtype, num_rows: int, turns: torch.Tensor, params,
                 *device_arguments):
    """The binding's ``ForwardLaunch`` (csrc/common/launch_arguments.h) with ``params`` (a ``KernelParams``) and
    the int64 vector ``turns`` bound, for tables of ``num_rows`` rows of ``dtype``.  ``device_arguments``: what
    the binding's device part adds to the constructor (the CUDA one: the device index)."""
    columns = params.columns
    return module.ForwardLaunch(
        dtype_code(module, dtype, backend), turns.data_ptr(), turns.numel(), num_rows, params.token_width,
        params.pe_width, bool(params.concat), bool(columns.interleaved), columns.sin_base, columns.num_sin,
        columns.cos_base, columns.num_cos, int(params.pe_zero_id), float(params.embed_scale), float(params.pe_scale),
        bool(params.float64_math), *device_arguments)


def prepare_forward(lookup: Lookup, backend: str, dtype: torch.dtype, num_rows: int, turns: torch.Tensor, params,
                    last_argument: Callable[[], int], *device_arguments) -> Optional[PreparedLaunch]:
    """A compiled backend's ``PreparedLaunch``: ``bind_forward``'s launch, current while ``lookup`` holds the
    extension it was made with, its id check through the binding's scan where it has one (the CPU's, up to
    ``ID_RANGE_SERIAL_MAX`` ids).  None when the extension is missing."""
    state = lookup()
    module = state.module
    if module is None:
        return None
    turns = int64_vector(turns)
    bound = bind_forward(module, backend, dtype, num_rows, turns, params, *device_arguments)
    id_codes = {dtype: dtype_code(module, dtype, backend) for dtype in ID_DTYPES}
    scan = getattr(module, "id_range", None)

    def launch(ids, weight, weight_row_stride, out, offset, seq_len, num_tokens, last_argument, check_ids,
               positions=None):
        code = id_codes[ids.dtype]
        if check_ids:
            bounds = None
            if scan is not None and 0 < num_tokens <= ID_RANGE_SERIAL_MAX:
                bounds = scan(ids.data_ptr(), code, num_tokens)
            check_id_range(ids, num_rows, 0, bounds)
        if positions is None:
            bound(ids.data_ptr(), code, weight.data_ptr(), weight_row_stride, out.data_ptr(), offset, seq_len,
                  num_tokens, last_argument)
        else:
            bound.run(ids.data_ptr(), code, weight.data_ptr(), weight_row_stride, out.data_ptr(), positions.data_ptr(),
                      0, offset, seq_len, num_tokens, 0, 0, 1.0, last_argument)
    return PreparedLaunch(launch, last_argument, lookup, state, turns)


def forward(lookup: Lookup, backend: str, ids, weight, turns, positions, offsets, offset, seq_len, params,
            dropout, last_argument: int, *device_arguments) -> torch.Tensor:
    """A compiled backend's ``forward`` (the interface in ``posenc_fast.backends``); ``last_argument`` and
    ``device_arguments`` as ``launch_forward`` takes them."""
    out = new_buffer((ids.numel(), params.width), weight.dtype, weight.device)
    if ids.numel() == 0:
        return out
    ids = ids if ids.is_contiguous() else ids.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()  # the kernels read unit-stride columns
    launch_forward(lookup.require(), backend, ids, weight, out, int64_vector(turns), int64_vector(positions),
                   int64_vector(offsets), offset, seq_len, params, dropout, last_argument, *device_arguments)
    return out


def launch_forward(module, backend: str, ids, weight, out, turns, positions, offsets, offset, seq_len, params,
                   dropout, last_argument: int, *device_arguments) -> None:
    """``bind_forward``'s launch for the call's table, run with every per-call argument (contiguous ids, int64
    vectors).  ``last_argument``: the CUDA stream handle or the CPU thread count.  Tests call it with no tokens
    to check the argument list against the binding: nothing is launched then."""
    seed, threshold, scale = dropout_arguments(dropout, weight.device)
    bind_forward(module, backend, weight.dtype, weight.shape[0], turns, params, *device_arguments).run(
        ids.data_ptr(), dtype_code(module, ids.dtype, backend), weight.data_ptr(), weight.stride(0), out.data_ptr(),
        pointer(positions), pointer(offsets), int(offset), max(int(seq_len), 1), ids.numel(), seed, threshold, scale,
        last_argument)


def dropout_arguments(dropout, device: torch.device):
    """(seed pointer, threshold, scale) for a binding; (0, 0, 1.0) without dropout.  The kernels read the seed
    through its pointer on ``device``, so it is never copied to the host."""
    if dropout is None:
        return 0, 0, 1.0
    seed = dropout.seed
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"the dropout seed must be one int64 element, got {seed.dtype} of shape {tuple(seed.shape)}")
    if seed.device != device:
        raise ValueError(f"the dropout seed is on {seed.device}, the kernels run on {device}")
    return seed.data_ptr(), int(dropout.threshold), float(dropout.scale)


def gradient_inputs(lookup: Lookup, grad_out, ids, num_embeddings: int, weight_dtype: torch.dtype) -> tuple:
    """How both backends' ``backward`` starts: (the extension, ``grad_out`` in the weight's dtype or in fp32, which
    the kernels take, the sorted ids, their order)."""
    module = lookup.require()
    grad_out = gradient_rows(grad_out, weight_dtype if grad_out.dtype == weight_dtype else torch.float32)
    return (module, grad_out, *sort_ids_for_gradient(ids, num_embeddings))


def gradient_arguments(module, backend: str, sorted_ids, order, grad_out, grad_weight, padding_idx, embed_scale,
                       dropout) -> tuple:
    """The arguments both bindings' ``weight_grad`` take first (csrc/common/launch_arguments.h): pointers, with the
    dtype code after the sorted ids, after the gradient's row stride and after the weight gradient; the sizes;
    the scale; the dropout."""
    return (sorted_ids.data_ptr(), dtype_code(module, sorted_ids.dtype, backend), order.data_ptr(),
            grad_out.data_ptr(), grad_out.stride(0), dtype_code(module, grad_out.dtype, backend),
            grad_weight.data_ptr(), dtype_code(module, grad_weight.dtype, backend), sorted_ids.numel(),
            *grad_weight.shape, int(padding_idx), float(embed_scale), *dropout_arguments(dropout, grad_out.device))


def pointer(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def int64_vector(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as a contiguous int64 vector (the kernels' index type), or None."""
    if t is None:
        return None
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t if t.is_contiguous() else t.contiguous()
