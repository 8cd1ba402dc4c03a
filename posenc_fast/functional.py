"""The public functions ``sinusoidal_embedding`` and ``add_sinusoidal``, and the general path under them and
the modules (``apply_spec``, ``apply_add_spec``): validate, choose a backend, route the call, restore the shape."""

from __future__ import annotations

import functools
import warnings
from typing import Optional, Sequence, Union

import torch

from ._dispatch import FUNCTION, OP, RUN, STANDARD_OPS, resolve_backend, route as _route
from ._dispatch import eager_call as _eager_call, jit_tracing as _jit_tracing  # (names tests patch here)
from ._dropout import draw_seed
from ._prepared import functional_addition, functional_embedding
from ._spec import PESpec
from ._validate import (check_dropout_p, check_add_input, check_offset, check_weight, check_weight_for_spec,
                        make_batch, make_spec, refuse_nested)
from .ops import (AddSinusoidalFunction, EmbeddingFunction, add_sinusoidal_forward, add_sinusoidal_op,
                  add_sinusoidal_standard_ops, run_forward, sinusoidal_embedding_op, standard_ops_forward)
from .positions import make_positions, packed_positions
from .presets import POSITION_RULES


def _quiet_under_jit_trace(function):
    """Silence jit.trace's TracerWarnings for this call only: every size the layer reads warns, yet those are
    constants of a layer (what varies reaches the output through tensors: ``_refuse_jit_trace``).  It wraps
    the general paths only, so that a prepared launch does not pay for it: before them the public functions
    read nothing that warns, and under jit.trace they skip the prepared launch."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        if not _jit_tracing():
            return function(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return function(*args, **kwargs)
    return call


def sinusoidal_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    mode: str = "add",
    d_pos: Optional[int] = None,
    positions: Optional[torch.Tensor] = None,
    offset: Union[int, torch.Tensor] = 0,
    base: float = 10000.0,
    layout: str = "interleaved",
    embed_scale: float = 1.0,
    pe_scale: float = 1.0,
    padding_idx: Optional[int] = None,
    frequencies: Optional[Sequence[float]] = None,
    zero_pe_at_padding: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    precision: str = "float32",
    dropout_p: float = 0.0,
    training: bool = True,
    sparse: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Token embedding lookup + sinusoidal positional encoding, fused.

    ``y[..., :] = embed_scale * weight[ids] (+) pe_scale * PE(position)``, where (+) is addition
    (``mode="add"``) or concatenation of ``d_pos`` PE columns (``mode="concat"``).  Returns
    ``ids.shape + (width,)`` in ``weight.dtype``.  Only ``weight`` receives a gradient
    (deterministic; zero for ``padding_idx``).

    Positions are ``offset + t`` along the last axis of ``ids`` (``offset``: an int, or one int per
    sequence, shape ``ids.shape[:-1]``), or the explicit integer ``positions`` tensor (broadcastable
    to ``ids.shape``).  ``cu_seqlens`` packs several sequences along the last axis (cumulative
    lengths ``[0, l0, l0 + l1, ...]``): positions restart at 0 at each start.
    ``frequencies`` replaces the ``base`` recipe (radians per position, one per pair).
    ``zero_pe_at_padding`` gives padding tokens no PE (fairseq).  ``precision="float64"`` computes
    the PE and the sum in float64 (fp32 outputs correctly rounded; slower on GPUs with little fp64
    throughput).

    ``dropout_p`` > 0 with ``training`` (as ``F.dropout``) applies dropout to the result in the same
    kernel: each element is zeroed with probability ``dropout_p``, the others scaled by
    ``1 / (1 - dropout_p)``.  The mask is Philox of a seed drawn from torch's generator (so
    ``torch.manual_seed`` reproduces it) and is regenerated in backward, not stored.

    ``sparse=True`` makes the weight's gradient the sparse COO tensor ``nn.Embedding(sparse=True)``
    makes (for ``torch.optim.SparseAdam``, SGD...): one entry per token, uncoalesced, the padding
    row's left out; deterministic, and its cost tracks the tokens, not the vocabulary.  Eager only
    (not under torch.compile/export).

    Presets for other libraries: ``posenc_fast.presets``.  The exact definition:
    ``posenc_fast.reference``.
    """
    # A plain eager call runs a prepared launch (posenc_fast._prepared); other calls take the general path, so
    # that torch.compile and jit.trace trace the op and its checks.  A cached spec means valid arguments, and
    # preparing a launch checks the table; a spec not cached that way (frequencies given) is tried after the
    # checks.
    simple_call = cu_seqlens is None and _eager_call(ids, weight)
    spec = None
    if simple_call and weight.dim() == 2 and not weight.is_nested:
        shape = weight.shape  # (indexed: unpacking a torch.Size costs a decoding step more)
        spec = make_spec(shape[0], shape[1], mode, d_pos, base, layout, embed_scale, pe_scale, padding_idx,
                         frequencies, zero_pe_at_padding, precision, only_cached=True)
    if spec is None:
        check_weight(weight)  # (before its shape is read)
        spec = make_spec(*weight.shape, mode, d_pos, base, layout, embed_scale, pe_scale, padding_idx, frequencies,
                         zero_pe_at_padding, precision)
    if simple_call:
        out = functional_embedding(spec, backend, dropout_p, training, sparse, weight, ids, offset, positions)
        if out is not None:
            return out
    return apply_spec(ids, weight, spec, spec.turns_tensor(weight.device), positions, offset, backend,
                      cu_seqlens=cu_seqlens, dropout_p=dropout_p, training=training, sparse=sparse)


