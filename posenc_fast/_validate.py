"""Input validation and normalisation, shared by the reference and every backend.

Everything here runs before any kernel and raises a Python exception that names
the offending value.  It only reads tensor metadata (shape, dtype, device), so it
is free under ``torch.compile``; the one data-dependent check (ids in range)
lives in :func:`check_id_range`, called from inside the op at run time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

import torch

from ._spec import LAYOUTS, MODES, PRECISIONS, PESpec, default_frequencies, host_cache, is_finite_number

ID_DTYPES = (torch.int32, torch.int64)
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class Batch:
    """Per-call inputs flattened for the kernels.

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
        if self.offsets is not None:
            return self.offsets.repeat_interleave(self.seq_len) + within
        return within + self.offset


def _check_scale(name: str, value) -> float:
    if not is_finite_number(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def make_spec(
    num_embeddings: int,
    token_width: int,
    mode: str,
    d_pos: Optional[int],
    base: float,
    layout: str,
    embed_scale: float,
    pe_scale: float,
    padding_idx: Optional[int],
    frequencies: Optional[Sequence[float]] = None,
    zero_pe_at_padding: bool = False,
    precision: str = "float32",
) -> PESpec:
    """Validate the layer's fixed parameters and build its :class:`PESpec`.

    ``frequencies`` (radians per position) replaces the ``base`` recipe: h = D // 2 of
    them, or h + 1 for an odd D whose last column is then the sin of the extra one.
    ``precision="float64"`` computes the PE and the sum in float64 before rounding once.
    Specs are cached per argument tuple, so a repeated call returns the same object
    (whose device tensors are cached in turn).
    """
    for name, value in (("mode", mode), ("layout", layout)):
        if not isinstance(value, str):
            raise ValueError(f"unknown {name} {value!r}; expected one of {MODES if name == 'mode' else LAYOUTS}")
    for name, value in (("base", base), ("embed_scale", embed_scale), ("pe_scale", pe_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    for name, value in (("d_pos", d_pos), ("padding_idx", padding_idx)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {value!r}")
    if frequencies is not None:
        if isinstance(frequencies, torch.Tensor):
            frequencies = frequencies.detach().cpu().double().reshape(-1).tolist()
        try:
            frequencies = tuple(float(w) for w in frequencies)
        except (TypeError, ValueError):
            raise TypeError(f"frequencies must be a sequence of numbers, got {frequencies!r}") from None
    if not isinstance(zero_pe_at_padding, bool):
        raise TypeError(f"zero_pe_at_padding must be a bool, got {zero_pe_at_padding!r}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    return _make_spec_cached(
        num_embeddings, token_width, mode, d_pos, float(base), layout, float(embed_scale), float(pe_scale),
        padding_idx, frequencies, zero_pe_at_padding, precision,
    )


@host_cache
def _make_spec_cached(num_embeddings, token_width, mode, d_pos, base, layout, embed_scale, pe_scale, padding_idx,
                      frequencies, zero_pe_at_padding, precision):
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if not is_finite_number(base) or base <= 0:
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
    embed_scale = _check_scale("embed_scale", embed_scale)
    pe_scale = _check_scale("pe_scale", pe_scale)
    if padding_idx is not None:
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx={padding_idx} is out of range for {num_embeddings} embeddings")
        padding_idx %= num_embeddings
    if zero_pe_at_padding and padding_idx is None:
        raise ValueError("zero_pe_at_padding=True needs a padding_idx")
    half = pe_width // 2
    if frequencies is None:
        frequencies = default_frequencies(pe_width, float(base))
    else:
        allowed = (half, half + 1) if pe_width % 2 else (half,)
        if len(frequencies) not in allowed:
            raise ValueError(
                f"got {len(frequencies)} frequencies for a PE of width {pe_width}; expected "
                + " or ".join(str(n) for n in allowed) + " (one per (sin, cos) pair; an odd width may add one "
                "for a final sin column)"
            )
        bad = [w for w in frequencies if not math.isfinite(w)]
        if bad:
            raise ValueError(f"frequencies must be finite, got {bad[0]!r}")
    return PESpec(
        mode=mode,
        token_width=token_width,
        pe_width=pe_width,
        layout=layout,
        frequencies=frequencies,
        embed_scale=embed_scale,
        pe_scale=pe_scale,
        padding_idx=padding_idx,
        zero_pe_at_padding=zero_pe_at_padding,
        precision=precision,
    )


def check_weight(weight) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [num_embeddings, width], got shape {list(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got dtype {weight.dtype}")


def _check_integer_tensor(name: str, value: torch.Tensor, device: torch.device) -> None:
    if value.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but ids are on {device}")


def make_batch(ids, weight: torch.Tensor, spec: PESpec, positions, offset) -> Batch:
    """Validate the per-call inputs and flatten them for the kernels."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"ids must be int32 or int64, got dtype {ids.dtype}")
    if ids.device != weight.device:
        raise ValueError(f"ids are on {ids.device} but weight is on {weight.device}; move them to one device")
    seq_len = ids.shape[-1] if ids.dim() > 0 else 1
    sequences_shape = tuple(ids.shape[:-1]) if ids.dim() > 0 else ()
    flat_ids = ids.reshape(-1)
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    out_shape = tuple(ids.shape) + (spec.width,)

    offsets = None
    scalar_offset = 0
    if isinstance(offset, torch.Tensor):
        _check_integer_tensor("offset", offset, ids.device)
        if offset.dim() != 0 and tuple(offset.shape) != sequences_shape:
            raise ValueError(
                f"offset tensor has shape {list(offset.shape)}; expected ids.shape[:-1] = "
                f"{list(sequences_shape)} (one start position per sequence) or a 0-d tensor"
            )
        offsets = offset.to(torch.int64).expand(sequences_shape).reshape(-1).contiguous()
    elif isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int or an integer tensor, got {offset!r}")
    elif not -(1 << 63) <= offset < (1 << 63):
        raise ValueError(f"offset={offset} does not fit in int64")
    else:
        scalar_offset = int(offset)

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
                f"positions of shape {list(positions.shape)} do not broadcast to ids.shape {list(ids.shape)}"
            )
        flat_positions = positions.to(torch.int64).expand(ids.shape).reshape(-1).contiguous()
        offsets = None

    return Batch(
        ids=flat_ids,
        out_shape=out_shape,
        seq_len=int(seq_len),
        offset=scalar_offset,
        offsets=offsets,
        positions=flat_positions,
    )


def check_id_range(ids: torch.Tensor, num_embeddings: int, vocab_start: int = 0) -> None:
    """Raise IndexError naming the first out-of-range id (host sync; skipped by the caller when disabled).

    ``ids`` may be shifted by ``vocab_start`` (a vocabulary-parallel shard's local ids): the
    check and the message are about the global id ``ids + vocab_start`` in ``[0, num_embeddings)``.
    """
    if ids.numel() == 0:
        return
    low, high = torch.aminmax(ids)
    low, high = int(low) + vocab_start, int(high) + vocab_start
    if low < 0 or high >= num_embeddings:
        bad = low if low < 0 else high
        raise IndexError(f"id {bad} is out of range for an embedding table of {num_embeddings} rows "
                         f"(valid: 0..{num_embeddings - 1})")
