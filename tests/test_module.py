"""SinusoidalEmbedding: shapes, initialisation, equivalence with the functional op, compile, state dict."""

import pytest
import torch
from torch import nn

import posenc_fast as pf

from cases import backend_targets

TARGETS = backend_targets()


@pytest.mark.parametrize("mode,d_pos,table_width", [("add", None, 24), ("concat", 8, 16), ("concat", 23, 1)])
def test_weight_and_output_shapes(mode, d_pos, table_width):
    m = pf.SinusoidalEmbedding(50, 24, mode=mode, d_pos=d_pos)
    assert m.weight.shape == (50, table_width)
    assert m(torch.randint(0, 50, (3, 7))).shape == (3, 7, 24)


def test_initialised_like_nn_embedding():
    torch.manual_seed(0)
    m = pf.SinusoidalEmbedding(2000, 64, padding_idx=-2)
    assert m.padding_idx == 1998
    assert torch.count_nonzero(m.weight[1998]) == 0
    rest = torch.cat([m.weight[:1998], m.weight[1999:]]).detach()
    assert abs(rest.mean().item()) < 0.01 and abs(rest.std().item() - 1.0) < 0.01  # N(0, 1), 128k samples


def test_factory_kwargs_and_state_dict():
    m = pf.SinusoidalEmbedding(10, 6, dtype=torch.bfloat16, device="cpu")
    assert m.weight.dtype == torch.bfloat16
    assert list(m.state_dict()) == ["weight"], "only the table is state: loads from/to nn.Embedding"
    e = nn.Embedding(10, 6)
    m.load_state_dict({k: v.to(torch.bfloat16) for k, v in e.state_dict().items()})
    assert torch.equal(m.weight.float(), e.weight.to(torch.bfloat16).float())
    assert "mode='add'" in repr(m) and "10, 6" in repr(m)


@pytest.mark.parametrize("kwargs,error,fragment", [
    (dict(mode="concat", d_pos=12), ValueError, "d_pos=12"),
    (dict(mode="concat", d_pos=0), ValueError, "d_pos=0"),
    (dict(mode="concat"), ValueError, "d_pos"),
    (dict(layout="zigzag"), ValueError, "'zigzag'"),
    (dict(backend="fastest"), ValueError, "'fastest'"),
    (dict(base=-1.0), ValueError, "-1.0"),
])
def test_constructor_rejects_bad_arguments(kwargs, error, fragment):
    with pytest.raises(error) as info:
        pf.SinusoidalEmbedding(10, 12, **kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize("d_model", [0, -3, 2.5])
def test_constructor_rejects_bad_width(d_model):
    with pytest.raises(ValueError, match="d_model"):
        pf.SinusoidalEmbedding(10, d_model)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_module_matches_functional(backend, device):
    m = pf.SinusoidalEmbedding(40, 20, mode="concat", d_pos=6, layout="split", embed_scale=2.0,
                                padding_idx=0, backend=backend).to(device)
    ids = torch.randint(0, 40, (3, 9), device=device)
    offsets = torch.tensor([0, 100, 2**20], device=device)
    out = m(ids, offset=offsets)
    want = pf.sinusoidal_embedding(ids, m.weight, mode="concat", d_pos=6, layout="split", embed_scale=2.0,
                                   padding_idx=0, offset=offsets, backend=backend)
    assert torch.equal(out, want)
    positions = torch.arange(9, device=device) * 3
    assert torch.equal(m(ids, positions=positions), pf.sinusoidal_embedding(
        ids, m.weight, mode="concat", d_pos=6, layout="split", embed_scale=2.0, padding_idx=0,
        positions=positions, backend=backend))


class TinyModel(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.embed = pf.SinusoidalEmbedding(64, 16, **kwargs)
        self.proj = nn.Linear(16, 3)

    def forward(self, ids, offset):
        return self.proj(self.embed(ids, offset=offset)).square().mean()


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kwargs", [dict(), dict(mode="concat", d_pos=5, layout="split", padding_idx=0)],
                         ids=["add", "concat"])
def test_compile_fullgraph_matches_eager(kwargs, compiler):
    torch.manual_seed(0)
    model = TinyModel(**kwargs)
    ids = torch.randint(0, 64, (2, 12))
    offsets = torch.tensor([3, 70])
    eager_loss = model(ids, offsets)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=compiler)
    loss = compiled(ids, offsets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_autocast_keeps_the_weight_dtype_like_nn_embedding(backend, device):
    layer = pf.SinusoidalEmbedding(20, 8, backend=backend).to(device)
    reference = nn.Embedding(20, 8).to(device)
    ids = torch.randint(0, 20, (2, 5), device=device)
    autocast_dtype = torch.bfloat16 if device == "cpu" else torch.float16
    with torch.autocast(device_type=device, dtype=autocast_dtype):
        out = layer(ids)
        assert out.dtype == reference(ids).dtype == torch.float32
    torch.testing.assert_close(out, layer(ids))


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = pf.SinusoidalEmbedding(64, 16, embed_scale=4.0, padding_idx=0)
        self.encoder = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 64)

    def forward(self, ids, offset):
        return self.head(self.encoder(self.embed(ids, offset=offset)))


def test_compile_fullgraph_small_transformer():
    torch.manual_seed(0)
    model = TinyTransformer()
    ids = torch.randint(0, 64, (3, 10))
    offsets = torch.tensor([0, 5, 1000])
    targets = torch.randint(0, 64, (3, 10))
    loss_fn = lambda m: nn.functional.cross_entropy(m(ids, offsets).reshape(-1, 64), targets.reshape(-1))  # noqa: E731
    eager_loss = loss_fn(model)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = loss_fn(compiled)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
