"""Geometry of the sinusoidal PE in float64 (docs/explore.md): R(k) with PE(t + k) = R(k) PE(t), <PE(t), PE(t + k)>
against k, PE vs token norms.  ``plots`` draws these numbers."""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

from ..reference import sinusoidal_table

# Layouts whose (sin, cos) columns this module knows (pair_columns), written out rather than taken from
# the core's helpers so that the rotation check is independent of the implementation.
ROTATION_LAYOUTS = ("interleaved", "split")


def pair_columns(dim: int, layout: str):
    """``(sin_columns, cos_columns)``: int64 index tensors, pair i at position i, for an even ``dim``."""
    if dim < 2 or dim % 2:
        raise ValueError(f"dim must be even and >= 2 for the pair structure, got {dim}")
    half = dim // 2
    pairs = torch.arange(half, dtype=torch.int64)
    if layout == "interleaved":
        return 2 * pairs, 2 * pairs + 1
    if layout == "split":
        return pairs, half + pairs
    raise ValueError(f"layout {layout!r} not supported here; expected one of {ROTATION_LAYOUTS}")


def pe_table(positions, dim: int, *, base: float = 10000.0, layout: str = "interleaved") -> torch.Tensor:
    """float64 PE rows for ``positions`` (an int n means 0..n-1): ``[len(positions), dim]``."""
    return sinusoidal_table(positions, dim, base=base, layout=layout, dtype=torch.float64)


def offset_rotation(offset: int, dim: int, *, base: float = 10000.0, layout: str = "interleaved") -> torch.Tensor:
    """The ``[dim, dim]`` float64 matrix R(k) with ``PE(t + k) = R(k) @ PE(t)`` for every t (even ``dim``):
    one 2x2 rotation by k * w_i per (sin, cos) pair.

    cos(k w_i) and sin(k w_i) are read off the library's PE row for position k, whose angles are exact,
    rather than recomputed from a float64 product k * w_i, whose rounding would be an error of the check,
    not of the identity.
    """
    sin_columns, cos_columns = pair_columns(dim, layout)
    row = pe_table([offset], dim, base=base, layout=layout)[0]
    sin_k, cos_k = row[sin_columns], row[cos_columns]
    rotation = torch.zeros(dim, dim, dtype=torch.float64)
    rotation[sin_columns, sin_columns] = cos_k
    rotation[sin_columns, cos_columns] = sin_k
    rotation[cos_columns, sin_columns] = -sin_k
    rotation[cos_columns, cos_columns] = cos_k
    return rotation


def rotation_error(
    offsets: Sequence[int], starts: Sequence[int], dim: int, *, base: float = 10000.0, layout: str = "interleaved"
) -> torch.Tensor:
    """For each offset k: ``max_t max_j |(R(k) PE(t) - PE(t + k))_j|`` over the given starts t (float64)."""
    starts_tensor = torch.as_tensor(list(starts), dtype=torch.int64)
    pe_start = pe_table(starts_tensor, dim, base=base, layout=layout)
    errors = []
    for k in offsets:
        shifted = pe_table(starts_tensor + int(k), dim, base=base, layout=layout)
        rotated = pe_start @ offset_rotation(int(k), dim, base=base, layout=layout).T
        errors.append((rotated - shifted).abs().max())
    return torch.stack(errors)


def dot_by_offset(
    starts: Sequence[int], max_offset: int, dim: int, *, base: float = 10000.0, layout: str = "interleaved"
) -> torch.Tensor:
    """``[len(starts), max_offset + 1]`` table of <PE(t), PE(t + k)> for t in starts, k = 0..max_offset.
    Every row is sum_i cos(k w_i), up to the float64 rounding of the sums."""
    offsets = torch.arange(max_offset + 1, dtype=torch.int64)
    rows = []
    for t in starts:
        pe_t = pe_table([int(t)], dim, base=base, layout=layout)[0]
        rows.append(pe_table(offsets + int(t), dim, base=base, layout=layout) @ pe_t)
    return torch.stack(rows)


def dot_closed_form(max_offset: int, dim: int, *, base: float = 10000.0) -> torch.Tensor:
    """sum_i cos(k w_i) for k = 0..max_offset, w_i = base^(-2i/dim): the t-free value of <PE(t), PE(t+k)>."""
    frequencies = torch.tensor([base ** (-2.0 * i / dim) for i in range(dim // 2)], dtype=torch.float64)
    offsets = torch.arange(max_offset + 1, dtype=torch.float64)
    return torch.cos(offsets[:, None] * frequencies[None, :]).sum(-1)


def norm_comparison(
    dims: Sequence[int], *, num_tokens: int = 1000, num_positions: int = 512, seed: int = 0
) -> List[Dict[str, float]]:
    """L2 norms per width d, one dict of means and standard deviations per d: the PE over positions
    0..num_positions-1, sampled ``N(0, 1)`` token rows (``nn.Embedding``'s init), and the same rows times
    sqrt(d) (the Vaswani et al. embedding scale, as many PyTorch ports apply it to an N(0, 1) table).
    """
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for d in dims:
        pe_norms = pe_table(num_positions, d).norm(dim=-1)
        token_norms = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64).norm(dim=-1)
        scaled_norms = token_norms * math.sqrt(d)
        rows.append({
            "d": d,
            "pe_mean": float(pe_norms.mean()), "pe_std": float(pe_norms.std()),
            "token_mean": float(token_norms.mean()), "token_std": float(token_norms.std()),
            "scaled_token_mean": float(scaled_norms.mean()), "scaled_token_std": float(scaled_norms.std()),
        })
    return rows


def column_spread(num_positions: int, dim: int, *, base: float = 10000.0, layout: str = "interleaved") -> torch.Tensor:
    """Per-column standard deviation of the PE over positions 0..num_positions-1 (``[dim]``): where adding
    the PE moves a token vector (slow columns are nearly a constant, a bias rather than noise)."""
    return pe_table(num_positions, dim, base=base, layout=layout).std(dim=0)
