"""posenc_fast.backends.triton_kernels: the exact-angle sin/cos core, checked alone against float64.

Boundaries of the quarter-turn reduction, wraparound at +-2^63 and random turns.
The bound 1.5e-7 is what the quarter-turn reduction gives (measured worst case 1.02e-7
over 4e5 random turns in the interpreter), well inside the design's ~4e-7 (docs/design.md).
"""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import triton.language as tl  # noqa: E402

from posenc_fast.backends import triton_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _sin_cos_probe(turns_ptr, sin_ptr, cos_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    turn_units = tl.load(turns_ptr + offs, mask=mask, other=0)
    sin, cos = triton_kernels.sin_cos_of_turns(turn_units, False)
    tl.store(sin_ptr + offs, sin, mask=mask)
    tl.store(cos_ptr + offs, cos, mask=mask)


def _probe(turn_units: torch.Tensor):
    n = turn_units.numel()
    sin = torch.full((n,), float("nan"), device=DEVICE)
    cos = torch.full((n,), float("nan"), device=DEVICE)
    _sin_cos_probe[(triton.cdiv(n, 1024),)](turn_units.to(DEVICE), sin, cos, n, BLOCK=1024)
    return sin.cpu().double(), cos.cpu().double()


def _exact(turn_units: torch.Tensor):
    # turn_units / 2^64 turns; as float64 the fraction is exact to 2^-53 relative.
    angle = turn_units.double() * (2 * math.pi / 2.0**64)
    return torch.sin(angle), torch.cos(angle)


def test_sin_cos_of_turns_accuracy(seed):
    g = torch.Generator().manual_seed(seed)
    eighth, quarter = 1 << 61, 1 << 62
    edges = []
    for k in range(-4, 5):  # every multiple of 1/8 turn, and its neighbours
        for delta in (-(1 << 40), -1, 0, 1, 1 << 40):
            v = k * eighth + delta
            if -(1 << 63) <= v < (1 << 63):
                edges.append(v)
    edges += [-(1 << 63), (1 << 63) - 1, quarter - 1, -quarter]
    random = torch.randint(-(2**63), 2**63 - 1, (60000,), generator=g, dtype=torch.int64)
    turn_units = torch.cat([torch.tensor(edges, dtype=torch.int64), random])
    sin, cos = _probe(turn_units)
    exact_sin, exact_cos = _exact(turn_units)
    err = torch.maximum((sin - exact_sin).abs(), (cos - exact_cos).abs())
    assert not torch.isnan(err).any()
    worst = err.max().item()
    assert worst <= 1.5e-7, f"max |error| {worst:.3g} at turn_units={turn_units[err.argmax()].item()}"
