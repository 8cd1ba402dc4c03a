"""The pure-PyTorch definition of the layer: what every backend must compute.

    y[..., :] = embed_scale * W[ids[...]]  (+)  pe_scale * PE(pos[...])

(+) is addition (mode="add") or concatenation (mode="concat").  The PE is the
fixed sinusoid of width D with h = D // 2 (sin, cos) pairs; frequencies
``w_i = base ** (-2 i / D)`` unless given; layout "interleaved" puts sin/cos of
pair i in columns 2i/2i+1, "split" in columns i/h+i, "split_cos_first" cos first;
an odd D ends in a zero column, or in a sin column when h + 1 frequencies are given
(see ``_spec.PEColumns``).  With ``zero_pe_at_padding`` tokens equal to
``padding_idx`` get no PE.

Dropout (``dropout_p`` > 0, training) multiplies the result by ``keep * scale``
with ``scale = 1 / (1 - p)`` (0 for p = 1): dropped elements are exactly 0.  The
keep mask is a pure function of a 64-bit seed and the element's place, so every
backend draws the same mask and backward regenerates it (see
:func:`dropout_keep`); the seed comes from torch's generator (``_dropout``).

Everything is computed in float64, then rounded to the output dtype: once to fp32; to bf16 and
fp16 through fp32, as torch converts (two roundings, which the CUDA and CPU kernels avoid).  The
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

from ._dropout import Dropout, dropout_for
from ._spec import PEColumns, default_frequencies, turns_fixed_point
from ._validate import check_dropout_p, check_id_range, check_weight, make_batch, make_spec
from . import config

_RADIANS_PER_UNIT = 2.0 * math.pi / 2.0**64


def _times(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` with the factor as a float64 tensor (0-d, on the CPU, as a scalar is): torch.onnx.export
    makes a Python float, or a torch.full of it, a float32 constant, whose rounding (of 2 pi / 2**64, of
    sqrt(d)) would leave fp32 outputs an ulp off."""
    return t * torch.tensor(factor, dtype=torch.float64)


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
    turns = turns.reshape(-1).to(positions.device)
    if slots > turns.numel():
        # Concatenated, not copied into a zero buffer: torch 2.11's ONNX exporter loses a constant copied
        # whole into a buffer of its own dtype (pytorch/pytorch#178868).
        turns = torch.cat([turns, turns.new_zeros(slots - turns.numel())])
    frac = positions.unsqueeze(-1) * turns  # wraps mod 2**64: the exact fractional turn
    angle = _times(frac.to(torch.float64), _RADIANS_PER_UNIT)  # in [-pi, pi)
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


def embed_flat(ids: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, turns: torch.Tensor, *,
               concat: bool, pe_width: int, columns: PEColumns, embed_scale: float, pe_scale: float,
               padding_idx: Optional[int] = None, zero_pe_at_padding: bool = False,
               dropout: Optional[Dropout] = None) -> torch.Tensor:
    """The layer on flat inputs (ids [N], int64 positions [N]); differentiable w.r.t. ``weight``.

    Returns ``[N, width]`` in ``weight.dtype``, computed in float64 and rounded (as the module docstring says).
    """
    ids = ids.to(torch.int64)
    in_range = (ids >= 0) & (ids < weight.shape[0])
    if weight.shape[0]:
        rows = F.embedding(torch.where(in_range, ids, 0), weight, padding_idx=padding_idx)
    else:  # an empty table: every id is out of range (nothing to gather from, even row 0)
        rows = weight.new_zeros((ids.shape[0], weight.shape[1])) + weight.sum()  # keeps the autograd link
    # Selected, not multiplied by the mask: row 0 stands in for out-of-range ids and may hold inf.
    tokens = torch.where(in_range.unsqueeze(-1), _times(rows.to(torch.float64), embed_scale), 0.0)
    pe = _times(exact_sinusoid(positions, turns, pe_width, columns), pe_scale)
    if zero_pe_at_padding:
        pe = pe * (ids != padding_idx).unsqueeze(-1)
    out = torch.cat([tokens, pe], dim=-1) if concat else tokens + pe
    if dropout is not None:
        keep = dropout_keep(dropout.seed, out.shape[0], out.shape[1], dropout.threshold)
        out = torch.where(keep, _times(out, dropout.scale), 0.0)
    return out.to(weight.dtype)


# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): the
# generator of cuRAND, Triton's tl.philox and torch's CUDA RNG.  Constants of Random123.
PHILOX_ROUND_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_INCREMENTS = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_U32 = 0xFFFFFFFF


