"""Backends: each module computes the same op (``reference`` defines it) and exposes

    SUPPORTED_DTYPES: tuple of weight dtypes it handles
    FLOAT64_MATH: whether it implements precision="float64" (optional, default False)
    available(device) -> Optional[str]: None if usable on that device, else why not
    prepare(device) -> None: optional; run before ``available`` when the backend is asked for by name
        (``cuda`` and ``cpu`` build their extension on demand there)
    forward(ids, weight, turns, positions, offsets, offset, seq_len, params, dropout) -> Tensor[N, width]
    backward(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype, dropout)
        -> Tensor[V, token_width]   (padding_idx: -1 for none)
    prepare_forward(dtype, num_rows, device, turns, params) -> Optional[PreparedLaunch]: optional;
        ``forward`` for tables of ``num_rows`` rows of ``dtype`` on ``device``, with what stays fixed
        between calls bound once (``PreparedLaunch``)

``params`` is a :class:`KernelParams`; ``dropout`` a :class:`Dropout` (``_dropout``) or None.  Backend choice
lives in ``posenc_fast._dispatch``.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from .._dropout import Dropout  # noqa: F401  (part of the backend interface)
from .._spec import KernelParams  # noqa: F401  (part of the backend interface)
from .._validate import ID_DTYPES  # noqa: F401  (the id dtypes every kernel reads)

# Tests set this so that any element a kernel fails to write shows up as NaN.
POISON_OUTPUTS = False


def sort_ids_for_gradient(ids: torch.Tensor, num_embeddings: int):
    """``(sorted_ids, order)``: the stable sort every deterministic weight gradient starts with, out-of-range
    ids as the sentinel ``num_embeddings`` (sorted last, dropped by the kernels).  Keys are int32 whenever
    the vocabulary allows: a radix sort's passes, and its traffic, scale with the key width."""
    key_dtype = torch.int32 if num_embeddings < 2**31 - 1 else torch.int64
    source = ids if key_dtype == torch.int32 else ids.to(torch.int64)  # clamp before narrowing
    # The ids clamped to [-1, V], then -1 taken to V by the remainder modulo V + 1 (a remainder has the
    # divisor's sign): two elementwise ops where compares, an and and a where would take four, and a small
    # batch's gradient pays each op's host time (a kernel launch on a GPU).
    keys = torch.remainder(source.clamp(-1, num_embeddings), num_embeddings + 1).to(key_dtype)
    return torch.sort(keys, stable=True)


def gradient_rows(grad_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad_out`` ``[N, >= token_width]`` as the weight-gradient kernels read it: in ``dtype``, unit column
    stride, any row stride.  A gradient that is the same row for every token (``loss = out.sum()`` gives
    one value broadcast to every element: row stride 0) stays one row, read by every token: no N x width
    copy.  Another layout is copied once (a transposed gradient), as the kernels need unit columns."""
    if grad_out.shape[0] > 1 and grad_out.stride(0) == 0:
        return grad_out[:1].to(dtype).contiguous().expand(grad_out.shape)
    if grad_out.dtype != dtype:
        grad_out = grad_out.to(dtype)
    return grad_out if grad_out.stride(1) == 1 else grad_out.contiguous()


def new_buffer(shape, dtype, device) -> torch.Tensor:
    """Uninitialised buffer for a kernel to fill (NaN-poisoned under test)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out



class PreparedLaunch(NamedTuple):
    """A backend's forward with the arguments that stay fixed between calls bound once (``prepare_forward``),
    for positions ``offset + t % seq_len`` or given, and no dropout; what ``posenc_fast._prepared`` runs.  Called
    the same way on every backend:

        launch(ids, weight, weight_row_stride, out, offset, seq_len, num_tokens, last_argument(), check_ids[,
               positions])

    with contiguous ``ids`` of a dtype in ``ID_DTYPES``, a contiguous table ``weight`` of the prepared dtype (an
    embedding's: of the prepared row count; ``add_sinusoidal``'s ``x``: at most) whose rows are
    ``weight_row_stride`` elements apart, and ``out`` to fill (``num_tokens`` rows of the layer's width); with
    ``check_ids``, the ids are first range-checked against the prepared row count (``_validate.check_id_range``).
    ``positions``, where given, is a contiguous int64 tensor of ``num_tokens`` positions, and ``offset`` is 0.
    It is current while ``source.state is state`` (docs/architecture.md): one attribute read per call."""

    launch: Callable
    last_argument: Callable[[], int]  # asked per call: the CUDA stream handle, or the CPU thread count
    source: object  # what holds the backend's compiled code as ``state``
    state: object  # ``source.state`` when the launch was made
    turns: torch.Tensor  # the int64 frequencies the launch reads: kept alive with it


def current_stream(device: torch.device) -> int:
    """The current CUDA stream's raw handle on ``device``; 0 off CUDA devices (host emulation, Triton's
    interpreter)."""
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def current_stream_function(device: torch.device) -> Callable[[], int]:
    """``current_stream`` of ``device`` as a function of nothing, as cheap as it can be: a prepared launch
    asks it on every call (it is what a launch runs on, and what ``_prepared`` keys a GPU's row numbers by)."""
    if device.type != "cuda":
        return _NO_STREAM
    if _raw_stream is not None:
        return functools.partial(_raw_stream, device.index)
    return functools.partial(current_stream, device)


_NO_STREAM = int  # int() is 0: the stream handle off CUDA devices, a call that runs no Python


# The current stream's raw handle without building a torch.cuda.Stream object, host time that a decoding
# step would pay on every call; the public API where this private one is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
