"""``sparse=True``: the weight's gradient as ``nn.Embedding(sparse=True)`` makes it (one row per token,
uncoalesced, the padding row's left out), on every backend target, against nn.Embedding and the float64
reference; deterministic; out-of-range ids left out; with SparseAdam and SGD."""

import pytest
import torch

import posenc_fast as pf
from posenc_fast import _dropout, reference

from cases import assert_within, backend_targets

TARGETS = backend_targets()
VOCAB, WIDTH = 60, 12


def _inputs(seed, device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    ids[0, :4] = 5  # a run of one id, and the padding row below
    ids[1, 2] = 7
    weight = torch.randn(VOCAB, WIDTH, generator=g)
    grad_out = torch.randn(3, 9, WIDTH, generator=g)
    return ids.to(device), weight.to(device), grad_out.to(device)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("padding_idx", [None, 7])
@pytest.mark.parametrize("entry", ["module", "functional"])
def test_sparse_gradient_matches_nn_embedding_and_float64(entry, padding_idx, backend, device, seed):
    ids, weight, grad_out = _inputs(seed, device)
    kwargs = dict(embed_scale=1.5, padding_idx=padding_idx, offset=3)
    if entry == "module":
        layer = pf.SinusoidalEmbedding.from_pretrained(weight.clone(), embed_scale=1.5, padding_idx=padding_idx,
                                                       sparse=True, backend=backend)
        leaf, out = layer.weight, layer(ids, offset=3)
    else:
        leaf = weight.clone().requires_grad_(True)
        out = pf.sinusoidal_embedding(ids, leaf, sparse=True, backend=backend, **kwargs)
    out.backward(grad_out)
    grad = leaf.grad
    assert grad.is_sparse and grad.shape == weight.shape and grad.dtype == weight.dtype
    # nn.Embedding(sparse=True) on the same table (the scale applied to its output): the same entries, one per
    # token in token order, the padding row's left out; values equal, as both are 1.5 * grad_out's rows.
    embedding = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=padding_idx, sparse=True)
    (embedding(ids) * 1.5).backward(grad_out)
    theirs = embedding.weight.grad
    assert not grad.is_coalesced() and torch.equal(grad._indices(), theirs._indices())
    assert torch.equal(grad._values(), theirs._values())
    # The float64 reference's dense gradient, padding row zeroed as nn.Embedding does.
    exact_leaf = weight.double().cpu().requires_grad_(True)
    reference.sinusoidal_embedding(ids.cpu(), exact_leaf, **kwargs).backward(grad_out.double().cpu())
    exact = exact_leaf.grad
    if padding_idx is not None:
        exact[padding_idx] = 0
    err = (grad.to_dense().double().cpu() - exact).abs()
    assert bool((err <= 1e-5 * (1 + exact.abs())).all()), err.max()


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("mode,d_pos", [("add", None), ("concat", 5)])
def test_sparse_gradient_with_dropout_is_deterministic_and_sums_to_the_dense_one(mode, d_pos, backend, device, seed):
    """With dropout, the values are the forward's kernel on grad_out's token columns (the same mask): bitwise
    the same on every run, the float64 reference's masked rows, and summed per row the dense gradient."""
    ids, weight, _ = _inputs(seed, device)
    width = WIDTH + (d_pos or 0)
    grad_out = torch.randn(*ids.shape, width, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    kwargs = dict(mode=mode, d_pos=d_pos, embed_scale=1.5, dropout_p=0.3, backend=backend)

    def gradient(sparse, create_graph=False):
        leaf = weight.clone().requires_grad_(True)
        torch.manual_seed(seed)  # the dropout seed
        out = pf.sinusoidal_embedding(ids, leaf, sparse=sparse, **kwargs)
        (grad,) = torch.autograd.grad(out, leaf, grad_out.clone().requires_grad_(create_graph), create_graph=create_graph)
        return grad

    first, second = gradient(True), gradient(True)
    assert torch.equal(first._indices(), second._indices()) and torch.equal(first._values(), second._values())
    assert torch.equal(first._indices()[0], ids.reshape(-1).to(torch.int64))
    # The reference's rows: 1.5 * keep * scale * grad_out's token columns, the mask of the forward's seed.
    torch.manual_seed(seed)
    keep = reference.dropout_keep(_dropout.draw_seed(torch.device(device)), ids.numel(), WIDTH, _dropout.threshold_of(0.3))
    exact = torch.where(keep, grad_out.reshape(-1, width)[:, :WIDTH].double() * (1.5 * _dropout.scale_of(0.3)), 0.0)
    assert_within(first._values(), exact, 1e-6 + 2**-22 * exact.abs(), f"sparse values {backend}")
    # The same values where a graph is recorded (double backward), from the reference's mask.
    assert torch.allclose(gradient(True, create_graph=True)._values(), first._values(), rtol=1e-6, atol=1e-7)
    dense = gradient(False)
    summed = first.coalesce().to_dense()
    assert_within(summed, dense.double(), 1e-5 * (1 + dense.abs().double()), f"sparse sum {backend}")


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_a_broadcast_gradient_gives_the_same_sparse_gradient(dropout_p, backend, device, seed):
    """``out.sum()`` gives one gradient row broadcast to every token (row stride 0): the sparse gradient is
    the one the same gradient gives when it is materialised, dropout mask included."""
    ids, weight, _ = _inputs(seed, device)

    def gradient(broadcast):
        leaf = weight.clone().requires_grad_(True)
        torch.manual_seed(seed)  # the dropout seed
        out = pf.sinusoidal_embedding(ids, leaf, sparse=True, dropout_p=dropout_p, embed_scale=2.0, backend=backend)
        if broadcast:
            return torch.autograd.grad(out.sum(), leaf)[0]
        return torch.autograd.grad(out, leaf, torch.ones_like(out))[0]

    expanded, materialised = gradient(True), gradient(False)
    assert torch.equal(expanded._indices(), materialised._indices())
    assert torch.equal(expanded._values(), materialised._values())


@pytest.mark.parametrize("backend,device", TARGETS)
def test_a_bfloat16_table_gets_nn_embeddings_gradient(backend, device, seed):
    ids, weight, grad_out = _inputs(seed, device)
    weight, grad_out = weight.bfloat16(), grad_out.bfloat16()
    layer = pf.SinusoidalEmbedding.from_pretrained(weight.clone(), embed_scale=1.5, padding_idx=7, sparse=True,
                                                   backend=backend)
    layer(ids).backward(grad_out)
    embedding = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=7, sparse=True)
    (embedding(ids) * 1.5).backward(grad_out)
    ours, theirs = layer.weight.grad, embedding.weight.grad
    assert ours.dtype == torch.bfloat16 and torch.equal(ours._indices(), theirs._indices())
    assert torch.equal(ours._values(), theirs._values())