def _positions_by_rule(ids, spec: PESpec, positions, offset, cu_seqlens, position_rule: str):
    """Turn cu_seqlens or a position rule into explicit positions (on the device, no host sync)."""
    if position_rule not in POSITION_RULES:  # a module attribute may have been changed after construction
        raise ValueError(f"unknown position_rule {position_rule!r}; expected one of {POSITION_RULES}")
    if cu_seqlens is not None:
        if positions is not None or isinstance(offset, torch.Tensor) or offset != 0:
            raise ValueError("cu_seqlens already gives the positions; do not also pass positions or a nonzero offset")
        if position_rule != "offset":
            raise ValueError(f"cu_seqlens cannot be combined with the {position_rule!r} position rule")
        if isinstance(cu_seqlens, torch.Tensor) and isinstance(ids, torch.Tensor) and cu_seqlens.device != ids.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but ids are on {ids.device}")
        length = ids.shape[-1] if isinstance(ids, torch.Tensor) and ids.dim() else 1
        return packed_positions(cu_seqlens, length), 0
    if position_rule in ("fairseq", "fsmt") and positions is None and isinstance(ids, torch.Tensor):
        if position_rule == "fsmt" and isinstance(offset, torch.Tensor):
            raise ValueError("position_rule='fsmt' takes the past length as an int (as FSMT passes it): whether "
                             "padding has a PE depends on it")
        check_offset(offset, ids)  # make_positions would name it past_length
        return make_positions(ids, spec.padding_idx, past_length=offset, shift_padding=position_rule == "fsmt"), 0
    return positions, offset


def _refuse_jit_trace(positions, offset, cu_seqlens) -> None:
    """Under jit.trace, refuse a call whose positions derive from its length, an offset or ``cu_seqlens``,
    which the tracer would bake in as constants.  Explicit ``positions`` (patch_model's position modules pass
    them) take the standard-ops form, which reads only tensors and sizes: right at every shape.  Runs before the
    call's validation."""
    if not _jit_tracing():
        return
    if isinstance(positions, torch.Tensor) and cu_seqlens is None and isinstance(offset, int) and offset == 0:
        return
    raise RuntimeError(
        "posenc_fast supports torch.jit.trace (and torch.onnx.export's TorchScript exporter, which traces) only "
        "for calls with explicit positions (and no offset or cu_seqlens): a trace would bake in this call's "
        "sequence length or offset. Pass positions=..., or use torch.export.export, or "
        "torch.onnx.export(..., dynamo=True), which keep the lengths symbolic")


