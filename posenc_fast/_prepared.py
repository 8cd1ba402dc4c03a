"""Prepared launches: an entry point's repeated eager call, with what stays fixed between calls
worked out once.

A decoding step calls the layer with a few tokens, so its cost is host time: validation, backend
choice, argument packing and the binding's conversion of thirty-one arguments (bench/host_overhead.py
times it).  After a call that took the general path (``functional.apply_spec`` / ``apply_add_spec``)
and could have taken this one, the entry point keeps a prepared launch: the resolved backend, its
kernel parameters and a ``PreparedLaunch`` (the backend's binding with those parameters bound).

- ``SinusoidalEmbedding`` keeps a :class:`PreparedForward` on the module; ``sinusoidal_embedding`` keeps
  one on its spec per backend and table (``functional_embedding``).
- ``SinusoidalPositionalEncoding`` keeps a :class:`PreparedAddition`; ``add_sinusoidal`` keeps one on its
  spec per backend, dtype and device (``functional_addition``): ``x`` plays a table whose row n is read
  by token n, as in the op.

The next call runs the prepared launch if it is the same kind of call on the same kind of table; in
training (autograd) it runs inside ``ops.LaunchedEmbeddingFunction`` / ``LaunchedAdditionFunction``,
whose backward is the general path's.  Anything else (another dtype, shape or device of the table,
another spec, backend, position rule, vocabulary range or dropout probability, a changed extension, a
call that needs dropout, positions, a tensor offset or cu_seqlens, or one under torch.compile, tracing,
a functorch transform, forward-mode AD or a dispatch mode) takes the general path, which validates
everything and raises the errors.

What a prepared launch holds does not depend on the table's data: its pointer and row stride are
read on every call, so in-place updates, ``.data`` swaps and a new Parameter of the same shape need
no invalidation.  (A zero tensor, which has no memory, is refused by the binding itself.)  Backends
without ``prepare_forward`` (torch, triton) always take the general path.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import backends as _backends
from ._dispatch import get_backend, resolve_backend
from ._routing import eager_call
from .backends import kernel_params
from .ops import LaunchedAdditionFunction, LaunchedEmbeddingFunction, check_ids_if_enabled

_STRIDED = torch.strided
_INT64_MIN, _INT64_END = -(2**63), 2**63
# add_sinusoidal's launch reads rows 0..N-1 that it numbers itself, so the table's row count is only
# a bound: the largest for which the CUDA kernels keep 32-bit row arithmetic (forward_kernels.cuh).
_ADDITION_ROW_BOUND = 2**32
_FUNCTIONAL_KEPT = 8  # prepared launches kept per spec by the functional entry points


def _bind(spec, backend: str, dtype, num_rows: int, device, zero_pe_at_padding: bool):
    """(backend name, the backend's PreparedLaunch) for tables of ``num_rows`` rows of ``dtype`` on
    ``device``, or None where the backend has no prepared launch."""
    name = resolve_backend(backend, device, dtype, float64_math=spec.precision == "float64")
    prepare = getattr(get_backend(name), "prepare_forward", None)
    if prepare is None:
        return None
    launch = prepare(dtype, num_rows, device, spec.turns_tensor(device), kernel_params(spec, zero_pe_at_padding))
    return None if launch is None else (name, launch)


def _dense(t: torch.Tensor) -> bool:
    """Memory a kernel reads as rows in order: strided, contiguous, no lazy negation."""
    return t.layout is _STRIDED and t.is_contiguous() and not t.is_neg()


class PreparedForward:
    """The embedding's prepared launch for one spec, backend and kind of table (module docstring)."""

    __slots__ = ("spec", "backend", "dropout", "dtype", "shape", "device", "width", "launch", "id_codes",
                 "last_argument", "is_current", "keep_alive", "gradient")

    def __init__(self, spec, backend: str, dropout: float, weight: torch.Tensor, name: str,
                 launch: _backends.PreparedLaunch):
        self.spec, self.backend, self.dropout = spec, backend, dropout
        self.dtype, self.shape, self.device = weight.dtype, weight.shape, weight.device
        self.width = spec.width
        self.launch, self.id_codes, self.last_argument = launch.launch, launch.id_codes, launch.last_argument
        self.is_current = launch.is_current
        self.keep_alive = launch.turns
        # What the weight gradient needs (LaunchedEmbeddingFunction), after the call's ``sparse``.
        padding_idx = -1 if spec.padding_idx is None else spec.padding_idx
        self.gradient = (weight.shape[0], weight.shape[1], spec.embed_scale, padding_idx, weight.dtype, name)

    @staticmethod
    def build(spec, backend: str, dropout, weight: torch.Tensor) -> Optional["PreparedForward"]:
        """The prepared launch for the next calls like the one that just succeeded on the general path with
        these settings (so they are valid), or None when its backend has none."""
        if type(dropout) is not float:
            return None
        bound = _bind(spec, backend, weight.dtype, weight.shape[0], weight.device, spec.zero_pe_at_padding)
        return None if bound is None else PreparedForward(spec, backend, dropout, weight, *bound)

    def prepared_for(self, spec, backend: str, dropout, weight) -> bool:
        """Whether a table ``weight`` with these settings is still what this launch was prepared for."""
        return (spec is self.spec and backend == self.backend and type(dropout) is float
                and dropout == self.dropout and weight.dtype is self.dtype and weight.shape == self.shape
                and weight.device == self.device and self.is_current())

    def run(self, spec, backend: str, dropout, training: bool, sparse, weight, ids, offset) -> Optional[torch.Tensor]:
        """The layer's output for ``ids`` at ``offset`` when this launch was prepared for that call
        (positions ``offset + t``, no dropout applied); else None, and the caller takes the general path."""
        # The checks of prepared_for, inline (a decoding step pays each Python call), then the call's own.
        if (type(offset) is not int or type(ids) is not torch.Tensor or not _INT64_MIN <= offset < _INT64_END
                or spec is not self.spec or backend != self.backend or type(dropout) is not float
                or dropout != self.dropout or (training and dropout) or (sparse is not False and sparse is not True)):
            return None
        if (ids.dtype not in self.id_codes or weight.dtype is not self.dtype or weight.shape != self.shape
                or not _dense(ids) or not _dense(weight) or ids.device != self.device
                or weight.device != self.device or not eager_call(ids, weight) or not self.is_current()):
            return None
        if weight.requires_grad and torch.is_grad_enabled():
            return LaunchedEmbeddingFunction.apply(weight, ids, self._output, offset, (sparse,) + self.gradient)
        return self._output(weight, ids, offset)

    def _output(self, weight, ids, offset) -> torch.Tensor:
        shape = ids.shape
        check_ids_if_enabled(ids, self.shape[0])
        # Same dtype and device as the table; new_empty with the sizes unpacked is the cheapest allocation
        # call (about 1 us against 2 for torch.empty with a shape tuple and keywords).  Not a view, as
        # nn.Embedding's output: under no_grad a view could not later be modified in place with grad on.
        out = weight.new_empty(*shape, self.width)
        if _backends.POISON_OUTPUTS:
            out.fill_(float("nan"))
        self.launch(ids.data_ptr(), self.id_codes[ids.dtype], weight.data_ptr(), self.shape[1], out.data_ptr(),
                    offset, shape[-1] if shape else 1, ids.numel(), self.last_argument())
        return out


class PreparedAddition:
    """``add_sinusoidal``'s prepared launch for one spec, backend, dtype and device: ``x [..., S, D]``
    (contiguous) is the table, its row n read by token n (row numbers kept on the device, grown as needed)."""

    __slots__ = ("spec", "backend", "dtype", "device", "width", "x_scale", "launch", "id_code", "last_argument",
                 "is_current", "keep_alive", "row_numbers")

    def __init__(self, spec, backend: str, x: torch.Tensor, launch: _backends.PreparedLaunch):
        self.spec, self.backend, self.dtype, self.device = spec, backend, x.dtype, x.device
        self.width, self.x_scale = spec.pe_width, spec.embed_scale
        self.launch, self.id_code = launch.launch, launch.id_codes[torch.int64]
        self.last_argument, self.is_current, self.keep_alive = launch.last_argument, launch.is_current, launch.turns
        self.row_numbers = torch.arange(0, dtype=torch.int64, device=x.device)

    @staticmethod
    def build(spec, backend: str, x: torch.Tensor) -> Optional["PreparedAddition"]:
        bound = _bind(spec, backend, x.dtype, _ADDITION_ROW_BOUND, x.device, False)
        return None if bound is None else PreparedAddition(spec, backend, x, bound[1])

    def prepared_for(self, spec, backend: str, x) -> bool:
        return (spec is self.spec and backend == self.backend and x.dtype is self.dtype and x.device == self.device
                and self.is_current())

    def run(self, spec, backend: str, x, offset) -> Optional[torch.Tensor]:
        """``x_scale * x + pe_scale * PE(offset + t)`` when this launch was prepared for that call; else None."""
        if (type(offset) is not int or type(x) is not torch.Tensor or not _INT64_MIN <= offset < _INT64_END
                or spec is not self.spec or backend != self.backend or x.dtype is not self.dtype
                or x.dim() < 2 or x.shape[-1] != self.width or not _dense(x) or x.device != self.device
                or not eager_call(x, x) or not self.is_current()):
            return None
        num_rows = x.numel() // self.width
        if not 0 < num_rows <= _ADDITION_ROW_BOUND or (num_rows > self.row_numbers.shape[0]
                                                      and not self._grow_row_numbers(num_rows)):
            return None
        if x.requires_grad and torch.is_grad_enabled():
            return LaunchedAdditionFunction.apply(x, self._output, offset, self.x_scale)
        return self._output(x, offset)

    def _grow_row_numbers(self, num_rows: int) -> bool:
        """Row numbers 0..num_rows-1 or more, on the device; False where they cannot be made now (during a
        CUDA graph capture: the general path makes its own there)."""
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            if torch.cuda.is_current_stream_capturing():
                return False
            torch.cuda.synchronize(self.device)  # no launch on any stream still reads the numbers replaced here
        rows = torch.arange(max(num_rows, 2 * self.row_numbers.shape[0]), dtype=torch.int64, device=self.device)
        if on_gpu:
            torch.cuda.synchronize(self.device)  # written before a launch on another stream reads them
        self.row_numbers = rows
        return True

    def _output(self, x, offset) -> torch.Tensor:
        rows = self.row_numbers  # (they only grow: at least the rows run() checked, whatever another thread did)
        out = x.new_empty(x.shape)
        if _backends.POISON_OUTPUTS:
            out.fill_(float("nan"))
        self.launch(rows.data_ptr(), self.id_code, x.data_ptr(), self.width, out.data_ptr(), offset, x.shape[-2],
                    x.numel() // self.width, self.last_argument())
        return out


class _Unprepared:
    """Kept where the backend has no prepared launch, so that it is not asked again on every call."""

    @staticmethod
    def run(*args):
        return None

    @staticmethod
    def is_current() -> bool:
        return True


_UNPREPARED = _Unprepared()


def _keep(spec, key, build) -> None:
    """Keep on ``spec`` under ``key`` the prepared launch ``build()`` makes, unless a current one is there
    (a functional entry point's; a few per spec)."""
    kept = spec.prepared_launches
    prepared = kept.get(key)
    if prepared is None or not prepared.is_current():
        if len(kept) >= _FUNCTIONAL_KEPT:
            kept.clear()
        kept[key] = build() or _UNPREPARED


def functional_embedding(spec, backend: str, dropout, training: bool, sparse, weight, ids, offset):
    """``sinusoidal_embedding``'s call through the prepared launch kept on its spec, or None (general path).
    ``spec`` and ``weight`` are already checked; after a general-path call, ``remember_embedding``."""
    prepared = spec.prepared_launches.get((backend, weight.dtype, weight.shape, weight.device))
    return None if prepared is None else prepared.run(spec, backend, dropout, training, sparse, weight, ids, offset)


def remember_embedding(spec, backend: str, dropout, weight, ids, offset) -> None:
    """After a general-path ``sinusoidal_embedding`` call that succeeded: prepare the next ones like it."""
    if type(offset) is int and eager_call(ids, weight):
        _keep(spec, (backend, weight.dtype, weight.shape, weight.device),
              lambda: PreparedForward.build(spec, backend, dropout, weight))


def functional_addition(spec, backend: str, x, offset):
    """``add_sinusoidal``'s call through the prepared launch kept on its spec, or None (general path)."""
    prepared = spec.prepared_launches.get(("add", backend, x.dtype, x.device))
    return None if prepared is None else prepared.run(spec, backend, x, offset)


def remember_addition(spec, backend: str, x, offset) -> None:
    if type(offset) is int and type(x) is torch.Tensor and eager_call(x, x):
        _keep(spec, ("add", backend, x.dtype, x.device), lambda: PreparedAddition.build(spec, backend, x))
