"""The layer under data and sequence parallelism, on CPU (gloo).

DDP and FSDP2 (fully_shard): two processes, each with half the batch, end a few SGD steps with the same weights
as one process on the whole batch.  Context parallel: each rank holds a slice of the
sequence and passes its start as ``offset``; the slices concatenate to the unsharded output.
"""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import posenc_fast as pf

STEPS, BATCH, SEQ, VOCAB, D = 3, 4, 10, 50, 12


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = pf.SinusoidalEmbedding(VOCAB, D, mode="concat", d_pos=4, embed_scale=2.0, padding_idx=0)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        return self.head(self.embed(ids))


def _data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)
    return ids, targets


def _train(model, ids, targets, rank_slice=slice(None)):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        logits = model(ids[step, rank_slice])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets[step, rank_slice].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wrap_ddp(model):
    return nn.parallel.DistributedDataParallel(model)


def _wrap_fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A CPU mesh named explicitly: fully_shard's default mesh is on the GPU wherever there is one,
    # which would move the model there while the data stays on the CPU.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run_gloo_rank(rank, world, port, work, *args):
    """mp.spawn's target: join a gloo group, run ``work(rank, world, *args)``, tear down, leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        work(rank, world, *args)
    finally:
        # Both ranks finish every collective before either tears gloo down: without the barrier
        # a rank that exits first aborts the other's gloo threads ("terminate called without an
        # active exception", seen in about 1 run in 3).
        dist.barrier()
        dist.destroy_process_group()
    # Even after the barrier and destroy, gloo's worker threads can still be joinable when the
    # interpreter finalises, and std::thread's destructor then aborts the process (CI saw it once
    # in a loaded full run: rank 1 SIGABRT after its work was done).  That is torch's teardown, not
    # this layer; the work and the teardown succeeded, so leave without finalising.  An exception
    # above still reaches mp.spawn as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train_rank(rank, world, wrap, initial, result_path):
    """One rank: its share of each batch, through the wrapper; rank 0 saves the full final weights."""
    model = TinyModel()
    model.load_state_dict(initial)
    wrapped = wrap(model)
    ids, targets = _data()
    per_rank = BATCH // world
    _train(wrapped, ids, targets, slice(rank * per_rank, (rank + 1) * per_rank))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, result_path)


def _assert_two_ranks_match_one_process(wrap, tmp_path):
    torch.manual_seed(0)
    reference_model = TinyModel()
    initial = {k: v.clone() for k, v in reference_model.state_dict().items()}
    ids, targets = _data()
    expected = _train(reference_model, ids, targets)
    result_path = str(tmp_path / "final.pt")
    mp.spawn(run_gloo_rank, args=(2, _free_port(), _train_rank, wrap, initial, result_path), nprocs=2, join=True)
    got = torch.load(result_path)
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_two_processes_match_one_process_on_the_whole_batch(tmp_path):
    _assert_two_ranks_match_one_process(_wrap_ddp, tmp_path)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp2_two_processes_match_one_process_on_the_whole_batch(tmp_path):
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 (fully_shard) is not in this torch")
    _assert_two_ranks_match_one_process(_wrap_fsdp2, tmp_path)


@pytest.mark.parametrize("ranks", [2, 3])
def test_context_parallel_slices_concatenate_to_the_unsharded_output(ranks):
    """Rank r holds tokens [start_r, end_r) of every sequence and passes start_r (or one start
    per sequence when the sequences themselves start at different positions)."""
    torch.manual_seed(0)
    layer = pf.SinusoidalEmbedding(VOCAB, D, layout="split", embed_scale=3.0)
    ids = torch.randint(0, VOCAB, (BATCH, 12))
    sequence_starts = torch.tensor([0, 7, 100, 2**20])
    whole = layer(ids, offset=sequence_starts)
    bounds = torch.linspace(0, 12, ranks + 1).long().tolist()
    pieces = [layer(ids[:, a:b], offset=sequence_starts + a) for a, b in zip(bounds[:-1], bounds[1:])]
    assert torch.equal(torch.cat(pieces, dim=1), whole)
    plain_pieces = [layer(ids[:, a:b], offset=a) for a, b in zip(bounds[:-1], bounds[1:])]
    assert torch.equal(torch.cat(plain_pieces, dim=1), layer(ids))
