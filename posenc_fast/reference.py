"""The pure-PyTorch definition of the layer: what every backend must compute.

    y[..., :] = embed_scale * W[ids[...]]  (+)  pe_scale * PE(pos[...])

(+) is addition (mode="add") or concatenation (mode="concat").  The PE is the
fixed sinusoid of width D with h = D // 2 (sin, cos) pairs; frequencies
``w_i = base ** (-2 i / D)`` unless given; layout "interleaved" puts sin/cos of
pair i in columns 2i/2i+1, "split" in columns i/h+i, "split_cos_first" cos first;
an odd D ends in a zero column, or in a sin column when h + 1 frequencies are given
(see ``_spec.PEColumns``).  With ``zero_pe_at_padding`` tokens equal to
``padding_idx`` get no PE.

Everything is computed in float64 and rounded once to the output dtype.  The
angle is never formed as a product ``p * w`` in floating point: the pair's
phase is the exact fractional turn ``p * R_i mod 2**64`` (see ``_spec``), so the
reference stays exact for every int64 position, where an fp32 (or even fp64)
table drifts.  Out-of-range ids (possible only with the id check turned off)
contribute a zero token vector.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ._spec import PEColumns, default_frequencies, turns_fixed_point
from ._validate import check_id_range, check_weight, make_batch, make_spec
from . import config

_RADIANS_PER_UNIT = 2.0 * math.pi / 2.0**64


def _assign(table: torch.Tensor, columns: range, values: torch.Tensor) -> None:
    if len(columns):
        table[..., columns.start : columns.stop : columns.step] = values[..., : len(columns)]


def exact_sinusoid(positions: torch.Tensor, turns: torch.Tensor, pe_width: int, columns: PEColumns) -> torch.Tensor:
    """float64 PE of width ``pe_width`` for int64 ``positions`` (any shape), fixed-point turns ``R``
    (h or h + 1 of them) and column layout ``columns``."""
    positions = positions.to(torch.int64)
    sin_columns, cos_columns = columns.sin_columns(pe_width), columns.cos_columns(pe_width)
    # Pair slots beyond the given frequencies (an odd D's zero tail) have R = 0: sin 0 = 0.
    slots = max(len(sin_columns), len(cos_columns), turns.numel())
    padded = torch.zeros(slots, dtype=torch.int64, device=positions.device)
    padded[: turns.numel()] = turns.to(positions.device)
    frac = positions.unsqueeze(-1) * padded  # wraps mod 2**64: the exact fractional turn
    angle = frac.to(torch.float64) * _RADIANS_PER_UNIT  # in [-pi, pi)
    table = torch.zeros(positions.shape + (pe_width,), dtype=torch.float64, device=positions.device)
    _assign(table, sin_columns, torch.sin(angle))
    _assign(table, cos_columns, torch.cos(angle))
    return table


def sinusoidal_table(
    positions: Union[int, Sequence[int], torch.Tensor],
    dim: int,
    *,
    base: float = 10000.0,
    layout: str = "interleaved",
    dtype: torch.dtype = torch.float64,
    frequencies: Optional[Sequence[float]] = None,
) -> torch.Tensor:
    """The PE alone: shape ``positions.shape + (dim,)``.

    ``positions`` may be an integer tensor, a sequence of ints, or an int n
    (meaning positions 0..n-1).
    """
    if isinstance(positions, bool):
        raise TypeError(f"positions must be an int, a sequence of ints or an integer tensor, got {positions!r}")
    if isinstance(positions, int):
        if positions < 0:
            raise ValueError(f"positions={positions} must be >= 0 when given as a count")
        positions = torch.arange(positions, dtype=torch.int64)
    elif not isinstance(positions, torch.Tensor):
        positions = torch.tensor(list(positions), dtype=torch.int64)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"positions must be integers, got dtype {positions.dtype}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be an int >= 1, got {dim!r}")
    spec = make_spec(1, dim, "add", None, base, layout, 1.0, 1.0, None, frequencies)
    turns = torch.tensor(spec.turns_fixed_point, dtype=torch.int64).reshape(-1)
    return exact_sinusoid(positions, turns, dim, spec.columns).to(dtype)


def embed_flat(
    ids: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    turns: torch.Tensor,
    *,
    concat: bool,
    pe_width: int,
    columns: PEColumns,
    embed_scale: float,
    pe_scale: float,
    padding_idx: Optional[int] = None,
    zero_pe_at_padding: bool = False,
) -> torch.Tensor:
    """The layer on flat inputs (ids [N], int64 positions [N]); differentiable w.r.t. ``weight``.

    Returns ``[N, width]`` in ``weight.dtype``, computed in float64 and rounded once.
    """
    ids = ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < weight.shape[0])
    rows = F.embedding(torch.where(in_range, ids, 0), weight, padding_idx=padding_idx)
    tokens = rows.to(torch.float64) * embed_scale * in_range.unsqueeze(-1)
    pe = exact_sinusoid(positions, turns, pe_width, columns) * pe_scale
    if zero_pe_at_padding:
        pe = pe * (ids != padding_idx).unsqueeze(-1)
    out = torch.cat([tokens, pe], dim=-1) if concat else tokens + pe
    return out.to(weight.dtype)


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
    precision: str = "float32",
) -> torch.Tensor:
    """Reference implementation of :func:`posenc_fast.sinusoidal_embedding` (any float dtype, autograd by PyTorch).

    It always computes in float64 and rounds once, so ``precision`` (validated) changes nothing here.
    """
    check_weight(weight)
    spec = make_spec(weight.shape[0], weight.shape[1], mode, d_pos, base, layout, embed_scale, pe_scale, padding_idx,
                     frequencies, zero_pe_at_padding, precision)
    batch = make_batch(ids, weight, spec, positions, offset)
    if config.id_check_enabled():
        check_id_range(batch.ids, weight.shape[0])
    out = embed_flat(
        batch.ids, weight, batch.token_positions(), spec.turns_tensor(weight.device),
        concat=spec.mode == "concat", pe_width=spec.pe_width, columns=spec.columns,
        embed_scale=spec.embed_scale, pe_scale=spec.pe_scale, padding_idx=spec.padding_idx,
        zero_pe_at_padding=spec.zero_pe_at_padding,
    )
    return out.reshape(batch.out_shape)


__all__ = ["sinusoidal_embedding", "sinusoidal_table", "exact_sinusoid", "embed_flat", "default_frequencies", "turns_fixed_point"]
