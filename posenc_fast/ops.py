"""The layer's torch.library ops (embedding forward, weight gradient, ``add_sinusoidal``) with their fake
implementations and autograd; the autograd.Functions that run the same implementations without the
custom-op wrapper; and the layer in standard torch ops, for capture by other runtimes.

Opaque custom ops, so that ``torch.compile(fullgraph=True)`` traces them without graph breaks and autograd
sees one node.  Arguments are plain numbers and tensors; the caller names the backend (``_dispatch``).  The
metadata checks that keep every kernel inside its tensors (``_validate.check_op_inputs``) run first, then the
data-dependent id range check, at run time.  Fused dropout takes its seed as a tensor input: autograd keeps
the seed and backward regenerates the mask from it.  The weight gradient has an autograd formula of its own,
so double backward (e.g. a gradient penalty) works.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch import Tensor

from . import config
from ._dispatch import eager_call, get_backend, plain
from ._dropout import dropout_for
from ._spec import PEColumns
from ._validate import check_id_range, check_op_inputs, id_value_fits
from . import reference
from .reference import dropout_keep
from .backends import KernelParams


def sinusoidal_embedding_forward(ids: Tensor, weight: Tensor, turns: Tensor, positions: Optional[Tensor],
                                 offsets: Optional[Tensor], offset: int, seq_len: int, concat: bool, pe_width: int,
                                 pe_columns: List[int], embed_scale: float, pe_scale: float, padding_idx: int,
                                 zero_pe_at_padding: bool, float64_math: bool, vocab_start: int, vocab_size: int,
                                 dropout_seed: Optional[Tensor], dropout_p: float, backend: str) -> Tensor:
    """Flat forward: ``[N, width]`` for ids ``[N]``.

    ``ids`` are rows of ``weight``; for a vocabulary-parallel shard they are the global ids
    minus ``vocab_start``, and the range check is of the global ids against ``vocab_size``
    (ids of other shards are in range and read nothing here).

    ``pe_columns`` is ``PEColumns.as_list()``; ``padding_idx`` (-1: none) gets no gradient,
    and no PE when ``zero_pe_at_padding``.  ``dropout_seed`` (int64, one element; None: no
    dropout) and ``dropout_p`` select the fused dropout mask (``reference.dropout_keep``).
    """
    check_op_inputs(ids, weight, turns, positions, offsets, seq_len, concat, pe_width, pe_columns, dropout_seed)
    params = KernelParams(concat, weight.shape[1], pe_width, PEColumns.from_list(pe_columns), embed_scale, pe_scale,
                          padding_idx if zero_pe_at_padding else -1, float64_math)
    return run_forward(ids, weight, turns, positions, offsets, offset, seq_len, params, vocab_start, vocab_size,
                       dropout_seed, dropout_p, backend)


def run_forward(ids, weight, turns, positions, offsets, offset, seq_len, params: KernelParams, vocab_start: int,
                vocab_size: int, dropout_seed, dropout_p: float, backend: str) -> Tensor:
    """The forward after its metadata checks (``check_op_inputs``): the id range check, then the backend.
    Eager calls (``functional.apply_spec``) call it directly, with a validated ``Batch`` and the spec's
    cached ``KernelParams``."""
    if config.id_check_enabled():
        check_id_range(ids, vocab_size, vocab_start)
    return get_backend(backend).forward(ids, weight, turns, positions, offsets, offset, seq_len, params,
                                        dropout_for(dropout_seed, dropout_p))


# The op under a name of its own; eager calls bypass it through ``run_forward`` (``_dispatch.eager_call``).
sinusoidal_embedding_op = torch.library.custom_op("posenc_fast::sinusoidal_embedding", mutates_args=())(
    sinusoidal_embedding_forward)


@sinusoidal_embedding_op.register_fake
def _(ids, weight, turns, positions, offsets, offset, seq_len, concat, pe_width, pe_columns, embed_scale, pe_scale,
      padding_idx, zero_pe_at_padding, float64_math, vocab_start, vocab_size, dropout_seed, dropout_p, backend):
    width = weight.shape[1] + pe_width if concat else weight.shape[1]
    return weight.new_empty((ids.shape[0], width))


def weight_gradient(grad_out: Tensor, ids: Tensor, num_embeddings: int, token_width: int, embed_scale: float,
                    padding_idx: int, weight_dtype: torch.dtype, dropout_seed: Optional[Tensor], dropout_p: float,
                    backend: str) -> Tensor:
    """Weight gradient ``[num_embeddings, token_width]`` in ``weight_dtype``; deterministic.  With dropout, the
    forward's mask is regenerated from the same seed.  The backward op's implementation, which eager calls run
    without torch.library's wrapper (``_direct_weight_gradient``)."""
    if (grad_out.dim() != 2 or ids.dim() != 1 or grad_out.shape[0] != ids.shape[0]
            or grad_out.shape[1] < token_width or num_embeddings < 0 or token_width < 0):
        raise ValueError(f"grad_out of shape {list(grad_out.shape)} and ids of shape {list(ids.shape)} do not fit a "
                         f"weight gradient of shape [{num_embeddings}, {token_width}]: expected grad_out "
                         f"[len(ids), >= {token_width}]")
    if ids.device != grad_out.device or not grad_out.is_floating_point() or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grad_out (dtype {grad_out.dtype} on {grad_out.device}) must be floating point and ids "
                         f"(dtype {ids.dtype} on {ids.device}) int32 or int64 on the same device")
    return get_backend(backend).backward(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx,
                                         weight_dtype, dropout_for(dropout_seed, dropout_p))


