"""Input validation and normalisation, shared by the reference and every backend.

Everything here runs before any kernel and raises a Python exception that names
the offending value.  It only reads tensor metadata (shape, dtype, device), so it
is free under ``torch.compile``; the one data-dependent check (ids in range)
lives in :func:`check_id_range`, called from inside the op at run time.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from ._spec import (LAYOUTS, MAX_ROW_WIDTH, MAX_SCALE, MODES, PRECISIONS, PEColumns, PESpec, default_frequencies,
                    host_cache, is_finite_number)

ID_DTYPES = (torch.int32, torch.int64)  # the id dtypes every kernel reads (and the checks accept)
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_INT64_MIN, _INT64_END = -(1 << 63), 1 << 63


class Batch(NamedTuple):
    """Per-call inputs flattened for the kernels (a NamedTuple: built on every call, cheaply).

    The position of flat token ``n`` is ``positions[n]`` when ``positions`` is
    given, else ``offsets[n // seq_len] + n % seq_len`` when ``offsets`` is given,
    else ``offset + n % seq_len``.
    """

    ids: torch.Tensor  # 1-D, contiguous, int32 or int64
    out_shape: Tuple[int, ...]  # ids.shape + (width,)
    seq_len: int
    offset: int
    offsets: Optional[torch.Tensor]  # 1-D int64, one per sequence
    positions: Optional[torch.Tensor]  # 1-D int64, one per token

    def token_positions(self) -> torch.Tensor:
        """Materialised int64 positions, one per token (reference and tests only)."""
        if self.positions is not None:
            return self.positions
        n = torch.arange(self.ids.numel(), device=self.ids.device, dtype=torch.int64)
        within = n % max(self.seq_len, 1)
        if self.offsets is not None:  # (token n's sequence: a direct op call's last one may be short)
            return self.offsets[n // max(self.seq_len, 1)] + within
        return within + self.offset


def _check_scale(name: str, value) -> float:
    """``value`` (finite: ``make_spec``) within what the kernels can multiply by."""
    # The kernels multiply in fp32: a larger scale would round to inf there (and inf * 0 = NaN
    # where the float64 definition gives 0), so every backend refuses it alike.
    if abs(value) > MAX_SCALE:
        raise ValueError(f"{name}={value!r} is beyond the float32 range; |{name}| must be <= {MAX_SCALE!r}")
    return float(value)


def check_dropout_p(p) -> float:
    if type(p) is float and 0.0 <= p <= 1.0:  # the common case, first: this runs on every call
        return p
    # Comparisons only (NaN fails both): under torch.compile(dynamic=True) p may be a symbolic float.
    if isinstance(p, bool) or not isinstance(p, (numbers.Real, torch.SymFloat)) or not (0.0 <= p and p <= 1.0):
        raise ValueError(f"dropout probability has to be a number in [0, 1], got {p!r}")
    return float(p)


def _frequency_values(frequencies) -> Tuple[float, ...]:
    """Explicit frequencies as a tuple of Python floats, or a TypeError/ValueError naming them."""
    if isinstance(frequencies, (str, bytes)):  # a string is a sequence of characters, not of numbers
        raise TypeError(f"frequencies must be a sequence of numbers, got {frequencies!r}")
    if isinstance(frequencies, torch.Tensor):
        if frequencies.is_meta:
            raise ValueError("frequencies are a tensor on the meta device, which holds no values; pass them "
                             "as numbers or as a tensor on a real device")
        if frequencies.is_complex() or frequencies.dtype == torch.bool:
            raise TypeError(f"frequencies must be real numbers, got a tensor of dtype {frequencies.dtype}")
        frequencies = frequencies.detach().cpu().double().reshape(-1).tolist()
    try:
        values = tuple(frequencies)
    except TypeError:
        raise TypeError(f"frequencies must be a sequence of numbers, got {frequencies!r}") from None
    for w in values:
        if isinstance(w, (bool, str, bytes, complex)) or (isinstance(w, torch.Tensor) and w.numel() != 1):
            raise TypeError(f"frequencies must be a sequence of real numbers, got element {w!r}")
    try:
        return tuple(float(w) for w in values)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise TypeError(f"frequencies must be a sequence of real numbers, got {frequencies!r}") from None


def make_spec(num_embeddings: int, token_width: int, mode: str, d_pos: Optional[int], base: float, layout: str,
              embed_scale: float, pe_scale: float, padding_idx: Optional[int],
              frequencies: Optional[Sequence[float]] = None, zero_pe_at_padding: bool = False,
              precision: str = "float32", only_cached: bool = False,
              scale_name: str = "embed_scale") -> Optional[PESpec]:
    """Validate the layer's fixed parameters and build its :class:`PESpec`.

    ``frequencies`` (radians per position) replaces the ``base`` recipe: h = D // 2 of
    them, or h + 1 for an odd D whose last column is then the sin of the extra one.
    ``precision="float64"`` computes the PE and the sum in float64 before rounding once.
    Specs are cached per argument tuple: a repeated call returns the same object (whose
    device tensors are cached in turn).  ``only_cached=True`` returns that cached spec, or None
    without checking or raising anything (the caller checks its other arguments first, then
    calls again).  ``scale_name``: what the caller calls ``embed_scale`` (``add_sinusoidal``: ``x_scale``).
    """
    validated_key = None
    if torch.compiler.is_compiling():
        pass
    elif torch._C._is_tracing():  # (Dynamo cannot trace _is_tracing: asked only outside it)
        # jit.trace gives sizes as traced 0-dim tensors, but the table's (or x's) shape is a constant of a
        # traced layer: taken as ints (and tensor frequencies as floats), the frequencies are computed in
        # float64 as always and the spec cache never keys on a tensor.  The TracerWarnings are silenced, as
        # on the general path (functional._quiet_under_jit_trace): they are noise to whoever traces a model.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            num_embeddings, token_width = (int(size) if isinstance(size, torch.Tensor) else size
                                           for size in (num_embeddings, token_width))
            if frequencies is not None:
                frequencies = _frequency_values(frequencies)
    elif frequencies is None:
        # A repeated call (the functional entry points build their spec on every call) skips the checks
        # below.  The key adds the types (True, 1 and 1.0 are equal keys but not equally valid) and a zero
        # scale's sign (-0.0 == 0.0, but they are different scales).
        validated_key = (num_embeddings, token_width, mode, d_pos, base, layout, embed_scale, pe_scale, padding_idx,
                         zero_pe_at_padding, precision, type(num_embeddings), type(token_width), type(d_pos),
                         type(base), type(embed_scale), type(pe_scale), type(padding_idx), type(zero_pe_at_padding),
                         isinstance(embed_scale, float) and embed_scale == 0 and _sign(embed_scale),
                         isinstance(pe_scale, float) and pe_scale == 0 and _sign(pe_scale))
        try:
            spec = _VALIDATED_SPECS.get(validated_key)
        except TypeError:  # an unhashable argument: the checks below name it
            validated_key = spec = None
        if spec is not None or only_cached:
            return spec
    if only_cached:
        return None
    for name, value, allowed in (("mode", mode, MODES), ("layout", layout, LAYOUTS)):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"unknown {name} {value!r}; expected one of {allowed}")
    for name, value in (("base", base), (scale_name, embed_scale), ("pe_scale", pe_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        if not is_finite_number(value):  # before float(): a huge int would raise OverflowError there
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    for name, value in (("d_pos", d_pos), ("padding_idx", padding_idx)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {value!r}")
    if frequencies is not None:
        frequencies = _frequency_values(frequencies)
    if not isinstance(zero_pe_at_padding, bool):
        raise TypeError(f"zero_pe_at_padding must be a bool, got {zero_pe_at_padding!r}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    embed_scale, pe_scale = _check_scale(scale_name, embed_scale), _check_scale("pe_scale", pe_scale)
    spec = _make_spec_cached(
        num_embeddings, token_width, mode, d_pos, float(base), layout, embed_scale, pe_scale,
        padding_idx, frequencies, zero_pe_at_padding, precision, (_sign(embed_scale), _sign(pe_scale)),
    )
    if validated_key is not None:
        if len(_VALIDATED_SPECS) >= _VALIDATED_SPECS_KEPT:
            _VALIDATED_SPECS.clear()
        _VALIDATED_SPECS[validated_key] = spec
    return spec


_VALIDATED_SPECS: dict = {}  # make_spec's arguments (with types) -> the spec they gave
_VALIDATED_SPECS_KEPT = 512


def _sign(value) -> float:
    return math.copysign(1.0, value)


@host_cache
def _make_spec_cached(num_embeddings, token_width, mode, d_pos, base, layout, embed_scale, pe_scale, padding_idx,
                      frequencies, zero_pe_at_padding, precision, scale_signs):
    """``scale_signs``: the scales' signs, for the cache key only (-0.0 == 0.0, with one hash)."""
    if base <= 0:  # (finite: make_spec)
        raise ValueError(f"base must be a finite number > 0, got {base!r}")
    if mode == "add":
        if d_pos is not None:
            raise ValueError(f"d_pos={d_pos!r} is only meaningful for mode='concat'; with mode='add' the PE has the table's width")
        if token_width < 1:
            raise ValueError(f"weight must have at least one column for mode='add', got shape [{num_embeddings}, {token_width}]")
        pe_width = token_width
    else:
        if d_pos is None:
            raise ValueError("mode='concat' needs d_pos, the number of PE columns appended to the token vector")
        d_model = token_width + d_pos
        if d_pos < 1 or d_pos >= d_model or token_width < 1:
            raise ValueError(
                f"d_pos={d_pos} must satisfy 1 <= d_pos < d_model (d_model={d_model}, "
                f"token width {token_width})"
            )
        pe_width = d_pos
    width = token_width + pe_width if mode == "concat" else token_width
    if width > MAX_ROW_WIDTH:
        raise ValueError(f"the output row width {width} (d_model) exceeds the supported maximum of {MAX_ROW_WIDTH} "
                         "columns (the kernels' launch grids)")
    if padding_idx is not None:
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx={padding_idx} is out of range for {num_embeddings} embeddings")
        padding_idx %= num_embeddings
    if zero_pe_at_padding and padding_idx is None:
        raise ValueError("zero_pe_at_padding=True needs a padding_idx")
    half = pe_width // 2
    if frequencies is None:
        try:
            frequencies = default_frequencies(pe_width, float(base))
        except OverflowError:  # base ** (-2 i / D) beyond float64 for a base close to 0
            raise ValueError(f"base={base!r} is too small: its frequencies base ** (-2 i / D) overflow "
                             "float64") from None
    else:
        allowed = (half, half + 1) if pe_width % 2 else (half,)
        # (== rather than `in`: Dynamo evaluates `n in (SymInt,)` as False, with dynamic=True)
        if not any(len(frequencies) == n for n in allowed):
            raise ValueError(
                f"got {len(frequencies)} frequencies for a PE of width {pe_width}; expected "
                + " or ".join(str(n) for n in allowed) + " (one per (sin, cos) pair; an odd width may add one "
                "for a final sin column)"
            )
        bad = [w for w in frequencies if not math.isfinite(w)]
        if bad:
            raise ValueError(f"frequencies must be finite, got {bad[0]!r}")
    return PESpec(mode=mode, token_width=token_width, pe_width=pe_width, layout=layout, frequencies=frequencies,
                  embed_scale=embed_scale, pe_scale=pe_scale, padding_idx=padding_idx,
                  zero_pe_at_padding=zero_pe_at_padding, precision=precision)


def _memory_backed(t: torch.Tensor) -> bool:
    """Whether the kernels may read ``t``'s memory as it is: not a lazily negated view (``is_neg()``,
    e.g. ``z.conj().imag``, would be read unnegated) nor a zero tensor (no memory at all).  Not asked
    while torch.compile traces (it cannot trace these queries); the op asks at run time."""
    return torch.compiler.is_compiling() or not (t.is_neg() or t._is_zerotensor())


def _check_memory_backed(name: str, t: torch.Tensor) -> None:
    if _memory_backed(t):
        return
    if t.is_neg():
        raise ValueError(f"{name} is a lazily negated view ({name}.is_neg(), e.g. z.conj().imag); pass "
                         f"{name}.resolve_neg()")
    if t._is_zerotensor():
        raise ValueError(f"{name} is a zero tensor without memory (torch._efficientzerotensor); pass a "
                         f"materialised tensor ({name}.clone())")


def refuse_nested(name: str, t, shape_hint: str = "") -> None:
    """A nested tensor (torch.nested) has no sizes of its own: reading its shape raises torch's internal error,
    so it is named first, wherever ``name`` may be one."""
    if isinstance(t, torch.Tensor) and t.is_nested:
        raise TypeError(f"{name} must be a dense tensor{shape_hint}, got a nested tensor (torch.nested)")


def check_weight(weight) -> None:
    check_float_rows("weight", weight, " [num_embeddings, width]")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [num_embeddings, width], got shape {list(weight.shape)}")


def check_float_rows(name: str, t, shape_hint: str) -> None:
    """``t`` is memory the kernels may read as rows of floats: a floating-point, dense (strided) tensor that
    is not nested, lazily negated or a zero tensor (the table, or ``add_sinusoidal``'s ``x``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    refuse_nested(name, t, shape_hint)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    _check_memory_backed(name, t)


def check_add_input(x) -> None:
    """``add_sinusoidal``'s ``x``: float rows ``[..., D]`` (checked before its shape is read)."""
    check_float_rows("x", x, " [..., D]")
    if x.dim() < 1:
        raise ValueError("x must be a tensor [..., D], got a 0-d tensor")


def check_weight_for_spec(weight, spec: PESpec) -> None:
    """``weight`` is a table the layer ``spec`` was built for (a module's weight may have been replaced)."""
    if isinstance(weight, torch.Tensor) and not weight.is_nested:  # (a nested tensor's shape raises)
        shape = weight.shape
        if len(shape) == 2 and shape[1] == spec.token_width and weight.is_floating_point() and (
                spec.padding_idx is None or spec.padding_idx < shape[0]) and weight.layout == torch.strided and (
                _memory_backed(weight)):
            return  # the common case, first: this runs on every call
    check_weight(weight)
    if weight.shape[1] != spec.token_width:
        raise ValueError(f"weight has shape {list(weight.shape)}, but the layer was built for a table of "
                         f"{spec.token_width} columns; build a new layer for another width")
    if spec.padding_idx is not None and spec.padding_idx >= weight.shape[0]:
        raise ValueError(f"weight has {weight.shape[0]} rows, too few for the layer's padding_idx={spec.padding_idx}")


def _check_integer_tensor(name: str, value: torch.Tensor, device: torch.device) -> None:
    refuse_nested(name, value)
    if value.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the tokens (ids, or add_sinusoidal's x) are on {device}")


def _int64_offset(offset: int) -> bool:
    """Whether an int offset fits in int64.  Under torch.export a traced past length is an int to a strict
    trace: comparing it would add a guard that an unbounded ``Dim`` violates, so any int is taken as it is
    (the graph's int64: a constant beyond it wraps)."""
    return torch.compiler.is_exporting() or _INT64_MIN <= offset < _INT64_END


def check_offset(offset, ids: torch.Tensor, name: str = "offset") -> None:
    """``offset`` is an int in int64 range (any int under torch.export: ``_int64_offset``), or an integer
    tensor, 0-d or of shape ``ids.shape[:-1]``.
    A ``torch.SymInt`` (a traced past length, e.g. ``past.shape[1]`` under torch.export) is accepted as it is."""
    if isinstance(offset, torch.Tensor):
        _check_integer_tensor(name, offset, ids.device)
        sequences_shape = tuple(ids.shape[:-1]) if ids.dim() > 0 else ()
        if offset.dim() != 0 and tuple(offset.shape) != sequences_shape:
            raise ValueError(
                f"{name} tensor has shape {list(offset.shape)}; expected one start position per sequence, shape "
                f"{list(sequences_shape)} (ids.shape[:-1], or add_sinusoidal's x.shape[:-2]), or a 0-d tensor"
            )
    elif isinstance(offset, torch.SymInt):
        return  # symbolic (torch.export, dynamic torch.compile): an int64 value of the graph; no check may guard on it
    elif isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"{name} must be an int or an integer tensor, got {offset!r}")
    elif not _int64_offset(offset):
        raise ValueError(f"{name}={offset} does not fit in int64")


def make_batch(ids, weight: torch.Tensor, spec: PESpec, positions, offset) -> Batch:
    """Validate the per-call inputs and flatten them for the kernels."""
    if (positions is None and type(offset) is int and type(ids) is torch.Tensor and ids.dtype in ID_DTYPES
            and ids.layout == torch.strided and not ids.is_nested and ids.device == weight.device
            and _int64_offset(offset) and _memory_backed(ids)):
        # The common call (a decoding step: ids and an int offset): the same checks as below, in fewer steps.
        shape = ids.shape
        flat_ids = ids if len(shape) == 1 else ids.reshape(-1)  # (reshape would make a view even of 1-D ids)
        if not flat_ids.is_contiguous():
            flat_ids = flat_ids.contiguous()
        return Batch(flat_ids, (*shape, spec.width), shape[-1] if shape else 1, offset, None, None)
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"ids must be int32 or int64, got dtype {ids.dtype}")
    if ids.layout != torch.strided:
        raise TypeError(f"ids must be a dense (strided) tensor, got layout {ids.layout}")
    refuse_nested("ids", ids)
    if ids.device != weight.device:
        raise ValueError(f"ids are on {ids.device} but weight is on {weight.device}; move them to one device")
    _check_memory_backed("ids", ids)
    seq_len = ids.shape[-1] if ids.dim() > 0 else 1  # an int, or a SymInt under torch.export: kept as it is
    sequences_shape = tuple(ids.shape[:-1]) if ids.dim() > 0 else ()
    flat_ids = ids.reshape(-1)
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    out_shape = tuple(ids.shape) + (spec.width,)

    offsets = None
    scalar_offset = 0
    if type(offset) is int and _int64_offset(offset):
        scalar_offset = offset
    else:
        check_offset(offset, ids)
        if isinstance(offset, torch.Tensor):
            offsets = offset.to(torch.int64).expand(sequences_shape).reshape(-1).contiguous()
        else:  # kept symbolic when traced (torch.export with a dynamic past length): int() would specialise it
            scalar_offset = offset if isinstance(offset, torch.SymInt) else int(offset)

    flat_positions = None
    if positions is not None:
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be an integer tensor or None, got {type(positions).__name__}")
        _check_integer_tensor("positions", positions, ids.device)
        if offsets is not None or scalar_offset != 0:
            raise ValueError(
                f"positions and a nonzero offset were both given (offset={offset!r}); "
                "explicit positions already say where each token is"
            )
        try:
            broadcast = torch.broadcast_shapes(tuple(positions.shape), tuple(ids.shape))
        except RuntimeError:
            broadcast = None
        if broadcast != tuple(ids.shape):
            raise ValueError(
                f"positions of shape {list(positions.shape)} do not broadcast to the tokens' shape {list(ids.shape)} "
                "(ids.shape, or add_sinusoidal's x.shape[:-1])"
            )
        flat_positions = positions.to(torch.int64).expand(ids.shape).reshape(-1).contiguous()
        offsets = None

    return Batch(flat_ids, out_shape, seq_len, scalar_offset, offsets, flat_positions)