@pytest.mark.parametrize("backend,device", TARGETS)
def test_torch_func_grad_gives_the_eager_sparse_gradient_with_dropout(backend, device, seed):
    """Under torch.func the gradient's tensors are functorch wrappers, which no kernel reads: the dropout mask
    comes from torch ops there, and the gradient is the eager one."""
    ids, weight, _ = _inputs(seed, device)
    weights = torch.arange(WIDTH, dtype=torch.float32, device=device)

    def loss(w):
        torch.manual_seed(seed)  # the dropout seed
        return (pf.sinusoidal_embedding(ids, w, sparse=True, dropout_p=0.3, backend=backend) * weights).sum()

    transformed = torch.func.grad(loss)(weight.clone())
    leaf = weight.clone().requires_grad_(True)
    loss(leaf).backward()
    torch.testing.assert_close(transformed.to_dense(), leaf.grad.to_dense(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_out_of_range_ids_with_the_check_off_get_nothing(backend, device):
    ids, weight, grad_out = _inputs(0, device)
    ids[2, 0], ids[2, 1] = VOCAB + 3, -1

    def gradient(sparse):
        leaf = weight.clone().requires_grad_(True)
        with pf.id_check(False):
            pf.sinusoidal_embedding(ids, leaf, sparse=sparse, backend=backend).backward(grad_out)
        return leaf.grad

    sparse_grad = gradient(True)
    kept = (ids.reshape(-1) >= 0) & (ids.reshape(-1) < VOCAB)
    assert torch.equal(sparse_grad._indices()[0], ids.reshape(-1)[kept])
    torch.testing.assert_close(sparse_grad.to_dense(), gradient(False), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_ids_unchecked_in_the_forward_are_left_out_after_the_check_is_back_on(backend, device):
    """Whether the ids were range-checked is taken at the forward: a backward after the check is back on
    still leaves out the out-of-range ids it let through."""
    ids, weight, grad_out = _inputs(0, device)
    ids[1, 3] = VOCAB + 9
    layer = pf.SinusoidalEmbedding.from_pretrained(weight.clone(), sparse=True, backend=backend)
    leaf = weight.clone().requires_grad_(True)
    for entry, call, table in (("functional", lambda: pf.sinusoidal_embedding(ids, leaf, sparse=True, backend=backend),
                                leaf), ("module", lambda: layer(ids), layer.weight)):
        with pf.id_check(False):
            for _ in range(2):  # through the entry point's prepared launch (made by the first call)
                out = call()
        out.backward(grad_out)
        assert bool((table.grad._indices() < VOCAB).all()), entry


@pytest.mark.parametrize("optimizer", ["SparseAdam", "SGD"])
def test_optimizer_steps_like_nn_embedding(optimizer, seed):
    """A few training steps with sparse gradients move the table exactly as nn.Embedding(sparse=True)
    does with the same optimizer (the PE adds a constant: the same gradients)."""
    ids, weight, _ = _inputs(seed, "cpu")
    layer = pf.SinusoidalEmbedding.from_pretrained(weight.clone(), sparse=True)
    embedding = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=True)
    make = {"SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=0.01), "SGD": lambda p: torch.optim.SGD(p, lr=0.1)}
    ours, theirs = make[optimizer]([layer.weight]), make[optimizer](list(embedding.parameters()))
    target = torch.randn(3, 9, WIDTH, generator=torch.Generator().manual_seed(seed))
    pe = pf.sinusoidal_embedding(ids, torch.zeros(VOCAB, WIDTH))  # what the fused layer adds
    for _ in range(3):
        for opt, out in ((ours, lambda: layer(ids)), (theirs, lambda: embedding(ids) + pe)):
            opt.zero_grad()
            ((out() - target) ** 2).sum().backward()
            opt.step()
    torch.testing.assert_close(layer.weight.detach(), embedding.weight.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
def test_padding_past_the_id_dtype_leaves_every_id_its_row(ids_dtype, seed):
    """A padding_idx that int32 ids cannot hold (a vocabulary past 2^32) pads nothing: compared as an int32 it
    would wrap onto a small id (2^32 + 7 onto 7) and drop that id's row.  The gradient op is called directly:
    the sparse tensor's vocabulary is only a size, and its values are one row per token."""
    from posenc_fast import ops

    vocab = 2**32 + 100
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([7, 3, 7, 9, 2**31 - 1], dtype=ids_dtype)
    grad_out = torch.randn(ids.numel(), WIDTH, generator=g)
    grad = ops.sparse_weight_gradient(grad_out, ids, vocab, WIDTH, 2.0, 2**32 + 7, torch.float32, None, 0.0, "cpu",
                                      ids_in_range=True)
    assert grad._indices()[0].tolist() == ids.tolist()
    assert torch.equal(grad._values(), grad_out * 2.0)


def test_sparse_is_refused_where_it_cannot_be_computed():
    weight = torch.randn(VOCAB, WIDTH, requires_grad=True)
    with pytest.raises(TypeError, match="sparse must be a bool"):
        pf.sinusoidal_embedding(torch.zeros(2, 3, dtype=torch.int64), weight, sparse=1)
    with pytest.raises(TypeError, match="sparse must be a bool"):
        pf.SinusoidalEmbedding(VOCAB, WIDTH, sparse="yes")
    compiled = torch.compile(lambda i, w: pf.sinusoidal_embedding(i, w, sparse=True), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="sparse=True gradients are computed on plain eager calls only"):
        compiled(torch.zeros(2, 3, dtype=torch.int64), weight)


def test_repr_shows_sparse():
    assert "sparse=True" in repr(pf.SinusoidalEmbedding(VOCAB, WIDTH, sparse=True))


def _edge_case(name, device, backend, sparse):
    """(ids, layer) of each edge case; the layer's table is the same random one whatever ``sparse``."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB, WIDTH, generator=g).to(device)
    ids = torch.randint(0, VOCAB, (2, 5), generator=g).to(device)
    common = dict(sparse=sparse, backend=backend, embed_scale=2.0)
    if name == "vocab_shard":  # rows 20..59 of the vocabulary on this shard: ids stay global
        layer = pf.SinusoidalEmbedding(VOCAB, WIDTH, vocab_range=(20, VOCAB), padding_idx=25, **common).to(device)
        with torch.no_grad():
            layer.weight.copy_(weight[20:])
        return ids, layer
    if name == "one_token_concat":  # one row of a concat output's gradient, sliced: its stride is the output's width
        layer = pf.SinusoidalEmbedding.from_pretrained(weight, mode="concat", d_pos=5, sparse=sparse, backend=backend)
        return torch.tensor([6], device=device), layer
    ids = {"empty": ids[:, :0], "all_padding": torch.full((2, 5), 4, device=device),
           "int32": ids.to(torch.int32), "zero_dim": ids[0, 0]}[name]
    padding_idx = 4 if name == "all_padding" else None
    return ids, pf.SinusoidalEmbedding.from_pretrained(weight, padding_idx=padding_idx, **common)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("name", ["empty", "all_padding", "int32", "zero_dim", "vocab_shard", "one_token_concat"])
def test_sparse_gradient_edge_cases_equal_the_dense_one(name, backend, device):
    """Empty and 0-d ids, every token padding, int32 ids, a vocabulary shard (other shards' ids and the
    padding row get nothing) and one token in concat mode (no scale: the values are grad_out's token columns):
    the sparse gradient equals the dense one, holds no row outside the table, and a double backward through
    it equals the dense one's."""

    def gradients(sparse):
        ids, layer = _edge_case(name, device, backend, sparse)
        out = layer(ids)
        (grad,) = torch.autograd.grad((out * out).sum(), layer.weight, create_graph=True)
        (second,) = torch.autograd.grad((grad.to_dense() if sparse else grad).pow(2).sum(), layer.weight)
        return grad, second

    sparse_grad, sparse_second = gradients(True)
    dense_grad, dense_second = gradients(False)
    assert sparse_grad.is_sparse
    assert torch.equal(sparse_grad.to_dense().detach(), dense_grad.detach())
    torch.testing.assert_close(sparse_second.to_dense(), dense_second.to_dense(), atol=1e-5, rtol=1e-5)
    rows = sparse_grad.coalesce().indices()[0].tolist()
    assert rows == sorted(set(rows)) and all(0 <= r < dense_grad.shape[0] for r in rows)
