"""Are token vectors and position vectors in (nearly) orthogonal subspaces?  Owns the subspace
computations behind ``experiment subspace``: bases, principal angles, their summary next to what a random
subspace would give, and nearest-token recovery after the PE is added.  All in float64.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

from .geometry import pe_table

# Share of the squared Frobenius norm kept when a spanning set is ill-conditioned: in PE(0..L-1) the slow
# pairs collapse onto 1, t, t^2, ..., so its span is only meaningful up to a tolerance.
DEFAULT_ENERGY = 0.999


def orthonormal_basis(vectors: torch.Tensor, *, rtol: float = 1e-10) -> torch.Tensor:
    """``[d, n]`` orthonormal basis of the span of the rows of ``vectors`` (``[n, d]``, n <= d), by QR.
    Raises ValueError when the rows are numerically dependent (then use :func:`dominant_subspace`)."""
    if vectors.dim() != 2 or vectors.shape[0] > vectors.shape[1]:
        raise ValueError(f"expected [n, d] with n <= d linearly independent rows, got shape {list(vectors.shape)}")
    q, r = torch.linalg.qr(vectors.to(torch.float64).T, mode="reduced")
    diagonal = r.diagonal().abs()
    if diagonal.min() <= rtol * diagonal.max():
        raise ValueError("rows are numerically linearly dependent; use dominant_subspace() for such sets")
    return q


def dominant_subspace(vectors: torch.Tensor, *, energy: float = DEFAULT_ENERGY) -> torch.Tensor:
    """``[d, r]`` orthonormal basis of the smallest leading right-singular subspace of ``vectors`` (``[n, d]``)
    that holds ``energy`` of their squared norm."""
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    _, singular_values, vh = torch.linalg.svd(vectors.to(torch.float64), full_matrices=False)
    cumulative = (singular_values**2).cumsum(0) / (singular_values**2).sum()
    rank = int((cumulative < energy - 1e-12).sum()) + 1
    return vh[:rank].T


def principal_angles(basis_a: torch.Tensor, basis_b: torch.Tensor) -> torch.Tensor:
    """Principal angles (radians, ascending, ``min(a, b)`` of them) between two subspaces of R^d, given
    orthonormal bases ``basis_a`` ``[d, a]`` and ``basis_b`` ``[d, b]``.

    Taken as atan2(sin, cos), the sine being the length of each principal vector of b outside span(a):
    arccos of the cosines alone loses half the digits near 0.
    """
    if basis_a.shape[0] != basis_b.shape[0]:
        raise ValueError(f"bases live in different spaces: {basis_a.shape[0]} vs {basis_b.shape[0]} rows")
    basis_a, basis_b = basis_a.to(torch.float64), basis_b.to(torch.float64)
    _, cosines, vh = torch.linalg.svd(basis_a.T @ basis_b, full_matrices=False)
    principal_b = basis_b @ vh.T  # principal vectors of b, one per cosine
    outside_a = principal_b - basis_a @ (basis_a.T @ principal_b)
    sines = outside_a.norm(dim=0)
    return torch.atan2(sines, cosines).sort().values


def subspace_overlap(token_vectors: torch.Tensor, pe_basis: torch.Tensor) -> Dict[str, float]:
    """How much the span of ``token_vectors`` (``[n, d]`` rows) overlaps the PE subspace ``pe_basis`` (``[d, b]``).

    Keys: ``d``, ``token_dim``, ``pe_dim``, ``min_angle_deg``, ``median_angle_deg``; ``mean_cos2`` (over the
    min(a, b) angles: 0 when orthogonal, 1 when one contains the other); ``energy_in_pe`` (mean over tokens
    of |P_pe x|^2 / |x|^2); and what a uniformly random subspace of the same dimension would give for the
    last two, ``random_mean_cos2`` = max(a, b)/d and ``random_energy_in_pe`` = b/d.
    """
    d = token_vectors.shape[1]
    token_basis = orthonormal_basis(token_vectors)
    angles = principal_angles(token_basis, pe_basis)
    a, b = token_basis.shape[1], pe_basis.shape[1]
    x = token_vectors.to(torch.float64)
    in_pe = (x @ pe_basis).pow(2).sum(-1) / x.pow(2).sum(-1)
    return {
        "d": d,
        "token_dim": a,
        "pe_dim": b,
        "min_angle_deg": math.degrees(float(angles[0])),
        "median_angle_deg": math.degrees(float(angles.quantile(0.5))),  # (the mean of the middle two)
        "mean_cos2": float(torch.cos(angles).pow(2).mean()),
        "random_mean_cos2": max(a, b) / d,
        "energy_in_pe": float(in_pe.mean()),
        "random_energy_in_pe": b / d,
    }


def random_tokens_vs_pe(
    dims: Sequence[int], *, num_tokens: int = 32, num_positions: int = 64, energy: float = DEFAULT_ENERGY,
    seed: int = 0,
) -> List[Dict[str, float]]:
    """:func:`subspace_overlap` of ``num_tokens`` seeded N(0, 1) token vectors vs the
    :func:`dominant_subspace` of PE(0..num_positions-1) at ``energy``, per d."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for d in dims:
        if num_tokens > d:
            raise ValueError(f"num_tokens={num_tokens} exceeds d={d}: the tokens would span all of R^d")
        tokens = torch.randn(num_tokens, d, generator=generator, dtype=torch.float64)
        rows.append(subspace_overlap(tokens, dominant_subspace(pe_table(num_positions, d), energy=energy)))
    return rows


