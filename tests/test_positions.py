"""posenc_fast.positions: fairseq's padding-aware positions and packed sequences, against loops."""

import pytest
import torch

import posenc_fast as pf

from cases import backend_targets

TARGETS = backend_targets()


def fairseq_positions_loop(ids, padding_idx, past_length=0):
    """Written from fairseq's description: count non-padding tokens along each row."""
    out = torch.full_like(ids, padding_idx, dtype=torch.int64)
    rows = ids.reshape(-1, ids.shape[-1])
    flat_out = out.view(-1, ids.shape[-1])
    past = past_length.reshape(-1).tolist() if isinstance(past_length, torch.Tensor) else [past_length] * rows.shape[0]
    for r in range(rows.shape[0]):
        count = 0
        for t in range(rows.shape[1]):
            if rows[r, t] != padding_idx:
                count += 1
                flat_out[r, t] = padding_idx + past[r] + count
    return out


@pytest.mark.parametrize("padding_idx", [1, 0, 3])
def test_make_positions_padding_layouts(padding_idx):
    p = padding_idx
    ids = torch.tensor([
        [p, p, 7, 8, 9, 4],        # left padding
        [7, 8, 9, 4, p, p],        # right padding
        [p, p, p, p, p, p],        # all padding
        [7, p, 8, p, 9, 4],        # interior padding
    ])
    for past in (0, 5, torch.tensor([0, 3, 9, 100])):
        got = pf.make_positions(ids, padding_idx, past_length=past)
        torch.testing.assert_close(got, fairseq_positions_loop(ids, padding_idx, past), rtol=0, atol=0)
    assert pf.make_positions(ids.int(), padding_idx).dtype == torch.int64


def test_make_positions_padding_past_the_id_dtype():
    """A padding_idx that no int32 id can equal pads nothing: compared with the tensor as it is, 2^32 + 7
    would wrap onto 7 and that token would take the padding position."""
    ids = torch.tensor([[7, 8, 0, 7]], dtype=torch.int32)
    for padding_idx in (2**32 + 7, -(2**32) + 7, 2**31):
        got = pf.make_positions(ids, padding_idx, past_length=3)
        torch.testing.assert_close(got, fairseq_positions_loop(ids.long(), padding_idx, 3), rtol=0, atol=0)


def test_make_positions_errors():
    with pytest.raises(TypeError, match="float32"):
        pf.make_positions(torch.zeros(2, 3), 1)
    with pytest.raises(ValueError, match="padding_idx=18446744073709551616 does not fit in int64"):
        pf.make_positions(torch.zeros(2, 3, dtype=torch.int64), 2**64)
    with pytest.raises(ValueError, match=r"\[3\]"):
        pf.make_positions(torch.zeros(2, 3, dtype=torch.int64), 1, past_length=torch.zeros(3, dtype=torch.int64))


def packed_loop(lengths):
    return torch.tensor([t for n in lengths for t in range(n)], dtype=torch.int64)


@pytest.mark.parametrize("lengths", [[5], [3, 1, 4], [1, 1, 1], [0, 4, 0, 2], [7, 0]])
def test_packed_positions(lengths):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    torch.testing.assert_close(pf.packed_positions(cu, sum(lengths)), packed_loop(lengths), rtol=0, atol=0)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_cu_seqlens_equals_explicit_positions(backend, device):
    lengths = [4, 1, 6, 3]
    cu = torch.tensor([0, 4, 5, 11, 14], device=device)
    ids = torch.randint(0, 30, (14,), device=device)
    weight = torch.randn(30, 10, device=device)
    packed = pf.sinusoidal_embedding(ids, weight, cu_seqlens=cu, layout="split", backend=backend)
    explicit = pf.sinusoidal_embedding(ids, weight, positions=packed_loop(lengths).to(device), layout="split",
                                       backend=backend)
    assert torch.equal(packed, explicit)
    module = pf.SinusoidalEmbedding(30, 10, layout="split", backend=backend).to(device)
    with torch.no_grad():
        module.weight.copy_(weight)
    assert torch.equal(module(ids, cu_seqlens=cu), packed)


def test_cu_seqlens_errors():
    ids = torch.randint(0, 30, (6,))
    weight = torch.randn(30, 4)
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match="cu_seqlens"):
        pf.sinusoidal_embedding(ids, weight, cu_seqlens=cu, positions=torch.arange(6))
    with pytest.raises(ValueError, match="cu_seqlens"):
        pf.sinusoidal_embedding(ids, weight, cu_seqlens=cu, offset=3)
    with pytest.raises(TypeError, match="float32"):
        pf.sinusoidal_embedding(ids, weight, cu_seqlens=cu.float())
    with pytest.raises(ValueError, match="1-D"):
        pf.sinusoidal_embedding(ids, weight, cu_seqlens=cu.reshape(1, 3))