def _mulhilo32(multiplier: int, x: torch.Tensor):
    """(high, low) 32-bit halves of ``multiplier * x`` (u32 values in int64), from the constant's 16-bit halves:
    int64 cannot hold the 64-bit product."""
    low_product = x * (multiplier & 0xFFFF)
    high_product = x * (multiplier >> 16)
    middle = low_product + ((high_product & 0xFFFF) << 16)
    return (middle >> 32) + (high_product >> 16), middle & _U32


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 of int64 tensors holding u32 words: ``counter [..., 4]``, ``key [..., 2]``
    (broadcast against each other); returns the four output words ``[..., 4]``."""
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    m0, m1 = PHILOX_ROUND_MULTIPLIERS
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_KEY_INCREMENTS[0]) & _U32
            k1 = (k1 + PHILOX_KEY_INCREMENTS[1]) & _U32
        high0, low0 = _mulhilo32(m0, c0)
        high1, low1 = _mulhilo32(m1, c2)
        c0, c1, c2, c3 = high1 ^ c1 ^ k0, low1, high0 ^ c3 ^ k1, low0
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1)


def dropout_keep(seed: torch.Tensor, num_tokens: int, width: int, threshold: int, first_token: int = 0) -> torch.Tensor:
    """The dropout keep mask (bool ``[num_tokens, width]``) of the flat output (of its tokens
    ``first_token ..``).

    Element (t, c) (flat token t; output column c, the PE columns following the token
    columns in concat mode) is kept iff word ``c % 4`` of Philox4x32-10 with key
    ``(seed mod 2**32, seed >> 32)`` and counter ``(c // 4, t mod 2**32, t >> 32, 0)`` is
    ``>= threshold`` (``_dropout.threshold_of``: round(p * 2**32)).  One Philox call serves
    four neighbouring columns.  ``seed``: an int64 tensor of one element, in [0, 2**63);
    the mask is made on its device.
    """
    seed = seed.reshape(()).to(torch.int64)
    key = torch.stack([seed & _U32, (seed >> 32) & _U32])
    groups = torch.arange((width + 3) // 4, dtype=torch.int64, device=seed.device).reshape(1, -1)
    # Rows in slices of ~2**18 Philox calls: int64 temporaries of the whole output would be many times its size.
    rows_per_slice = max(1, 2**18 // max(groups.shape[1], 1))
    slices = []
    for start in range(first_token, first_token + num_tokens, rows_per_slice):
        stop = min(start + rows_per_slice, first_token + num_tokens)
        tokens = torch.arange(start, stop, dtype=torch.int64, device=seed.device).reshape(-1, 1)
        counter = torch.stack(torch.broadcast_tensors(groups, tokens & _U32, tokens >> 32, torch.zeros_like(groups)),
                              dim=-1)
        words = philox4x32_10(counter, key)  # [T, groups, 4]: word k of group g is column 4g + k
        slices.append(words.reshape(stop - start, 4 * groups.shape[1])[:, :width] >= threshold)
    if not slices:
        return torch.zeros((0, width), dtype=torch.bool, device=seed.device)
    return torch.cat(slices)


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
    dropout_p: float = 0.0,
    dropout_seed: Optional[Union[int, torch.Tensor]] = None,
) -> torch.Tensor:
    """Reference implementation of :func:`posenc_fast.sinusoidal_embedding` (any float dtype, autograd by PyTorch).

    It always computes in float64 and rounds once, so ``precision`` (validated) changes nothing here.
    Dropout is explicit: ``dropout_p`` > 0 needs the ``dropout_seed`` (int or int64 tensor in
    [0, 2**63)) whose mask :func:`dropout_keep` defines; there is no ``training`` switch.
    """
    check_weight(weight)
    spec = make_spec(weight.shape[0], weight.shape[1], mode, d_pos, base, layout, embed_scale, pe_scale, padding_idx,
                     frequencies, zero_pe_at_padding, precision)
    dropout_p = check_dropout_p(dropout_p)
    if dropout_p > 0.0:
        if dropout_seed is None:
            raise ValueError(f"dropout_p={dropout_p} needs the dropout_seed that defines its mask")
        if isinstance(dropout_seed, torch.Tensor):
            if dropout_seed.dtype != torch.int64 or dropout_seed.numel() != 1:
                raise ValueError(f"dropout_seed must be an int64 tensor of one element, got dtype "
                                 f"{dropout_seed.dtype} and shape {tuple(dropout_seed.shape)}")
            seed_value = int(dropout_seed.item())  # the reference may sync; the kernels never read it on the host
        else:
            seed_value = dropout_seed
        if isinstance(seed_value, bool) or not isinstance(seed_value, int) or not 0 <= seed_value < 2**63:
            raise ValueError(f"dropout_seed must be an int in [0, 2**63), got {seed_value!r}")
        dropout_seed = torch.tensor([seed_value], dtype=torch.int64, device=weight.device)
    batch = make_batch(ids, weight, spec, positions, offset)
    if config.id_check_enabled():
        check_id_range(batch.ids, weight.shape[0])
    out = embed_flat(
        batch.ids, weight, batch.token_positions(), spec.turns_tensor(weight.device),
        concat=spec.mode == "concat", pe_width=spec.pe_width, columns=spec.columns,
        embed_scale=spec.embed_scale, pe_scale=spec.pe_scale, padding_idx=spec.padding_idx,
        zero_pe_at_padding=spec.zero_pe_at_padding, dropout=dropout_for(dropout_seed, dropout_p),
    )
    return out.reshape(batch.out_shape)


__all__ = ["sinusoidal_embedding", "sinusoidal_table", "exact_sinusoid", "embed_flat", "dropout_keep", "philox4x32_10",
           "default_frequencies", "turns_fixed_point"]