# The backward op; eager calls bypass it as the forward's (``WeightGradient``, ``dense_weight_gradient``).
sinusoidal_embedding_backward_op = torch.library.custom_op("posenc_fast::sinusoidal_embedding_backward",
                                                           mutates_args=())(weight_gradient)


@sinusoidal_embedding_backward_op.register_fake
def _(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype, dropout_seed, dropout_p,
      backend):
    return grad_out.new_empty((num_embeddings, token_width), dtype=weight_dtype)


def _direct_weight_gradient(grad_out, ids, *rest) -> Tensor:
    """``weight_gradient`` under the op's name in a profile (the op would show as a row of its own)."""
    if _profiler_enabled():
        with torch.profiler.record_function("posenc_fast::sinusoidal_embedding_backward"):
            return weight_gradient(grad_out, ids, *rest)
    return weight_gradient(grad_out, ids, *rest)


_profiler_enabled = torch.autograd._profiler_enabled


def _save_for_weight_gradient(ctx, ids, weight, embed_scale, padding_idx, dropout_seed, dropout_p, backend):
    """Keep what the weight gradient needs, for the op's autograd and ``EmbeddingFunction`` alike: the ids,
    the seed and the numbers, nothing of size tokens x width."""
    ctx.save_for_backward(ids, dropout_seed)
    ctx.num_embeddings, ctx.token_width = weight.shape
    ctx.weight_dtype, ctx.embed_scale, ctx.padding_idx = weight.dtype, embed_scale, padding_idx
    ctx.dropout_p, ctx.backend = dropout_p, backend


def _weight_gradient(ctx, grad_out, gradient=None):
    """The weight gradient from what ``_save_for_weight_gradient`` kept; ``gradient`` computes it (default:
    the backward op; ``EmbeddingFunction`` passes ``dense_weight_gradient`` or ``sparse_weight_gradient``)."""
    ids, dropout_seed = ctx.saved_tensors
    return (gradient or sinusoidal_embedding_backward_op)(
        grad_out, ids, ctx.num_embeddings, ctx.token_width, ctx.embed_scale, ctx.padding_idx, ctx.weight_dtype,
        dropout_seed, ctx.dropout_p, ctx.backend)


