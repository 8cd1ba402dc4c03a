"""posenc_fast.reference against an independent float64 re-derivation written from docs/design.md.

The formula below is written out here, from the description, and shares no code with
the package: frequencies base^(-2i/D), layouts, odd-D zero column, add/concat, scales.
For |p| <= 2^24 a plain float64 angle p * w_i is accurate to ~2e-9, far inside the bars.
"""

import math

import pytest
import torch

from posenc_fast import reference

from cases import CASES, make_inputs


def naive_table(positions: torch.Tensor, dim: int, base: float, layout: str, frequencies=None) -> torch.Tensor:
    """Written from the layout descriptions: interleaved [s0 c0 s1 c1 ..], split [s.. | c..],
    split_cos_first [c.. | s..]; odd dim: a zero last column, or, with h + 1 frequencies, one more
    sin column (interleaved: last; split: ending the sin block; cos-first: last)."""
    half = dim // 2
    w = frequencies if frequencies is not None else [base ** (-2.0 * i / dim) for i in range(half)]
    angle = positions.double().unsqueeze(-1) * torch.tensor(w, dtype=torch.float64)
    sin, cos = torch.sin(angle), torch.cos(angle)
    sin_tail = len(w) > half
    if layout == "interleaved":
        columns = []
        for i in range(half):
            columns += [sin[..., i], cos[..., i]]
    elif layout == "split":
        columns = [sin[..., i] for i in range(len(w))] + [cos[..., i] for i in range(half)]
    else:
        columns = [cos[..., i] for i in range(half)] + [sin[..., i] for i in range(len(w))]
    if layout == "interleaved" and sin_tail:
        columns.append(sin[..., half])
    if len(columns) < dim:
        columns.append(torch.zeros_like(angle[..., 0]) if half else torch.zeros(positions.shape, dtype=torch.float64))
    return torch.stack(columns, dim=-1) if columns else torch.zeros(positions.shape + (0,), dtype=torch.float64)


def naive_embedding(ids, weight, *, mode, d_pos, positions, offset, layout, embed_scale, pe_scale, padding_idx,
                    frequencies=None, zero_pe_at_padding=False, precision="float32"):
    # precision is how a backend may compute; exact math has none.
    ids = ids.cpu()
    if positions is not None:
        pos = positions.cpu().to(torch.int64).expand(ids.shape)
    else:
        t = torch.arange(ids.shape[-1] if ids.dim() else 1).expand(ids.shape) if ids.dim() else torch.tensor(0)
        off = offset.cpu().unsqueeze(-1) if isinstance(offset, torch.Tensor) else offset
        pos = t + off
    tokens = weight.cpu().double()[ids.long()] * embed_scale
    dim = d_pos if mode == "concat" else weight.shape[1]
    pe = naive_table(pos, dim, 10000.0, layout, frequencies) * pe_scale
    if zero_pe_at_padding:
        pe = pe * (ids != padding_idx).unsqueeze(-1)
    out = torch.cat([tokens, pe], -1) if mode == "concat" else tokens + pe
    # The naive float64 angle p * w is itself off by up to ~|p w| 2^-53: the tolerance of this check.
    rates = frequencies if frequencies is not None else [1.0]
    largest_angle = (pos.abs().max().item() if pos.numel() else 0) * max(abs(w) for w in rates) if rates else 0.0
    return out, largest_angle


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_independent_formula(case, seed):
    ids, weight, kwargs = make_inputs(case, "cpu", torch.float64, seed)
    got = reference.sinusoidal_embedding(ids, weight, **kwargs)
    full = dict(positions=None, offset=0)
    full.update(kwargs)
    want, largest_angle = naive_embedding(ids, weight, **full)
    assert got.dtype == torch.float64 and got.shape == want.shape
    atol = (1e-9 + largest_angle * 2.0**-51) * max(1.0, case.embed_scale, case.pe_scale)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("layout", ["interleaved", "split", "split_cos_first"])
@pytest.mark.parametrize("dim", [1, 2, 3, 8, 9, 64])
def test_sinusoidal_table(layout, dim):
    positions = torch.tensor([0, 1, 5, -7, 65536, 2**24, -(2**24)])
    got = reference.sinusoidal_table(positions, dim, layout=layout)
    torch.testing.assert_close(got, naive_table(positions, dim, 10000.0, layout), rtol=0, atol=1e-8)
    if dim % 2:
        assert torch.count_nonzero(got[..., -1]) == 0, "odd width must end in a zero column"
        rates = [0.3 * (i + 1) for i in range(dim // 2 + 1)]
        with_tail = reference.sinusoidal_table(positions, dim, layout=layout, frequencies=rates)
        torch.testing.assert_close(with_tail, naive_table(positions, dim, 0.0, layout, rates), rtol=0, atol=1e-8)


def test_sinusoidal_table_arguments():
    by_count = reference.sinusoidal_table(6, 4, base=100.0, dtype=torch.float32)
    assert by_count.shape == (6, 4) and by_count.dtype == torch.float32
    by_list = reference.sinusoidal_table([0, 1, 2, 3, 4, 5], 4, base=100.0, dtype=torch.float32)
    assert torch.equal(by_count, by_list)
    torch.testing.assert_close(by_count.double(), naive_table(torch.arange(6), 4, 100.0, "interleaved"),
                               rtol=0, atol=1e-7)
    grid = reference.sinusoidal_table(torch.arange(6).reshape(2, 3), 5)
    assert grid.shape == (2, 3, 5)
    with pytest.raises(TypeError, match="float32"):
        reference.sinusoidal_table(torch.arange(3.0), 4)
    with pytest.raises(ValueError, match="dim"):
        reference.sinusoidal_table(3, 0)
    with pytest.raises(ValueError, match="layout"):
        reference.sinusoidal_table(3, 4, layout="blocked")


def test_reference_is_exact_far_beyond_fp32():
    """At p = 2^40 a float64 angle product is off by ~1e-4; the reference's fixed-point turn is not."""
    from decimal import Decimal, localcontext

    p, dim = 2**40 + 12345, 16
    got = reference.sinusoidal_table(torch.tensor([p]), dim)[0]
    with localcontext() as ctx:
        ctx.prec = 50
        two_pi = Decimal("6.283185307179586476925286766559005768394338798750211641949889")
        for i in range(dim // 2):
            angle = float((Decimal(p) * Decimal(10000.0 ** (-2.0 * i / dim))) % two_pi)
            assert abs(got[2 * i].item() - math.sin(angle)) < 1e-6
            assert abs(got[2 * i + 1].item() - math.cos(angle)) < 1e-6