@_quiet_under_jit_trace
def apply_spec(ids, weight, spec: PESpec, turns: torch.Tensor, positions, offset, backend: str, *,
               cu_seqlens=None, position_rule: str = "offset", vocab_range=None,
               dropout_p: float = 0.0, training: bool = True, sparse: bool = False,
               standard_ops_under_export: bool = False) -> torch.Tensor:
    """Run the layer described by ``spec`` (``turns``: its fixed-point frequencies on weight's device).

    ``vocab_range=(start, vocabulary size)``: ``weight`` holds rows start.. of a larger vocabulary (vocabulary
    parallel, see SinusoidalEmbedding); ids are global, and checked against the vocabulary size.
    ``dropout_p`` is checked on every call (as ``F.dropout`` does, so a module attribute set
    later is checked too) and applies when ``training``; otherwise no seed is drawn.
    ``sparse``: the weight's gradient as a sparse tensor (``ops.sparse_weight_gradient``).
    ``standard_ops_under_export``: under torch.export, the definition in standard ops instead of the fused
    op (patch_model's position modules: an exported model then runs without posenc_fast).
    """
    _refuse_jit_trace(positions, offset, cu_seqlens)
    refuse_nested("ids", ids)  # (before a position rule or cu_seqlens reads its shape)
    for name, value in (("sparse", sparse), ("training", training)):
        if value is not False and value is not True:  # (as F.dropout's training: a bool, nothing else)
            raise TypeError(f"{name} must be a bool, got {value!r}")
    dropout_p = check_dropout_p(dropout_p)
    if not training:
        dropout_p = 0.0
    check_weight_for_spec(weight, spec)  # a module's weight may have been replaced since it was built
    zero_pe_at_padding = spec.zero_pe_at_padding
    if position_rule != "offset" or cu_seqlens is not None:  # (the common call has nothing to rewrite)
        if (position_rule == "fsmt" and positions is None and isinstance(offset, torch.SymInt)
                and torch.compiler.is_exporting()):
            # Padding tokens get a PE only when the past length is not 0: a Python branch, which torch.compile
            # guards but torch.export would take as the example's for every past length, 0 included.
            raise ValueError("position_rule='fsmt' cannot take a symbolic past length under torch.export: whether "
                             "padding tokens get a PE depends on whether it is 0; export with an int past length "
                             "(static), or use position_rule='fairseq'")
        if position_rule == "fsmt" and positions is None and isinstance(offset, int) and offset != 0:
            zero_pe_at_padding = False  # padding is at padding_idx + past: it has a PE (see make_positions)
        positions, offset = _positions_by_rule(ids, spec, positions, offset, cu_seqlens, position_rule)
    vocab_start, vocab_size = 0, weight.shape[0]
    if vocab_range is not None:
        vocab_start, vocab_size = vocab_range
        if isinstance(ids, torch.Tensor) and ids.dtype in (torch.int32, torch.int64) and vocab_start:
            # Local rows; other shards' ids fall outside and read nothing.  In int64: an int32 id near
            # -2**31 would wrap into the positive range.
            ids = ids.to(torch.int64) - vocab_start
    batch = make_batch(ids, weight, spec, positions, offset)
    name = resolve_backend(backend, weight.device, weight.dtype, float64_math=spec.precision == "float64")
    dropout_seed = draw_seed(weight.device) if dropout_p > 0.0 else None
    route = _route(batch.ids, weight, standard_ops_under_export)
    if sparse and route in (OP, STANDARD_OPS) and torch.is_grad_enabled() and weight.requires_grad:
        raise NotImplementedError("sparse=True gradients are computed on plain eager calls only, not under "
                                  "torch.compile, torch.export, jit.trace, a TorchDispatchMode (e.g. FlopCounterMode, "
                                  "selective activation checkpointing) or with tensor subclasses; there use "
                                  "sparse=False (a dense, equally deterministic gradient)")
    padding_idx = -1 if spec.padding_idx is None else spec.padding_idx
    if route is STANDARD_OPS:
        out = standard_ops_forward(batch.ids, weight, turns, batch.positions, batch.offsets, batch.offset,
                                   batch.seq_len, spec.kernel_params(zero_pe_at_padding), dropout_seed, padding_idx)
    elif route is not OP:
        params = spec.kernel_params(zero_pe_at_padding)
        if route is FUNCTION:
            out = EmbeddingFunction.apply(weight, batch.ids, turns, batch.positions, batch.offsets, batch.offset,
                                          batch.seq_len, params, padding_idx, vocab_start, vocab_size, dropout_seed,
                                          dropout_p, name, sparse)
        else:
            out = run_forward(batch.ids, weight, turns, batch.positions, batch.offsets, batch.offset, batch.seq_len,
                              params, vocab_start, vocab_size, dropout_seed, dropout_p, name)
            if out._base is None and out.is_contiguous():
                # The backend's fresh [N, width] buffer, reshaped in place rather than viewed: like
                # nn.Embedding's output (and the prepared launch's, posenc_fast._prepared) it is then not a
                # view, which under no_grad could not later be modified in place with grad mode on.
                return out.resize_(batch.out_shape)
    else:
        out = sinusoidal_embedding_op(
            batch.ids, weight, turns, batch.positions, batch.offsets, batch.offset, batch.seq_len,
            spec.mode == "concat", spec.pe_width, spec.columns.as_list(), spec.embed_scale, spec.pe_scale, padding_idx,
            zero_pe_at_padding, spec.precision == "float64", vocab_start, vocab_size, dropout_seed, dropout_p, name)
    return out.reshape(batch.out_shape)


