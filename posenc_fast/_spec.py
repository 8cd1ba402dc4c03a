"""Host-side parameters of the layer, computed once and shared by every backend.

A :class:`PESpec` is the complete, immutable description of *what* is computed
(mode, widths, layout, frequencies, scales, padding row).  Backends receive it
and turn it into plain numbers and pointers; none of them derives frequencies
or layout rules on its own.

Exact angles (docs/design.md, "Numerics"): the angle of pair ``i`` at integer
position ``p`` is ``2*pi * p * r_i`` with ``r_i = w_i / (2*pi)`` turns per
position.  Only the fractional part of ``p * r_i`` matters, so we store
``R_i = round(r_i * 2**64) mod 2**64`` (as a two's-complement int64) and every
backend computes ``p * R_i`` with a wrapping 64-bit multiply: the result is the
fractional turn, exact to 2**-64 per unit of position, for every int64 ``p``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import torch

MODES = ("add", "concat")
LAYOUTS = ("interleaved", "split")

# 2*pi * 10**60, rounded to an integer.  R_i is computed in exact integer arithmetic
# (float64 would lose ~2^-53 relative, i.e. 0.5 microradian at p = 2^32); plain
# Python ints also keep the computation traceable by torch.compile.
_TWO_PI_E60 = 6283185307179586476925286766559005768394338798750211641949889
_E60 = 10**60
_TWO_POW_64 = 1 << 64


def host_cache(fn):
    """lru_cache for host-side parameter functions, bypassed while torch.compile traces
    (Dynamo would trace through the cache anyway, and warns when it does)."""
    cached = functools.lru_cache(maxsize=512)(fn)

    @functools.wraps(fn)
    def wrapper(*args):
        if torch.compiler.is_compiling():
            return fn(*args)
        return cached(*args)

    return wrapper


@host_cache
def default_frequencies(pe_width: int, base: float = 10000.0) -> Tuple[float, ...]:
    """Vaswani et al. frequencies ``w_i = base ** (-2 i / D)`` for ``i < D // 2``, in float64."""
    half = pe_width // 2
    return tuple(float(base) ** (-2.0 * i / pe_width) for i in range(half))


@host_cache
def turns_fixed_point(frequencies: Tuple[float, ...]) -> Tuple[int, ...]:
    """``round(w_i / (2 pi) * 2**64)`` reduced to a two's-complement int64, for each frequency.

    Each float64 frequency is taken as the exact rational it is; 2*pi carries 60
    digits, so the only rounding that matters is the final one to an integer.
    Negative and large (> 2*pi) frequencies wrap correctly because only the turn
    modulo 1 matters.
    """
    out = []
    for w in frequencies:
        numerator, denominator = float(w).as_integer_ratio()
        # round(w * 2**64 / (2*pi)) with integers only: floor((2a + b) / 2b).
        a = numerator * _TWO_POW_64 * _E60
        b = denominator * _TWO_PI_E60
        fixed = ((2 * a + b) // (2 * b)) % _TWO_POW_64
        out.append(fixed - _TWO_POW_64 if fixed >= 1 << 63 else fixed)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class PESpec:
    """Everything about the layer that is fixed before seeing a batch.

    ``token_width`` is the width of the embedding table; ``pe_width`` (D) the
    width of the sinusoid; ``width`` the output width.
    """

    mode: str
    token_width: int
    pe_width: int
    layout: str
    frequencies: Tuple[float, ...]
    embed_scale: float = 1.0
    pe_scale: float = 1.0
    padding_idx: Optional[int] = None  # normalised to [0, num_embeddings) or None
    # Derived, not compared: R_i for each frequency, and their device copies.
    turns_fixed_point: Tuple[int, ...] = dataclasses.field(init=False, compare=False, repr=False)
    _turns_by_device: dict = dataclasses.field(init=False, compare=False, repr=False, default_factory=dict)

    def __post_init__(self):
        # Plain attribute rather than functools.cached_property, whose lock torch.compile cannot trace.
        object.__setattr__(self, "turns_fixed_point", turns_fixed_point(tuple(self.frequencies)))

    @property
    def width(self) -> int:
        return self.token_width + self.pe_width if self.mode == "concat" else self.token_width

    @property
    def pe_column_offset(self) -> int:
        """First output column of the PE: 0 for add, token_width for concat."""
        return self.token_width if self.mode == "concat" else 0

    @property
    def num_pairs(self) -> int:
        """h = D // 2 (sin, cos) pairs; an odd D has one extra all-zero column."""
        return self.pe_width // 2

    def turns_tensor(self, device) -> torch.Tensor:
        """The int64 ``R_i`` on ``device``; cached, so one host-to-device copy per (spec, device)."""
        device = torch.device(device)
        cached = self._turns_by_device.get(device)
        if cached is None:
            cached = torch.tensor(self.turns_fixed_point, dtype=torch.int64, device=device).reshape(-1)
            self._turns_by_device[device] = cached
        return cached


def pe_column_map(pe_width: int, layout: str):
    """Column indices of the sin and cos of each pair within a PE of width D.

    Returns ``(sin_columns, cos_columns)`` as Python ranges.  The one place the
    layout is defined; the reference builds its tables from it.
    """
    half = pe_width // 2
    if layout == "interleaved":
        return range(0, 2 * half, 2), range(1, 2 * half, 2)
    if layout == "split":
        return range(0, half), range(half, 2 * half)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