def check_id_range(ids: torch.Tensor, num_embeddings: int, vocab_start: int = 0, bounds=None) -> None:
    """Raise IndexError naming the first out-of-range id: a host sync on a GPU, so skipped while a CUDA graph
    is captured (and by the caller when the check is off, ``config.id_check``).

    ``ids`` may be shifted by ``vocab_start`` (a vocabulary-parallel shard's local ids): the
    check and the message are about the global id ``ids + vocab_start`` in ``[0, num_embeddings)``.
    ``bounds``: the ids' (smallest, largest) where the caller has them (a prepared launch's scan on CPU),
    else None: ``torch.aminmax`` finds them.
    """
    if ids.numel() == 0 or ids.is_meta or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return  # (a meta tensor has no values to check)
    if bounds is None:
        low, high = torch.aminmax(ids)
        bounds = int(low), int(high)
    if bounds[0] < -vocab_start or bounds[1] >= num_embeddings - vocab_start:  # (local ids: no wrap in range)
        # Local ids are global ids minus vocab_start in int64, which wraps for a global id within
        # vocab_start of -2**63; wrapping back recovers the global id to name it.
        for bad in ((v + vocab_start - _INT64_MIN) % (1 << 64) + _INT64_MIN for v in bounds):
            if not 0 <= bad < num_embeddings:
                valid = f"valid: 0..{num_embeddings - 1}" if num_embeddings else "the table has no rows"
                raise IndexError(f"id {bad} is out of range for an embedding table of {num_embeddings} rows ({valid})")