def add_sinusoidal(
    x: torch.Tensor,
    *,
    positions: Optional[torch.Tensor] = None,
    offset: Union[int, torch.Tensor] = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
    base: float = 10000.0,
    layout: str = "interleaved",
    frequencies: Optional[Sequence[float]] = None,
    x_scale: float = 1.0,
    pe_scale: float = 1.0,
    precision: str = "float32",
    backend: str = "auto",
) -> torch.Tensor:
    """The PE added to an existing float tensor, fused: ``y = x_scale * x + pe_scale * PE(position)``.

    ``x`` is ``[..., seq_len, D]`` (conv features of a speech encoder, summed codebook embeddings,
    token rows with image vectors substituted); the PE is D wide.  ``positions``, ``offset`` (an int,
    or one per sequence, shape ``x.shape[:-2]``) and ``cu_seqlens`` follow the axis before the last
    exactly as they follow the last axis of ``ids`` in :func:`sinusoidal_embedding`.  Returns
    ``x.shape`` in ``x.dtype``; the gradient to ``x`` is ``x_scale * grad``.  Same kernels as the
    embedding (``x`` plays the table, row n read by token n), so the same accuracy.
    """
    # As sinusoidal_embedding's (the prepared launch checks x's float dtype and memory).
    simple_call = cu_seqlens is None and _eager_call(x, x)
    spec = None
    if simple_call and x.dim() >= 2 and not x.is_nested:
        spec = make_spec(1, x.shape[-1], "add", None, base, layout, x_scale, pe_scale, None, frequencies, False,
                         precision, only_cached=True)
    if spec is None:
        check_add_input(x)  # (before its shape is read)
        spec = make_spec(1, x.shape[-1], "add", None, base, layout, x_scale, pe_scale, None, frequencies, False,
                         precision, scale_name="x_scale")
    if simple_call:
        out = functional_addition(spec, backend, x, offset, positions)
        if out is not None:
            return out
    return apply_add_spec(x, spec, spec.turns_tensor(x.device), positions, offset, cu_seqlens, backend)


@_quiet_under_jit_trace
def apply_add_spec(x, spec: PESpec, turns: torch.Tensor, positions, offset, cu_seqlens, backend: str) -> torch.Tensor:
    """Run :func:`add_sinusoidal` as ``spec`` describes it (``spec.embed_scale`` is ``x_scale``)."""
    _refuse_jit_trace(positions, offset, cu_seqlens)
    check_add_input(x)  # (the module's calls come here first)
    if x.shape[-1] != spec.pe_width:
        raise ValueError(f"x has width {x.shape[-1]} but the PE has width {spec.pe_width}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # the kernels read rows of x as rows of a dense table
    # Row n of x is token n of the embedding op (the op makes its ids 0..N-1); the batch and position
    # checks need only the shape of those ids, so an unfilled tensor stands in for them.
    row_ids = torch.empty(x.shape[:-1], device=x.device, dtype=torch.int64)
    positions, offset = _positions_by_rule(row_ids, spec, positions, offset, cu_seqlens, "offset")
    batch = make_batch(row_ids, rows, spec, positions, offset)
    name = resolve_backend(backend, x.device, x.dtype, float64_math=spec.precision == "float64", tensor="x")
    route = _route(batch.ids, x)
    op = {RUN: add_sinusoidal_forward, FUNCTION: AddSinusoidalFunction.apply, OP: add_sinusoidal_op,
          STANDARD_OPS: add_sinusoidal_standard_ops}[route]
    out = op(rows, turns, batch.positions, batch.offsets, batch.offset, batch.seq_len, spec.columns.as_list(),
             spec.embed_scale, spec.pe_scale, spec.precision == "float64", name)
    return out.reshape(x.shape)
