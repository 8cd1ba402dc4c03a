"""Prepared launches: every entry point's plain eager call, with its fixed settings checked and its backend
resolved once (``prepare``) and the backend's launch bound (``build``).  The modules keep theirs on themselves
(``run_embedding``, ``run_addition``), the functional entry points here, per spec (``functional_embedding``,
``functional_addition``).  A launch serves only the kind of call it was prepared for; every other call, and
every bad one, takes the general path (``functional.apply_spec``), which raises the errors.  What a launch
serves and why it is built so: docs/architecture.md ("One call, drawn") and docs/design.md.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Optional

import torch

from . import backends as _backends
from . import config
from ._dispatch import BACKENDS, resolve_backend
from ._validate import check_dropout_p, check_weight_for_spec
from .ops import AddSinusoidalFunction, dense_weight_gradient, ids_checked, sparse_weight_gradient

_STRIDED, _CONTIGUOUS = torch.strided, torch.contiguous_format
_ID_DTYPES = _backends.ID_DTYPES
_grad_enabled = torch.is_grad_enabled  # a module-level name saves an attribute lookup per call
_INT64_MIN, _INT64_END = -(2**63), 2**63
# add_sinusoidal's launch reads rows 0..N-1 that it numbers itself, so its table's row count is only a
# bound: the largest for which the CUDA kernels keep 32-bit row arithmetic (forward_kernels.cuh).
_ADDITION_ROW_BOUND = 2**32
_FUNCTIONAL_KEPT = 16  # entries (launches and slots) kept per spec for the functional entry points (_functional_miss)
_FUNCTIONAL_SPECS = 64  # specs whose functional launches are kept (_FUNCTIONAL)


def _bind(spec, name: str, dtype, num_rows: int, device, zero_pe_at_padding: bool):
    """Backend ``name``'s PreparedLaunch for tables of ``num_rows`` rows of ``dtype`` on ``device``, or None
    where the backend has none."""
    prepare = getattr(BACKENDS[name], "prepare_forward", None)
    if prepare is None:
        return None
    return prepare(dtype, num_rows, device, spec.turns_tensor(device), spec.kernel_params(zero_pe_at_padding))


def _dense(t: torch.Tensor) -> bool:
    """Memory a kernel reads as rows in order: strided, contiguous, no lazy negation, not a zero tensor
    (which has no memory: the general path names it).  ``PreparedForward.run`` repeats these checks
    inline: a new one goes there too."""
    return t.layout is _STRIDED and t.is_contiguous() and not t.is_neg() and not t._is_zerotensor()


def _launch_positions(positions, offset, shape, device) -> bool:
    """Whether a launch takes these explicit positions as they are: a plain contiguous int64 tensor of the
    tokens' ``shape`` on ``device``, with offset 0 (anything else: the general path broadcasts, converts or
    refuses it)."""
    return (type(positions) is torch.Tensor and positions.dtype is torch.int64 and offset == 0
            and not positions.is_nested and positions.shape == shape and positions.device == device
            and _dense(positions))


class _Bound:
    """What both prepared launches share: being current while the backend's compiled code is the one they
    were made with (``backends.PreparedLaunch``)."""

    __slots__ = ("source", "state")

    def is_current(self) -> bool:
        return self.source.state is self.state


_NEVER_REPLACED = types.SimpleNamespace(state=None)


class _ServesNoCall:
    """Where the backend has no prepared launch (the torch reference), an entry point keeps one of these:
    ``prepared_for`` as a prepared launch's, so that it is built again only when something changes (its
    ``source`` is never replaced); ``run`` serves no call."""

    __slots__ = ()

    def __init__(self, spec, backend: str, *table_and_settings):
        self._identify(spec, backend, *table_and_settings)
        self.source, self.state = _NEVER_REPLACED, None

    def run(self, *args) -> None:
        return None


class PreparedForward(_Bound):
    """The embedding's prepared launch for one spec, backend, dropout probability and kind of table (dtype,
    shape, device)."""

    __slots__ = ("spec", "backend", "dropout", "dtype", "shape", "device", "width", "launch",
                 "last_argument", "keep_alive", "gradient")

    def __init__(self, spec, backend: str, dropout: float, weight: torch.Tensor, name: str,
                 launch: _backends.PreparedLaunch):
        self._identify(spec, backend, dropout, weight)
        self.width = spec.width
        self.launch, self.last_argument = launch.launch, launch.last_argument
        self.source, self.state, self.keep_alive = launch.source, launch.state, launch.turns
        # What the weight gradient needs (LaunchedEmbeddingFunction), after the call's ``sparse``.
        padding_idx = -1 if spec.padding_idx is None else spec.padding_idx
        self.gradient = (weight.shape[0], weight.shape[1], spec.embed_scale, padding_idx, weight.dtype, name)

    def _identify(self, spec, backend: str, dropout: float, weight: torch.Tensor) -> None:
        """What ``prepared_for`` compares a call with."""
        self.spec, self.backend, self.dropout = spec, backend, dropout
        self.dtype, self.shape, self.device = weight.dtype, weight.shape, weight.device

    @staticmethod
    def build(spec, backend: str, name: str, dropout: float, weight: torch.Tensor) -> "PreparedForward":
        """The prepared launch for calls with these (valid) settings on backend ``name``, resolved from
        ``backend``.  Where that backend has none, a stand-in that serves no call, so that an entry point
        does not ask again on every call."""
        launch = _bind(spec, name, weight.dtype, weight.shape[0], weight.device, spec.zero_pe_at_padding)
        if launch is None:
            return _NoForward(spec, backend, dropout, weight)
        return PreparedForward(spec, backend, dropout, weight, name, launch)

    @staticmethod
    def prepare(spec, backend: str, dropout, weight: torch.Tensor) -> Optional["PreparedForward"]:
        """``build`` for calls with these settings on tables like ``weight``, once the general path's checks of
        them pass (the same functions); None where one fails, and the general path raises its error."""
        try:
            check_dropout_p(dropout)
            check_weight_for_spec(weight, spec)
            name = resolve_backend(backend, weight.device, weight.dtype, float64_math=spec.precision == "float64")
        except (TypeError, ValueError, RuntimeError):
            return None
        return PreparedForward.build(spec, backend, name, dropout, weight)

    def prepared_for(self, spec, backend: str, dropout, weight) -> bool:
        """Whether a table ``weight`` with these settings is still what this launch was prepared for."""
        try:
            return (spec is self.spec and backend == self.backend and type(dropout) is float
                    and dropout == self.dropout and weight.dtype is self.dtype and weight.shape == self.shape
                    and weight.device == self.device and self.is_current())
        except RuntimeError:  # a table without sizes (a nested tensor): the general path names it
            return False

    def run(self, spec, backend: str, dropout, training: bool, sparse, weight, ids, offset,
            positions=None) -> Optional[torch.Tensor]:
        """The layer's output for ``ids`` at ``offset`` (positions ``offset + t``) or at ``positions`` when this
        launch was prepared for that call (no dropout applied); else None, and the caller takes the general
        path.  The caller has checked that the call is eager (``_dispatch.eager_call``)."""
        # prepared_for's checks and the call's own, inline: a decoding step pays for each Python call.
        if (type(offset) is not int or not _INT64_MIN <= offset < _INT64_END
                or spec is not self.spec or backend != self.backend or type(dropout) is not float
                or dropout != self.dropout or (training and dropout) or (sparse is not False and sparse is not True)
                or (training is not False and training is not True)):
            return None
        try:
            # (and _dense of ids and weight, inline for the same reason)
            if (ids.dtype not in _ID_DTYPES or weight.dtype is not self.dtype or weight.shape != self.shape
                    or ids.layout is not _STRIDED or not ids.is_contiguous() or ids.is_neg() or ids._is_zerotensor()
                    or ids.is_nested or weight.layout is not _STRIDED or not weight.is_contiguous() or weight.is_neg()
                    or weight._is_zerotensor() or ids.device != self.device or weight.device != self.device
                    or self.source.state is not self.state):
                return None
            if positions is not None and not _launch_positions(positions, offset, ids.shape, self.device):
                return None
        except RuntimeError:  # a table without sizes (a nested tensor's shape raises): the general path names it
            return None
        if weight.requires_grad and _grad_enabled():
            return LaunchedEmbeddingFunction.apply(weight, ids, self._output, offset, positions,
                                                   (sparse,) + self.gradient)
        return self._output(weight, ids, offset, positions)

    def _output(self, weight, ids, offset, positions) -> torch.Tensor:
        shape = ids.shape
        # new_empty with the sizes unpacked: the cheapest allocation call.  Not a view, as nn.Embedding's
        # output: under no_grad a view could not later be modified in place with grad mode on.
        out = weight.new_empty(*shape, self.width)
        if _backends.POISON_OUTPUTS:
            out.fill_(float("nan"))
        self.launch(ids, weight, self.shape[1], out, offset, shape[-1] if shape else 1, ids.numel(),
                    self.last_argument(), config.check_ids, positions)
        return out


class _NoForward(_ServesNoCall, PreparedForward):
    __slots__ = ()


class PreparedAddition(_Bound):
    """``add_sinusoidal``'s prepared launch for one spec, backend, dtype and device: ``x [..., S, D]``
    (contiguous) is the table, its row n read by token n, through row numbers 0..N-1 kept on the device
    (``_row_numbers``)."""

    __slots__ = ("spec", "backend", "dtype", "device", "width", "x_scale", "launch", "last_argument",
                 "keep_alive", "on_gpu", "numbers", "growing")

    def __init__(self, spec, backend: str, x: torch.Tensor, launch: _backends.PreparedLaunch):
        self._identify(spec, backend, x)
        self.width, self.x_scale = spec.pe_width, spec.embed_scale
        self.launch = launch.launch  # row numbers are int64, which every launch takes
        self.last_argument, self.keep_alive = launch.last_argument, launch.turns
        self.source, self.state = launch.source, launch.state
        self.on_gpu = x.device.type == "cuda"
        self.numbers = None  # (row numbers, the stream handle they were made on): _row_numbers
        self.growing = threading.Lock()

    def _identify(self, spec, backend: str, x: torch.Tensor) -> None:
        """What ``prepared_for`` compares a call with."""
        self.spec, self.backend, self.dtype, self.device = spec, backend, x.dtype, x.device

    @staticmethod
    def build(spec, backend: str, name: str, x: torch.Tensor) -> "PreparedAddition":
        """As ``PreparedForward.build``, for ``add_sinusoidal``'s calls on ``x``'s dtype and device."""
        launch = _bind(spec, name, x.dtype, _ADDITION_ROW_BOUND, x.device, False)
        return _NoAddition(spec, backend, x) if launch is None else PreparedAddition(spec, backend, x, launch)

    @staticmethod
    def prepare(spec, backend: str, x: torch.Tensor) -> Optional["PreparedAddition"]:
        """As ``PreparedForward.prepare``, for ``add_sinusoidal``'s calls on ``x``'s dtype and device."""
        try:
            name = resolve_backend(backend, x.device, x.dtype, float64_math=spec.precision == "float64")
        except (TypeError, ValueError, RuntimeError):
            return None
        return PreparedAddition.build(spec, backend, name, x)

    def prepared_for(self, spec, backend: str, x) -> bool:
        return (spec is self.spec and backend == self.backend and x.dtype is self.dtype and x.device == self.device
                and self.is_current())

    def run(self, spec, backend: str, x, offset, positions=None) -> Optional[torch.Tensor]:
        """``x_scale * x + pe_scale * PE(position)``, positions ``offset + t`` or ``positions``, when this launch
        was prepared for that call; else None.  The caller has checked that the call is eager
        (``_dispatch.eager_call(x, x)``)."""
        try:
            if (type(offset) is not int or not _INT64_MIN <= offset < _INT64_END
                    or spec is not self.spec or backend != self.backend or x.dtype is not self.dtype
                    or x.dim() < 2 or x.shape[-1] != self.width or not _dense(x) or x.device != self.device
                    or self.source.state is not self.state
                    or (positions is not None and not _launch_positions(positions, offset, x.shape[:-1], self.device))):
                return None
        except RuntimeError:  # a tensor without sizes, as in PreparedForward.run
            return None
        num_rows = x.numel() // self.width
        if not 0 < num_rows <= _ADDITION_ROW_BOUND:
            return None
        last_argument = self.last_argument()  # the stream handle on a GPU, the thread count on the CPU
        rows = self._row_numbers(num_rows, last_argument)
        if rows is None:
            return None
        if x.requires_grad and _grad_enabled():
            return LaunchedAdditionFunction.apply(x, self.x_scale, self._output, offset, rows, last_argument, positions)
        return self._output(x, offset, rows, last_argument, positions)

    def _row_numbers(self, num_rows: int, stream) -> Optional[torch.Tensor]:
        """At least ``num_rows`` row numbers 0, 1, ... for a launch on ``stream`` (on a GPU), or None where they
        cannot be used, and the call takes the general path.

        They only ever grow, under a lock, and a launch uses the tensor it was given here, so no thread
        reads numbers shorter than its rows.  On a GPU they serve one stream, the one they were made on:
        a launch on another stream could read them before they are written, and a tensor is freed into
        its own stream's pool, so only that stream's launches are ordered before its reuse.  They are
        never used while a CUDA graph is captured: the graph would keep their address after they grow."""
        numbers = self.numbers  # read once: another thread may replace it
        if self.on_gpu and (torch.cuda.is_current_stream_capturing()
                            or (numbers is not None and numbers[1] != stream)):
            return None
        if numbers is not None and numbers[0].shape[0] >= num_rows:
            return numbers[0]
        with self.growing:
            numbers = self.numbers
            if numbers is None or numbers[0].shape[0] < num_rows:
                count = max(num_rows, 2 * (0 if numbers is None else numbers[0].shape[0]))
                with torch.inference_mode(False):  # plain data, whatever mode the call that grows them is in
                    rows = torch.arange(count, dtype=torch.int64, device=self.device)
                numbers = self.numbers = (rows, stream)
        return numbers[0] if not self.on_gpu or numbers[1] == stream else None

    def _output(self, x, offset, rows, last_argument, positions) -> torch.Tensor:
        # Contiguous, as the general path's output (x's strides on size-1 dimensions are not copied);
        # empty_like is the cheaper allocation call here.
        out = torch.empty_like(x, memory_format=_CONTIGUOUS)
        if _backends.POISON_OUTPUTS:
            out.fill_(float("nan"))
        self.launch(rows, x, self.width, out, offset, x.shape[-2], x.numel() // self.width, last_argument, False,
                    positions)
        return out


class _NoAddition(_ServesNoCall, PreparedAddition):
    __slots__ = ()


def _no_launch_serves(offset, training: bool = False, dropout=0.0) -> bool:
    """Whether no prepared launch could serve the call: a tensor offset, or a dropout to apply (or one that is not a
    float).  Such a call takes the general path without preparing a launch, so its backend is resolved once, there."""
    return type(offset) is not int or type(dropout) is not float or (training and dropout != 0.0)


def run_embedding(owner, spec, backend: str, dropout, training: bool, sparse, weight, ids, offset, positions):
    """A ``SinusoidalEmbedding`` call (plain eager, ``owner`` the module) through the module's prepared launch,
    prepared first where it has none for these settings and this kind of table; None where the call needs the
    general path."""
    prepared = owner._prepared  # read once: another thread may replace it
    if prepared is not None:
        out = prepared.run(spec, backend, dropout, training, sparse, weight, ids, offset, positions)
        if out is not None or prepared.prepared_for(spec, backend, dropout, weight):
            return out
    if _no_launch_serves(offset, training, dropout):
        return None
    prepared = owner._prepared = PreparedForward.prepare(spec, backend, dropout, weight)
    return None if prepared is None else prepared.run(spec, backend, dropout, training, sparse, weight, ids, offset,
                                                      positions)


def run_addition(owner, spec, backend: str, x, offset, positions):
    """As ``run_embedding``, for a ``SinusoidalPositionalEncoding`` call."""
    prepared = owner._prepared
    if prepared is not None:
        out = prepared.run(spec, backend, x, offset, positions)
        if out is not None or prepared.prepared_for(spec, backend, x):
            return out
    if _no_launch_serves(offset):
        return None
    prepared = owner._prepared = PreparedAddition.prepare(spec, backend, x)
    return None if prepared is None else prepared.run(spec, backend, x, offset, positions)


# The functional entry points' prepared launches: id(spec) -> (spec, {key or slot: launch}).  Keyed by identity
# because a spec is made once per set of arguments and kept (_validate.make_spec), and hashing its frequencies
# would cost each call more than the lookup saves; the entry holds its spec, so no other object takes its id.
_FUNCTIONAL: dict = {}


def _kept_for(spec) -> dict:
    entry = _FUNCTIONAL.get(id(spec))
    if entry is not None and entry[0] is spec:
        return entry[1]
    if len(_FUNCTIONAL) >= _FUNCTIONAL_SPECS:
        _FUNCTIONAL.clear()
    kept = {}
    _FUNCTIONAL[id(spec)] = (spec, kept)
    return kept


def forget_functional_launches() -> None:
    """Drop every launch the functional entry points keep (their next calls prepare them again)."""
    _FUNCTIONAL.clear()


# The functional entry points key their launches by backend name (a str: anything else takes the general
# path, which names it), the table's kind and, for the embedding, the dropout probability.  A call first tries
# its slot, the launch that last served its backend (and dropout probability), inline: ``run`` checks the
# table's kind more cheaply than a key of its dtype, shape and device could be built.  Only where that launch
# does not serve the call is the one kept for the call's kind of table tried (``_functional_miss``).
def _functional_miss(kept, slot, tried, key, run_arguments, prepare, prepare_arguments):
    """The call's slot did not serve it (``tried``: the slot's launch, or None): the launch kept for the call's
    kind of table, prepared first where there is none, made the slot's if it serves (calls that alternate
    between kinds of table)."""
    for_table = kept.get(key)
    if for_table is None or not for_table.is_current():
        if len(kept) >= _FUNCTIONAL_KEPT:
            kept.clear()
        for_table = prepare(*prepare_arguments)
        if for_table is None:
            return None
        kept[key] = for_table
    elif for_table is tried:
        return None
    out = for_table.run(*run_arguments)
    if out is not None:
        kept[slot] = for_table
    return out


def functional_embedding(spec, backend: str, dropout, training: bool, sparse, weight, ids, offset, positions):
    """``sinusoidal_embedding``'s plain eager call through the launch kept for its spec (``spec``: the arguments',
    already made), or None (general path)."""
    if type(backend) is not str or type(dropout) is not float:
        return None
    kept, slot = _kept_for(spec), (backend, dropout)
    prepared = kept.get(slot)
    if prepared is not None:
        out = prepared.run(spec, backend, dropout, training, sparse, weight, ids, offset, positions)
        if out is not None:
            return out
    if _no_launch_serves(offset, training, dropout):
        return None
    return _functional_miss(kept, slot, prepared, (backend, weight.dtype, weight.shape, weight.device, dropout),
                            (spec, backend, dropout, training, sparse, weight, ids, offset, positions),
                            PreparedForward.prepare, (spec, backend, dropout, weight))


def functional_addition(spec, backend: str, x, offset, positions):
    """``add_sinusoidal``'s plain eager call through the launch kept for its spec, or None (general path)."""
    if type(backend) is not str:
        return None
    kept, slot = _kept_for(spec), ("add", backend)
    prepared = kept.get(slot)
    if prepared is not None:
        out = prepared.run(spec, backend, x, offset, positions)
        if out is not None:
            return out
    if _no_launch_serves(offset):
        return None
    return _functional_miss(kept, slot, prepared, ("add", backend, x.dtype, x.device), (spec, backend, x, offset,
                            positions), PreparedAddition.prepare, (spec, backend, x))