def id_value_fits(ids: torch.Tensor, value: int) -> bool:
    """Whether ``value`` lies within the ids' dtype, so that an id can equal it.  Compared outside it, an
    int32 tensor would wrap the value (2^32 + 7 onto 7): a padding_idx past the dtype matches no id."""
    info = torch.iinfo(ids.dtype)
    return info.min <= value <= info.max


def check_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> None:
    """Raise ValueError unless ``cu_seqlens`` starts at 0, never decreases and ends at ``total_tokens``
    (one device-to-host copy on GPU; skipped by the caller when the id check is off)."""
    if cu_seqlens.is_meta:
        return
    starts = cu_seqlens.to(torch.int64)
    steps = starts[1:] - starts[:-1]
    first, last, smallest_step = (int(v) for v in torch.stack([starts[0], starts[-1], steps.min()]).tolist())
    if first == 0 and last == total_tokens and smallest_step >= 0:
        return
    shown = starts[:12].tolist()
    text = str(shown) if starts.numel() <= 12 else str(shown)[:-1] + ", ...]"
    if first != 0:
        why = f"it starts at {first}, not 0"
    elif smallest_step < 0:
        k = int(torch.nonzero(steps < 0)[0, 0])
        why = f"it decreases from {int(starts[k])} to {int(starts[k + 1])} at index {k + 1}"
    else:
        why = f"it ends at {last}, but ids have {total_tokens} tokens along their last axis"
    raise ValueError(f"cu_seqlens={text} must hold the cumulative lengths [0, l0, l0 + l1, ..., total] of the "
                     f"packed sequences: {why}")


