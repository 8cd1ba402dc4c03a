"""Vocabulary-parallel shards (``SinusoidalEmbedding(..., vocab_range=(start, end))``).

The shards' outputs sum (what an all-reduce does) to the unsharded layer, each shard's weight
gradient is its rows of the unsharded gradient, and ids are range-checked globally.  Run on
every backend, and once as two real gloo ranks.
"""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import posenc_fast as pf

from cases import backend_targets
from test_distributed import _free_port, run_gloo_rank

TARGETS = backend_targets()
VOCAB, D = 50, 12
BOUNDS = [0, 20, 37, 50]


def _full_and_shards(backend, device, **kwargs):
    torch.manual_seed(0)
    full = pf.SinusoidalEmbedding(VOCAB, D, backend=backend, **kwargs).to(device)
    shards = []
    for start, end in zip(BOUNDS[:-1], BOUNDS[1:]):
        shard = pf.SinusoidalEmbedding(VOCAB, D, vocab_range=(start, end), backend=backend, **kwargs).to(device)
        with torch.no_grad():
            shard.weight.copy_(full.weight[start:end])
        shards.append(shard)
    return full, shards


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("kwargs", [dict(embed_scale=2.0, padding_idx=25), dict(mode="concat", d_pos=5, layout="split"),
                                    dict(mode="concat", d_pos=5, dropout=0.4)],
                         ids=["add", "concat", "dropout"])
def test_shards_sum_to_the_unsharded_layer(backend, device, kwargs):
    """With dropout, the shards draw the same seed (same RNG state), hence the same mask."""
    full, shards = _full_and_shards(backend, device, **kwargs)
    ids = torch.randint(0, VOCAB, (3, 14), device=device)
    offsets = torch.tensor([0, 9, 2**20], device=device)
    grad_out = torch.randn(3, 14, D, device=device)

    def call(layer):
        torch.manual_seed(1)
        return layer(ids, offset=offsets)

    expected = call(full)
    (expected_grad,) = torch.autograd.grad(expected, full.weight, grad_out)
    outputs = [call(shard) for shard in shards]
    # Each shard rounds its part once, the sum adds once more: within fp32 rounding of the whole.
    torch.testing.assert_close(sum(outputs), expected, rtol=2**-21, atol=1e-6)
    for shard, out, (start, end) in zip(shards, outputs, zip(BOUNDS[:-1], BOUNDS[1:])):
        (grad,) = torch.autograd.grad(out, shard.weight, grad_out)
        torch.testing.assert_close(grad, expected_grad[start:end], rtol=1e-6, atol=1e-6)
    if "padding_idx" in kwargs:
        assert shards[1].padding_idx == 5 and shards[0].padding_idx is None


def test_from_pretrained_loads_a_shard_from_its_rows():
    """A shard loaded from its rows of a checkpoint (from_pretrained with vocab_range and the whole
    vocabulary's size) is the shard the constructor makes; without that size, or with rows that do not
    fit the range, it is refused."""
    full, shards = _full_and_shards("torch", "cpu")
    ids = torch.randint(0, VOCAB, (2, 9))
    for shard, (start, end) in zip(shards, zip(BOUNDS[:-1], BOUNDS[1:])):
        loaded = pf.SinusoidalEmbedding.from_pretrained(full.weight.detach()[start:end], vocab_range=(start, end),
                                                        num_embeddings=VOCAB, backend="torch")
        assert torch.equal(loaded(ids), shard(ids))
    with pytest.raises(ValueError, match="num_embeddings"):
        pf.SinusoidalEmbedding.from_pretrained(full.weight.detach()[:20], vocab_range=(0, 20))
    with pytest.raises(ValueError, match="table of 17 rows, but weight has 20"):
        pf.SinusoidalEmbedding.from_pretrained(full.weight.detach()[:20], vocab_range=(20, 37), num_embeddings=VOCAB)
    with pytest.raises(ValueError, match="table of 50 rows, but weight has 20"):
        pf.SinusoidalEmbedding.from_pretrained(full.weight.detach()[:20], num_embeddings=VOCAB)


def test_shard_checks_global_ids_and_arguments():
    _, shards = _full_and_shards("torch", "cpu")
    shards[1](torch.tensor([[0, 49, 21]]))  # ids of other shards are valid
    with pytest.raises(IndexError, match="id 50 "):
        shards[1](torch.tensor([[3, 50]]))
    with pytest.raises(IndexError, match="id -1 "):
        shards[2](torch.tensor([[-1, 40]]))
    with pytest.raises(ValueError, match="vocab_range"):
        pf.SinusoidalEmbedding(VOCAB, D, vocab_range=(30, 60))
    with pytest.raises(ValueError, match="vocab_range"):
        pf.SinusoidalEmbedding(VOCAB, D, vocab_range=(5,))
    with pytest.raises(ValueError, match="fairseq"):
        pf.SinusoidalEmbedding(VOCAB, D, vocab_range=(0, 10), padding_idx=1, position_rule="fairseq")
    assert "vocab_range=(20, 37)" in repr(shards[1])
    assert shards[1].vocab_range == (20, 37)  # reads back as given, not as the op's (start, vocabulary size)
    assert pf.SinusoidalEmbedding(VOCAB, D, vocab_range=iter((20, 37))).vocab_range == (20, 37)  # (any pair)
    # A module pickled when the attribute held the op's form reads back as given too, and computes the same.
    old = copy.deepcopy(shards[1])
    old.vocab_range = (20, VOCAB)
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded.vocab_range == (20, 37) and "vocab_range=(20, 37)" in repr(loaded)
    ids = torch.tensor([[0, 20, 36, 49]])
    assert torch.equal(loaded(ids), shards[1](ids))


def _shard_rank(rank, world, result_path):
    torch.manual_seed(0)
    full = pf.SinusoidalEmbedding(VOCAB, D, embed_scale=3.0)
    start, end = (0, 30) if rank == 0 else (30, VOCAB)
    shard = pf.SinusoidalEmbedding(VOCAB, D, embed_scale=3.0, vocab_range=(start, end))
    with torch.no_grad():
        shard.weight.copy_(full.weight[start:end])
    ids = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1))
    out = shard(ids)
    summed = out.detach().clone()
    dist.all_reduce(summed)
    grad_out = torch.randn(4, 9, D, generator=torch.Generator().manual_seed(2))
    (grad,) = torch.autograd.grad(out, shard.weight, grad_out)
    (full_grad,) = torch.autograd.grad(full(ids), full.weight, grad_out)
    result = {"sum_error": (summed - full(ids)).abs().max().item(),
              "grad_error": (grad - full_grad[start:end]).abs().max().item()}
    torch.save(result, f"{result_path}.{rank}")


def test_two_gloo_ranks_all_reduce_to_the_unsharded_layer(tmp_path):
    path = str(tmp_path / "vocab_parallel")
    mp.spawn(run_gloo_rank, args=(2, _free_port(), _shard_rank, path), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(f"{path}.{rank}")
        assert result["sum_error"] <= 1e-5 and result["grad_error"] <= 1e-6, result
