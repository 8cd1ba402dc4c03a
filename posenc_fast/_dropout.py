"""Host side of the fused dropout: the integer keep threshold and the scale every backend uses, and the
per-call seed drawn from torch's generator (``dropout_p`` itself is checked in ``_validate``).  The mask is
``reference.dropout_keep`` (docs/design.md, "Fused dropout")."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Dropout(NamedTuple):
    """What a backend needs for the fused dropout of one call: the mask of ``reference.dropout_keep``;
    kept elements are multiplied by ``scale``, dropped ones are 0."""

    seed: Tensor  # int64, one element, on the device; read by the kernels (no host sync)
    threshold: int  # in [0, 2**32)
    scale: float  # 1 / (1 - p); 0 for p = 1


def threshold_of(p: float) -> int:
    """Keep iff a uniform u32 word is >= round(p * 2**32): keep rate 1 - p within 2**-33.
    (Where that rounds to 2**32 the threshold is 2**32 - 1 and the scale 0: nothing is kept.)"""
    return min(round(p * 2.0**32), 2**32 - 1)


def scale_of(p: float) -> float:
    """Kept elements are multiplied by 1 / (1 - p), as torch.nn.functional.dropout does.  Where
    ``threshold_of`` cannot express the keep rate (p within 2**-33 of 1), everything is dropped:
    scale 0, rather than an enormous scale on the few words at 2**32 - 1."""
    return 0.0 if round(p * 2.0**32) >= 2**32 else 1.0 / (1.0 - p)  # (p within 2**-33 of 1, p = 1 included)


def draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed in [0, 2**63) from torch's generator for ``device``, drawn on the device: no sync, a new
    value at each CUDA graph replay, reproducible under ``torch.manual_seed``."""
    return torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, device=device)  # out of place: traceable


def dropout_for(seed, p: float):
    """The backends' :class:`Dropout` for a call, or None when nothing is dropped."""
    if p == 0.0:
        return None
    if seed is None:
        raise ValueError(f"dropout_p={p} needs a dropout_seed (an int64 tensor of one element)")
    return Dropout(seed, threshold_of(p), scale_of(p))