_VALID_COLUMNS = {}  # (pe_width, number of frequencies) -> the column lists of every layout


def _valid_columns(pe_width: int, num_turns: int):
    """The ``PEColumns.as_list()`` of every layout for a PE of width ``pe_width`` with ``num_turns`` frequencies."""
    key = (pe_width, num_turns)
    valid = _VALID_COLUMNS.get(key)
    if valid is None:
        tail_is_sin = num_turns > pe_width // 2
        valid = _VALID_COLUMNS[key] = [PEColumns.of(layout, pe_width, tail_is_sin).as_list() for layout in LAYOUTS]
    return valid


def _check_index_vector(name: str, value: torch.Tensor, numel: int, device: torch.device) -> None:
    if value.dtype != torch.int64 or value.dim() != 1 or value.shape[0] != numel or not value.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D int64 tensor of {numel} elements, got dtype {value.dtype}, "
                         f"shape {list(value.shape)}, strides {list(value.stride())}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but weight is on {device}")


def check_op_inputs(ids, weight, turns, positions, offsets, seq_len: int, concat: bool, pe_width: int,
                    pe_columns, dropout_seed) -> None:
    """What every backend's forward kernel assumes of the op's arguments: each bound a kernel uses
    follows from the tensors given.  The public API always passes consistent arguments; a direct call
    of the torch.library op may not.  Reads metadata only."""
    device = weight.device
    if ids.dim() != 1 or ids.dtype not in ID_DTYPES or ids.device != device or not ids.is_contiguous():
        raise ValueError(f"ids must be a contiguous 1-D int32 or int64 tensor on {device}, got dtype {ids.dtype}, "
                         f"shape {list(ids.shape)}, strides {list(ids.stride())} on {ids.device}")
    _check_memory_backed("ids", ids)
    _check_memory_backed("weight", weight)
    weight_shape = weight.shape
    if len(weight_shape) != 2:
        raise ValueError(f"weight must be 2-D [num_embeddings, width], got shape {list(weight_shape)}")
    token_width = weight_shape[1]
    if (pe_width != token_width and not concat) or pe_width < 1 or token_width + pe_width > 2 * MAX_ROW_WIDTH or (
            concat and token_width + pe_width > MAX_ROW_WIDTH):
        raise ValueError(f"pe_width={pe_width} does not fit a weight of shape {list(weight_shape)} in "
                         f"{'concat' if concat else 'add'} mode (add: pe_width == weight.shape[1]; "
                         f"rows of at most {MAX_ROW_WIDTH} columns)")
    turns_shape = turns.shape
    num_turns = turns_shape[0] if len(turns_shape) == 1 else -1
    half = pe_width >> 1
    if (turns.dtype != torch.int64 or not half <= num_turns <= pe_width - half or turns.device != device
            or not turns.is_contiguous()):
        raise ValueError(f"turns must be a contiguous 1-D int64 tensor of {half} (or, for an odd "
                         f"pe_width, {half + 1}) elements on {device}, got dtype {turns.dtype}, "
                         f"shape {list(turns_shape)} on {turns.device}")
    if pe_columns not in _valid_columns(pe_width, num_turns):
        raise ValueError(f"pe_columns={list(pe_columns)} is not the column layout of any layout for a PE of width "
                         f"{pe_width} with {num_turns} frequencies")
    num_tokens = ids.shape[0]
    # seq_len cuts the tokens into sequences whatever gives the positions: the CPU kernel's position-major
    # path takes a positions tensor by sequence and column too.
    if num_tokens and not 1 <= seq_len <= num_tokens:
        raise ValueError(f"seq_len={seq_len} must be in [1, {num_tokens}] for {num_tokens} tokens")
    if positions is not None:
        _check_index_vector("positions", positions, num_tokens, device)
    elif num_tokens and offsets is not None:
        _check_index_vector("offsets", offsets, -(-num_tokens // seq_len), device)
    if dropout_seed is not None and (dropout_seed.dtype != torch.int64 or dropout_seed.numel() != 1
                                     or dropout_seed.device != device):
        raise ValueError(f"dropout_seed must be an int64 tensor of one element on {device}, got dtype "
                         f"{dropout_seed.dtype}, shape {list(dropout_seed.shape)} on {dropout_seed.device}")