def _setup_context(ctx, inputs, output):
    (ids, weight, _turns, _positions, _offsets, _offset, _seq_len, _concat, _pe_width, _pe_columns, embed_scale,
     _pe_scale, padding_idx, _zero_pe_at_padding, _float64_math, _vocab_start, _vocab_size, dropout_seed, dropout_p,
     backend) = inputs
    _save_for_weight_gradient(ctx, ids, weight, embed_scale, padding_idx, dropout_seed, dropout_p, backend)
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_out):
    grad_weight = _weight_gradient(ctx, grad_out) if ctx.needs_input_grad[1] else None
    return (None, grad_weight) + (None,) * (ctx.num_inputs - 2)


sinusoidal_embedding_op.register_autograd(_backward, setup_context=_setup_context)


def _c_apply(cls, args):
    """The C++ apply of Function ``cls`` (forward, then setup_context)."""
    return super(torch.autograd.Function, cls).apply(*args)


class _DirectApply:
    """What the Functions below share: ``apply`` without ``torch.autograd.Function.apply``'s argument binding,
    outside torch.func, and the vmap rule.

    For a Function with a separate ``setup_context`` (which torch.func requires), torch's ``apply`` binds
    the arguments to ``forward``'s signature on every call only to fill in defaults, more host time than
    the rest of a training call.  Every caller passes every argument, so outside torch.func this calls the
    C++ apply (``forward``, then ``setup_context``) directly; under torch.func, torch's own; under torch.compile
    (forward-mode AD: ``_dispatch.route``), the C++ apply run eagerly, as Dynamo cannot trace it.  It also skips
    torch's unwrapping of tensors kept from a finished functorch transform: such a tensor is not ``plain``
    and takes the op, whose dispatcher unwraps it."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        if torch.compiler.is_compiling():
            return torch.compiler.disable(_c_apply)(cls, args)
        return super(torch.autograd.Function, cls).apply(*args)

    @classmethod
    def vmap(cls, info, in_dims, *args):
        """The vmap rule: one call per slice of the batched arguments, stacked.  PyTorch's fallback for ops
        without a batching rule does the same but warns; an error inside is raised as is."""
        calls = []
        for b in range(info.batch_size):
            # A tensor's in_dim is an int or None; a non-tensor argument's (KernelParams, a list) is a tree of Nones.
            sliced = [arg.select(dim, b).contiguous() if isinstance(dim, int) else arg
                      for arg, dim in zip(args, in_dims)]
            calls.append(cls.apply(*sliced))
        return torch.stack(calls), 0


class EmbeddingFunction(_DirectApply, torch.autograd.Function):
    """The op's forward and autograd formula without torch.library's custom-op wrapper, for eager
    training, forward-mode AD and torch.func (``_dispatch.route`` picks it).

    - Eager training: the custom-op wrapper re-reads the op's schema for every argument on every call
      (``torch._library.utils.fill_defaults``), most of a training call's host time.  Same implementation
      (``run_forward``), saved tensors and backward op, so gradients, determinism and double backward are
      the op's.
    - Forward-mode AD and ``torch.func.jvp``/``jacfwd``: the output is linear in the weight, so its
      tangent is the same layer on the weight's tangent with no PE (``pe_scale = 0``), the same dropout
      mask, and none at ``padding_idx`` tokens: the adjoint of the weight gradient, so ``jacfwd`` and
      ``jacrev`` agree.
    - ``torch.func.grad``/``vjp``/``jacrev``: ``setup_context`` is separate from ``forward``, as
      functorch requires.  ``vmap`` (per-sample gradients, ``jacfwd``): one call per slice.
    """

    @staticmethod
    def forward(weight, ids, turns, positions, offsets, offset, seq_len, params: KernelParams, padding_idx,
                vocab_start, vocab_size, dropout_seed, dropout_p, backend, sparse=False):
        if plain(weight) and plain(ids) and plain(positions) and plain(offsets):
            return run_forward(ids, weight, turns, positions, offsets, offset, seq_len, params, vocab_start,
                               vocab_size, dropout_seed, dropout_p, backend)
        # Tensors torch.func has wrapped: the op, which rebuilds these params from its flat arguments
        # (pe_zero_id: padding_idx with zero_pe_at_padding).
        return sinusoidal_embedding_op(ids, weight, turns, positions, offsets, offset, seq_len, params.concat,
                                       params.pe_width, params.columns.as_list(), params.embed_scale,
                                       params.pe_scale, params.pe_zero_id, params.pe_zero_id >= 0,
                                       params.float64_math, vocab_start, vocab_size, dropout_seed, dropout_p, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (weight, ids, turns, positions, offsets, offset, seq_len, params, padding_idx, vocab_start, vocab_size,
         dropout_seed, dropout_p, backend, sparse) = inputs
        _save_for_weight_gradient(ctx, ids, weight, params.embed_scale, padding_idx, dropout_seed, dropout_p, backend)
        ctx.save_for_forward(ids, turns, positions, offsets, dropout_seed)
        ctx.layer = (offset, seq_len, params, padding_idx, vocab_start, vocab_size, dropout_p, backend)
        ctx.sparse_gradient = None  # with sparse=True: told now whether the id check ruled out-of-range ids out
        if sparse:
            ctx.sparse_gradient = functools.partial(
                sparse_weight_gradient, ids_in_range=ids_checked(ids, vocab_start, vocab_size, weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_out):
        grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_weight = _weight_gradient(ctx, grad_out, ctx.sparse_gradient or dense_weight_gradient)
        return (grad_weight,) + (None,) * 14

    @staticmethod
    def jvp(ctx, weight_tangent, *_input_tangents):
        ids, turns, positions, offsets, dropout_seed = ctx.saved_tensors
        offset, seq_len, params, padding_idx, vocab_start, vocab_size, dropout_p, backend = ctx.layer
        if weight_tangent is None:
            return None
        token_params = params._replace(pe_scale=0.0, pe_zero_id=-1)
        tangent = EmbeddingFunction.apply(weight_tangent, ids, turns, positions, offsets, offset, seq_len,
                                          token_params, padding_idx, vocab_start, vocab_size, dropout_seed, dropout_p,
                                          backend, False)
        padding = _padding_mask(ids, padding_idx)
        if padding is not None:
            tangent = torch.where(padding.unsqueeze(-1), 0.0, tangent)
        return tangent


def _backward_setup_context(ctx, inputs, output):
    (grad_out, ids, _num_embeddings, token_width, embed_scale, padding_idx, _weight_dtype, dropout_seed, dropout_p,
     _backend) = inputs
    ctx.save_for_backward(ids, dropout_seed)
    ctx.grad_out_shape, ctx.grad_out_dtype = tuple(grad_out.shape), grad_out.dtype
    ctx.token_width, ctx.embed_scale, ctx.padding_idx, ctx.dropout_p = token_width, embed_scale, padding_idx, dropout_p
    ctx.num_inputs = len(inputs)


def _backward_backward(ctx, grad_grad_weight):
    """The weight gradient is linear in ``grad_out``: ``grad_weight[v] = sum over tokens n with ids[n] = v
    of embed_scale * keep[n] * grad_out[n, :token_width]``.  Its adjoint gathers rows of
    ``grad_grad_weight`` back to the tokens (PE columns get nothing), in float64, rounded once."""
    ids, dropout_seed = ctx.saved_tensors
    grad_grad_out = None
    if ctx.needs_input_grad[0]:
        ids64 = ids.to(torch.int64)
        num_embeddings = grad_grad_weight.shape[0]
        counted = (ids64 >= 0) & (ids64 < num_embeddings) & (ids64 != ctx.padding_idx)
        rows = grad_grad_weight.to(torch.float64)[torch.where(counted, ids64, 0)] if num_embeddings else \
            grad_grad_weight.new_zeros((ids64.shape[0], ctx.token_width), dtype=torch.float64)
        rows = torch.where(counted.unsqueeze(-1), rows * ctx.embed_scale, 0.0)
        dropout = dropout_for(dropout_seed, ctx.dropout_p)
        if dropout is not None:
            keep = dropout_keep(dropout.seed, ids64.shape[0], ctx.token_width, dropout.threshold)
            rows = torch.where(keep, rows * dropout.scale, 0.0)
        grad_grad_out = rows.new_zeros(ctx.grad_out_shape)
        grad_grad_out[:, : ctx.token_width] = rows
        grad_grad_out = grad_grad_out.to(ctx.grad_out_dtype)
    return (grad_grad_out,) + (None,) * (ctx.num_inputs - 1)


sinusoidal_embedding_backward_op.register_autograd(_backward_backward, setup_context=_backward_setup_context)


def _padding_mask(ids: Tensor, padding_idx: int) -> Optional[Tensor]:
    """``ids == padding_idx``, or None where no id can be the padding one (none: negative; or past the ids'
    dtype)."""
    return ids == padding_idx if padding_idx >= 0 and id_value_fits(ids, padding_idx) else None


def sparse_weight_gradient(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype,
                           dropout_seed, dropout_p, backend, ids_in_range: bool = False) -> Tensor:
    """The weight gradient as ``nn.Embedding(sparse=True)`` gives it (``sparse=True``): a sparse COO tensor
    with one row per token, uncoalesced, ``embed_scale`` times the token columns of ``grad_out`` (the dropout
    mask applied).  No sort, no sum: deterministic, its cost tracks the tokens, and no host sync unless tokens
    must be left out.  Those are the padding row's, as nn.Embedding leaves them out, and out-of-range ids
    unless the forward's id check made sure there are none (``ids_in_range``, ``ids_checked``); leaving
    them out is a boolean index, one sync, as nn.Embedding's with a padding_idx."""
    dropout = dropout_for(dropout_seed, dropout_p)
    token_rows = grad_out if grad_out.shape[1] == token_width else grad_out[:, :token_width]
    if dropout is None:
        values = token_rows * embed_scale if embed_scale != 1.0 else token_rows
    elif (torch.is_grad_enabled() and grad_out.requires_grad) or not (plain(grad_out) and plain(ids)):
        # Differentiable again (double backward), or under torch.func, whose wrappers no kernel can read.
        keep = dropout_keep(dropout.seed, ids.shape[0], token_width, dropout.threshold)
        values = torch.where(keep, token_rows * (embed_scale * dropout.scale), 0.0)
    else:
        # The forward's kernel on grad_out's rows as the table, with no PE: the mask depends on the element's
        # token and column alone, so it is the forward's.
        params = KernelParams(False, token_width, token_width, PEColumns.of("interleaved", token_width, False),
                              embed_scale, 0.0, -1, False)
        turns = torch.zeros(token_width // 2, dtype=torch.int64, device=grad_out.device)
        rows = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device)
        if token_rows.stride(0) < token_width:  # (one row read by every token: the kernels take a table)
            token_rows = token_rows.contiguous()
        values = get_backend(backend).forward(rows, token_rows, turns, None, None, 0, max(ids.shape[0], 1), params,
                                              dropout)
    # (each conversion only where needed: a small batch's backward is mostly host time).  Strides, not
    # is_contiguous(): torch's sparse kernels step by stride(0) even for one row, whose stride is_contiguous()
    # ignores (one token's row sliced from a concat output would carry its PE gradient into the next row).
    if values.dtype != weight_dtype or values.stride() != (token_width, 1):
        values = values.to(weight_dtype, memory_format=torch.contiguous_format, copy=True)
    indices = ids if ids.dtype == torch.int64 else ids.to(torch.int64)
    left_out = _padding_mask(ids, padding_idx)
    if not ids_in_range:
        outside = (indices < 0) | (indices >= num_embeddings)
        left_out = outside if left_out is None else left_out | outside
    if left_out is not None:
        kept = ~left_out
        indices, values = indices[kept], values[kept]
    return torch.sparse_coo_tensor(indices.unsqueeze(0), values, (num_embeddings, token_width), check_invariants=False)


