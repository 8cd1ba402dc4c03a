"""posenc_fast.ops: the torch.library registration (schema, fake impl, autograd) passes opcheck."""

import pytest
import torch

from posenc_fast import ops
from posenc_fast._validate import make_spec

from cases import backend_targets

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
