"""posenc_fast.ops: the torch.library registration (schema, fake impl, autograd) passes opcheck."""

import pytest
import torch

from posenc_fast import ops, reference
from posenc_fast._validate import make_spec

from cases import assert_within, backend_targets, output_bound

TARGETS = backend_targets()


def _dropout_seed(device):
    return torch.tensor([0x5DEECE66D12345], dtype=torch.int64, device=device)


def _op_args(device, positions_kind, backend, dtype=torch.float32):
    spec = make_spec(20, 10, "concat", 4, 10000.0, "interleaved", 1.5, 0.5, 3)
    ids = torch.randint(0, 20, (12,), device=device)
    weight = torch.randn(20, 10, device=device, dtype=dtype, requires_grad=True)
    positions = offsets = None
    if positions_kind == "positions":
        positions = torch.randint(-1000, 1000, (12,), device=device)
    elif positions_kind == "offsets":
        offsets = torch.tensor([5, -9, 2**30], device=device)
    dropout_seed, dropout_p = (_dropout_seed(device), 0.3) if positions_kind == "offset_dropout" else (None, 0.0)
    return (ids, weight, spec.turns_tensor(device), positions, offsets, 7 if positions_kind == "offset" else 0, 4,
            True, spec.pe_width, spec.columns.as_list(), spec.embed_scale, spec.pe_scale, spec.padding_idx,
            positions_kind == "positions", positions_kind == "offsets", 0, 20, dropout_seed, dropout_p, backend)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("positions_kind", ["offset", "offsets", "positions", "offset_dropout"])
def test_opcheck_forward(backend, device, positions_kind):
    torch.library.opcheck(ops.sinusoidal_embedding_op, _op_args(device, positions_kind, backend))


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("dropout", [False, True], ids=["no_dropout", "dropout"])
def test_opcheck_backward(backend, device, dropout):
    grad_out = torch.randn(12, 14, device=device)
    ids = torch.randint(0, 20, (12,), device=device)
    dropout_seed, dropout_p = (_dropout_seed(device), 0.3) if dropout else (None, 0.0)
    torch.library.opcheck(ops.sinusoidal_embedding_backward_op,
                          (grad_out, ids, 20, 10, 1.5, 3, torch.float32, dropout_seed, dropout_p, backend))


def test_weight_gradient_skips_the_op_only_where_nothing_records_or_transforms(monkeypatch):
    """The weight gradient calls its implementation without torch.library's op in a plain eager backward,
    keeps a recorded graph's node (create_graph), and takes the op under the legacy vmap of gradcheck's
    batched gradients (whose tensors are neither functorch wrappers nor seen as an active transform);
    the gradients are the same on every path."""
    import posenc_fast as pf

    calls = []
    real = ops.sinusoidal_embedding_backward_op
    monkeypatch.setattr(ops, "sinusoidal_embedding_backward_op", lambda *args: calls.append(1) or real(*args))
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(10, 8, dtype=torch.float64, generator=g).requires_grad_()
    ids = torch.randint(0, 10, (2, 3), generator=g)
    grad_out = torch.randn(2, 3, 8, dtype=torch.float64, generator=g)

    def embed(w):
        return pf.sinusoidal_embedding(ids, w, embed_scale=2.0, backend="torch")

    (plain,) = torch.autograd.grad(embed(weight), weight, grad_out)
    assert calls == []
    expected = torch.zeros_like(weight).index_add_(0, ids.reshape(-1), 2.0 * grad_out.reshape(-1, 8))
    torch.testing.assert_close(plain, expected)

    (recorded,) = torch.autograd.grad(embed(weight), weight, grad_out.clone().requires_grad_(), create_graph=True)
    assert recorded.requires_grad and recorded.grad_fn is not None  # WeightGradient's node: a double backward
    torch.testing.assert_close(recorded.detach(), expected)

    (batched,) = torch.autograd.grad(embed(weight), weight, torch.stack([grad_out, 3 * grad_out]), is_grads_batched=True)
    assert calls, "the legacy vmap's batched tensors must take the op"
    torch.testing.assert_close(batched, torch.stack([expected, 3 * expected]))

    # torch.func runs an autograd.Function's forward on unwrapped tensors, one level down: WeightGradient's
    # forward may call the implementation there, as the op would after unwrapping (test_transforms has the rest).
    functorch_grad = torch.func.grad(lambda w: (embed(w) * grad_out).sum())(weight.detach())
    torch.testing.assert_close(functorch_grad, expected)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_a_direct_call_whose_length_does_not_divide_the_tokens(backend, device):
    """The op takes per-sequence offsets for ceil(N / seq_len) sequences, the last one short: token n is at
    offsets[n // seq_len] + n % seq_len on every backend (the reference's materialised positions included)."""
    spec = make_spec(20, 8, "add", None, 10000.0, "interleaved", 1.0, 1.0, None)
    ids, weight = torch.randint(0, 20, (11,)), torch.randn(20, 8)
    offsets = torch.tensor([10, -20, 2**40])
    out = ops.sinusoidal_embedding_op(ids.to(device), weight.to(device), spec.turns_tensor(device), None,
                                      offsets.to(device), 0, 4, False, 8, spec.columns.as_list(), 1.0, 1.0, -1, False,
                                      False, 0, 20, None, 0.0, backend)
    n = torch.arange(11)
    exact = reference.sinusoidal_embedding(ids, weight.double(), positions=offsets[n // 4] + n % 4)
    assert_within(out, exact, output_bound(exact, torch.float32), f"{backend}: 11 tokens, sequences of 4")
