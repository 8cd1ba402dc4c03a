"""SinusoidalEmbedding: shapes, initialisation (also deferred, from the meta device), casts, equivalence with
the functional op, compile (also with dynamic shapes), state dict, threads sharing one layer.

Its constructor's refusals of bad arguments: tests/test_validation.py.
"""

import pickle
import re
import threading

import pytest
import torch
from torch import nn

import posenc_fast as pf
from posenc_fast import reference

from cases import assert_within, backend_targets, output_bound, targets

TARGETS = backend_targets()


def _exact(ids, weight, **kwargs):
    return reference.sinusoidal_embedding(ids, weight.double(), **kwargs)


@pytest.mark.parametrize("mode,d_pos,table_width", [("add", None, 24), ("concat", 8, 16), ("concat", 23, 1)])
def test_weight_and_output_shapes(mode, d_pos, table_width):
    m = pf.SinusoidalEmbedding(50, 24, mode=mode, d_pos=d_pos)
    assert m.weight.shape == (50, table_width)
    out = m(torch.randint(0, 50, (3, 7)))
    assert out.shape == (3, 7, 24)
    # nn.Embedding's attribute names, for code written for one: the output rows' width
    assert (m.num_embeddings, m.embedding_dim) == (50, out.shape[-1])


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


def test_repr_names_each_setting_that_is_not_its_default():
    assert repr(pf.SinusoidalEmbedding(10, 8)) == "SinusoidalEmbedding(10, 8, mode='add', layout='interleaved')"
    assert repr(pf.SinusoidalPositionalEncoding(8)) == "SinusoidalPositionalEncoding(8, layout='interleaved')"
    layers = [pf.SinusoidalEmbedding(10, 8, base=500), pf.SinusoidalEmbedding.from_preset("whisper", 10, 8, base=500),
              pf.SinusoidalPositionalEncoding(8, base=500.0)]
    for layer in layers + [pickle.loads(pickle.dumps(layer)) for layer in layers]:
        assert re.search(r"base=500[,)]", repr(layer)), repr(layer)
    older = pf.SinusoidalEmbedding(10, 8)
    del older.__dict__["base"]  # a module pickled before it kept its base: the default, not shown
    assert "base" not in repr(older)


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


# -- deferred initialisation and casts keep the positional encoding (built from the spec, not a buffer) --

def _layer_matches_reference(m, device, seed, dtype=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (2, 6), generator=g).to(device)
    offset = 1000
    out = m(ids, offset=offset)
    exact = _exact(ids.cpu(), m.weight.detach().cpu(), offset=offset, layout=m.spec.layout, padding_idx=m.padding_idx)
    dtype = dtype or m.weight.dtype
    assert out.dtype == dtype
    assert_within(out.cpu(), exact, output_bound(exact, dtype), "layer after init/cast")


@pytest.mark.parametrize("backend,device", TARGETS)
def test_meta_device_deferred_init(backend, device, seed):
    source = pf.SinusoidalEmbedding(11, 8, padding_idx=0)
    m = pf.SinusoidalEmbedding(11, 8, padding_idx=0, device="meta", backend=backend)
    m.to_empty(device=device)
    m.load_state_dict(source.state_dict())
    _layer_matches_reference(m, device, seed)
    # FSDP2-style: to_empty, then reset_parameters (no state dict)
    m = pf.SinusoidalEmbedding(11, 8, layout="split", device="meta", backend=backend)
    m.to_empty(device=device)
    m.reset_parameters()
    assert m.weight.std() > 0.5
    _layer_matches_reference(m, device, seed)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("cast", ["type_float32", "half", "bfloat16", "to_dtype", "double_then_float"])
def test_module_casts_keep_the_positional_encoding(cast, backend, device, seed):
    m = pf.SinusoidalEmbedding(11, 8, backend=backend).to(device)
    if cast == "type_float32":
        m.type(torch.float32)
    elif cast == "half":
        m.half()
    elif cast == "bfloat16":
        m.bfloat16()
    elif cast == "to_dtype":
        m.to(torch.float16)
    else:
        m.double().float()
    assert list(m.state_dict()) == ["weight"] and not list(m.buffers())
    _layer_matches_reference(m, device, seed)


def test_meta_tensors_give_meta_results():
    """Shape inference on the meta device: no values, so no id or cu_seqlens check, and no kernel."""
    ids = torch.zeros(2, 3, dtype=torch.int64, device="meta")
    out = pf.sinusoidal_embedding(ids, torch.empty(10, 8, device="meta"),
                                  cu_seqlens=torch.tensor([0, 3], device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3, 8)
    m = pf.SinusoidalEmbedding(10, 8, mode="concat", d_pos=3, device="meta")
    assert m(ids).shape == (2, 3, 8)


def test_compile_dynamic_shapes_with_default_arguments():
    torch.manual_seed(0)
    m = pf.SinusoidalEmbedding(50, 16)
    for fn in (m, lambda ids: pf.sinusoidal_embedding(ids, m.weight)):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
        for shape in [(2, 7), (3, 5), (1, 11)]:
            ids = torch.randint(0, 50, shape)
            out = compiled(ids)
            (grad,) = torch.autograd.grad(out.square().sum(), m.weight)
            exact = _exact(ids, m.weight.detach())
            assert_within(out.detach(), exact, output_bound(exact, torch.float32), f"compiled {shape}")
            (want,) = torch.autograd.grad(fn(ids).square().sum(), m.weight)
            torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("backend,device", targets(
    slow_on_interpreter="eight threads through the interpreter, whose launches are serialised: ~7 s"))
def test_threads_share_one_module(backend, device):
    torch.manual_seed(0)
    m = pf.SinusoidalEmbedding(50, 16, layout="split", backend=backend).to(device)
    inputs = [torch.randint(0, 50, (2, 5 + k), device=device) for k in range(8)]
    with torch.no_grad():
        expected = [m(ids) for ids in inputs]
    failures = []

    def work(k):
        try:
            with torch.no_grad():
                if not torch.equal(m(inputs[k]), expected[k]):
                    failures.append((k, "differs"))
            if k % 2:  # forward and backward with autograd in some threads
                (grad,) = torch.autograd.grad(m(inputs[k]).sum(), m.weight)
                if not bool(torch.isfinite(grad).all()):
                    failures.append((k, "gradient"))
        except Exception as error:  # reported below, with the thread that raised it
            failures.append((k, repr(error)))

    for _ in range(2):
        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, failures