def nearest_token_recovery(token_table: torch.Tensor, pe_rows: torch.Tensor) -> float:
    """Fraction of (token u, position p) pairs whose nearest table row to ``E[u] + PE(p)`` is still ``E[u]``:
    every v != u has a positive margin |E_u - E_v|^2 + 2 <E_u - E_v, PE_p> (ties count as lost).  The
    margins come from Gram matrices, so no [V, V, d] tensor is formed, and [V, V, P] only a few positions at
    a time (about 64 MiB each).
    """
    if token_table.shape[0] == 0 or pe_rows.shape[0] == 0:
        raise ValueError(f"nearest-token recovery needs tokens and positions: got {token_table.shape[0]} table rows "
                         f"and {pe_rows.shape[0]} PE rows")
    table = token_table.to(torch.float64)
    pe = pe_rows.to(torch.float64)
    gram = table @ table.T  # [V, V]
    squared_norms = gram.diagonal()
    distance2 = squared_norms[:, None] + squared_norms[None, :] - 2 * gram  # |E_u - E_v|^2
    vocab = table.shape[0]
    distance2[torch.arange(vocab), torch.arange(vocab)] = float("inf")  # v == u is not a competitor
    token_dot_pe = table @ pe.T  # [V, P]
    kept = 0
    chunk = max(1, (1 << 23) // max(1, vocab * vocab))
    for start in range(0, token_dot_pe.shape[1], chunk):
        dots = token_dot_pe[:, start:start + chunk]
        margin = distance2[:, :, None] + 2 * (dots[:, None, :] - dots[None, :, :])  # [u, v, p]
        kept += int((margin.amin(dim=1) > 0).sum())
    return kept / (vocab * token_dot_pe.shape[1])


def recovery_by_dim(
    dims: Sequence[int], token_stds: Sequence[float], *, vocab_size: int = 256, num_positions: int = 64, seed: int = 0
) -> List[Dict[str, float]]:
    """:func:`nearest_token_recovery` for N(0, std^2) tables of ``vocab_size`` rows, per d and std."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for d in dims:
        pe = pe_table(num_positions, d)
        unit_table = torch.randn(vocab_size, d, generator=generator, dtype=torch.float64)
        row: Dict[str, float] = {"d": d}
        for std in token_stds:
            row[f"recovery_std_{std:g}"] = nearest_token_recovery(unit_table * std, pe)
        rows.append(row)
    return rows