def ids_checked(ids, vocab_start: int, vocab_size: int, num_rows: int) -> bool:
    """Whether the forward's id range check made every id a row of the table: the check is on, was not skipped
    by a CUDA graph capture, and the table is not a vocabulary shard (whose ids of other shards are outside it).
    Taken at the forward, for ``sparse_weight_gradient``: the backward may run after the check is switched."""
    return (config.check_ids and vocab_start == 0 and vocab_size == num_rows
            and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()))


class WeightGradient(_DirectApply, torch.autograd.Function):
    """The weight-gradient op as an autograd.Function, for ``EmbeddingFunction.backward``: the same op and
    double-backward formula, plus what torch.func needs to differentiate a gradient (``hessian``,
    ``jacfwd(jacrev(...))``): a separate ``setup_context``, a vmap rule, and a ``jvp`` (the gradient is
    linear in ``grad_out``: its tangent is the gradient of ``grad_out``'s tangent)."""

    @staticmethod
    def forward(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype, dropout_seed,
                dropout_p, backend):
        # Eager on plain tensors: without the op's wrapper, as EmbeddingFunction (nothing is recorded here).
        op = _direct_weight_gradient if eager_call(ids, grad_out) else sinusoidal_embedding_backward_op
        return op(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype, dropout_seed,
                  dropout_p, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _backward_setup_context(ctx, inputs, output)
        ids, ctx.num_embeddings, ctx.weight_dtype, dropout_seed, ctx.backend = (inputs[1], inputs[2], inputs[6],
                                                                                 inputs[7], inputs[9])
        ctx.save_for_forward(ids, dropout_seed)

    backward = staticmethod(_backward_backward)

    @staticmethod
    def jvp(ctx, grad_out_tangent, *_input_tangents):
        if grad_out_tangent is None:
            return None
        ids, dropout_seed = ctx.saved_tensors
        return WeightGradient.apply(grad_out_tangent, ids, ctx.num_embeddings, ctx.token_width, ctx.embed_scale,
                                    ctx.padding_idx, ctx.weight_dtype, dropout_seed, ctx.dropout_p, ctx.backend)


def dense_weight_gradient(grad_out, ids, *rest) -> Tensor:
    """The dense weight gradient of a backward pass.  Where a graph is recorded or a transform runs,
    ``WeightGradient.apply``: the gradient with its own derivatives (double backward, jvp, vmap).  In a
    plain eager backward that records nothing (``create_graph=False``), the implementation alone, without
    the Function's apply and its host time."""
    if not torch.is_grad_enabled() and eager_call(ids, grad_out):
        return _direct_weight_gradient(grad_out, ids, *rest)
    return WeightGradient.apply(grad_out, ids, *rest)


# ``add_sinusoidal``: ``y = x_scale * x + pe_scale * PE(position)`` is the embedding op with ``weight = x``
# viewed as [N, D] and ids 0..N-1, so every backend's forward kernel serves it unchanged; its gradient to x
# is ``x_scale * grad_y`` row for row (no sort, no scatter).
def _add_params(x, pe_columns, x_scale, pe_scale, float64_math) -> KernelParams:
    """``add_sinusoidal``'s kernel parameters: the embedding op's, with ``x`` [N, D] as the table."""
    return KernelParams(False, x.shape[1], x.shape[1], PEColumns.from_list(pe_columns), x_scale, pe_scale, -1,
                        float64_math)


def add_sinusoidal_forward(x: Tensor, turns: Tensor, positions: Optional[Tensor], offsets: Optional[Tensor],
                           offset: int, seq_len: int, pe_columns: List[int], x_scale: float, pe_scale: float,
                           float64_math: bool, backend: str) -> Tensor:
    """Flat forward: ``[N, D]`` for ``x`` ``[N, D]`` (the position of row n as for token n of the embedding op)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor [N, D], got shape {list(x.shape)}, strides {list(x.stride())}")
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int64)
    check_op_inputs(rows, x, turns, positions, offsets, seq_len, False, x.shape[1], pe_columns, None)
    params = _add_params(x, pe_columns, x_scale, pe_scale, float64_math)
    return get_backend(backend).forward(rows, x, turns, positions, offsets, offset, seq_len, params, None)


add_sinusoidal_op = torch.library.custom_op("posenc_fast::add_sinusoidal", mutates_args=())(add_sinusoidal_forward)


@add_sinusoidal_op.register_fake
def _(x, turns, positions, offsets, offset, seq_len, pe_columns, x_scale, pe_scale, float64_math, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_setup_context(ctx, inputs, output):
    ctx.x_scale = inputs[7]
    ctx.num_inputs = len(inputs)


def _add_backward(ctx, grad_out):
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = grad_out if ctx.x_scale == 1.0 else grad_out * ctx.x_scale
    return (grad_x,) + (None,) * (ctx.num_inputs - 1)


add_sinusoidal_op.register_autograd(_add_backward, setup_context=_add_setup_context)


class AddSinusoidalFunction(_DirectApply, torch.autograd.Function):
    """``add_sinusoidal``'s op without the custom-op wrapper, for eager training, forward-mode AD and
    torch.func (as ``EmbeddingFunction``): linear in ``x``, so the tangent and the gradient are both
    ``x_scale`` times the incoming one."""

    @staticmethod
    def forward(x, turns, positions, offsets, offset, seq_len, pe_columns, x_scale, pe_scale, float64_math, backend):
        run = add_sinusoidal_forward if plain(x) and plain(positions) and plain(offsets) else add_sinusoidal_op
        return run(x, turns, positions, offsets, offset, seq_len, pe_columns, x_scale, pe_scale, float64_math,
                   backend)

    setup_context = staticmethod(_add_setup_context)
    backward = staticmethod(_add_backward)

    @staticmethod
    def jvp(ctx, x_tangent, *_input_tangents):
        return None if x_tangent is None else x_tangent * ctx.x_scale


# --- The layer in standard torch ops -------------------------------------------------------------------
# Where a graph is captured for another runtime, the public functions emit this definition instead of the
# fused op (_dispatch.route): torch.onnx.export(dynamo=True), which translates standard ops only,
# jit.trace (TorchScript, and its ONNX exporter), and torch.export of a patched Hugging Face model (a program
# that runs without posenc_fast).  It is the torch backend's float64 math on flat inputs: a gather, the exact
# fixed-point phase as a wrapping int64 multiply, float64 sin/cos, one rounding.  Lengths and offsets stay
# symbolic; the id range check runs on the host and is not captured.  ``padding_idx`` (-1: none) gets no
# gradient, as in the ops' backward.
def standard_ops_forward(ids, weight, turns, positions, offsets, offset, seq_len, params: KernelParams,
                         dropout_seed, padding_idx: int = -1) -> Tensor:
    if dropout_seed is not None:
        raise ValueError("posenc_fast's fused dropout has no standard-ops form (ONNX, jit.trace, a patched model "
                         "under torch.export): capture the model in eval mode (model.eval(), or training=False)")
    if positions is None and ids.shape[0]:
        # Positions as ranges, not ``n % seq_len + offset``: the exporter's translation of a remainder or a
        # sum with a symbolic scalar fails, and a range with symbolic ends is ONNX's Range.
        if offsets is not None:
            within = torch.arange(seq_len, device=ids.device, dtype=torch.int64)
            positions = (offsets.unsqueeze(-1) + within).reshape(-1)
        else:
            positions = torch.arange(offset, offset + seq_len, device=ids.device, dtype=torch.int64).repeat(
                ids.shape[0] // seq_len)
    # One padding id: the layer's, whose row gets no gradient and, where pe_zero_id names it, no PE.
    padding = padding_idx if padding_idx >= 0 else params.pe_zero_id
    return reference.embed_flat(
        ids, weight, positions, turns, concat=params.concat, pe_width=params.pe_width, columns=params.columns,
        embed_scale=params.embed_scale, pe_scale=params.pe_scale, padding_idx=padding if padding >= 0 else None,
        zero_pe_at_padding=params.pe_zero_id >= 0)


def add_sinusoidal_standard_ops(x, turns, positions, offsets, offset, seq_len, pe_columns, x_scale, pe_scale,
                                float64_math, backend) -> Tensor:
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int64)
    params = _add_params(x, pe_columns, x_scale, pe_scale, float64_math)
    return standard_ops_forward(rows, x, turns, positions, offsets, offset, seq_len, params, None)