class _PlainEagerApply:
    """``apply`` as torch's C++ Function apply, without ``torch.autograd.Function.apply``'s per-call argument
    binding (as ``ops._DirectApply``, without its torch.func check: these Functions run on plain eager calls
    only).  Defined here so that a prepared training call enters no other file to apply them."""

    @classmethod
    def apply(cls, *args):
        return super(torch.autograd.Function, cls).apply(*args)


class LaunchedEmbeddingFunction(_PlainEagerApply, torch.autograd.Function):
    """An eager training call that a prepared launch serves: its forward is the launch, its backward the
    weight-gradient op that ``ops.EmbeddingFunction`` uses (``ops.dense_weight_gradient`` or
    ``ops.sparse_weight_gradient``) with the same ids, so gradients and double backward are the same bit for
    bit.  The gradient's settings travel as one tuple because the Function's apply converts each argument.
    Plain eager calls only: torch.func and forward AD take ``EmbeddingFunction``."""

    @staticmethod
    def forward(ctx, weight, ids, launch, offset, positions, gradient):
        out = launch(weight, ids, offset, positions)
        # Flat, as EmbeddingFunction saves them: a recomputation (activation checkpointing) may take the
        # other path and must save the same.
        ctx.save_for_backward(ids.reshape(-1))
        ctx.gradient, ctx.weight_gradient = gradient, dense_weight_gradient
        if gradient[0]:  # sparse: told now whether the launch's id check ruled out-of-range ids out
            ctx.weight_gradient = functools.partial(
                sparse_weight_gradient, ids_in_range=ids_checked(ids, 0, gradient[1], gradient[1]))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        _, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype, backend = ctx.gradient
        grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_weight = ctx.weight_gradient(grad_out.reshape(-1, grad_out.shape[-1]), ids, num_embeddings,
                                              token_width, embed_scale, padding_idx, weight_dtype, None, 0.0, backend)
        return grad_weight, None, None, None, None, None


class LaunchedAdditionFunction(_PlainEagerApply, torch.autograd.Function):
    """An eager training call of ``add_sinusoidal`` that a prepared launch serves (as
    ``LaunchedEmbeddingFunction``): the gradient to ``x`` is ``x_scale * grad``, as in the op."""

    @staticmethod
    def forward(ctx, x, x_scale, launch, *launch_arguments):
        ctx.x_scale, ctx.num_inputs = x_scale, 3 + len(launch_arguments)
        return launch(x, *launch_arguments)

    backward = staticmethod(AddSinusoidalFunction.backward)
