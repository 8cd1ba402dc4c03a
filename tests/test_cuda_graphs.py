"""CUDA graphs and torch.compile(mode="reduce-overhead") on a GPU (skipped without one).

The host-side id range check syncs with the device, which CUDA-graph capture forbids: the op
skips it while the current stream is capturing.  Forward and backward must capture, replay
on new ids, and give what eager gives; with dropout, each replay draws a new mask.
"""

import pytest
import torch
from torch import nn

import posenc_fast as pf

from cases import gpu_kernel_backends

GPU_BACKENDS = gpu_kernel_backends()
pytestmark = pytest.mark.skipif(not GPU_BACKENDS, reason="needs a GPU (and a GPU kernel backend)")


def _capture_forward_and_backward(layer, ids, grad_out):
    """(graph, output, weight gradient) of ``layer(ids)`` captured, after a warm-up outside the
    capture on a side stream, as CUDA graphs require."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.autograd.grad(layer(ids), layer.weight, grad_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(ids)
        (grad,) = torch.autograd.grad(out, layer.weight, grad_out)
    return graph, out, grad


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_capture_and_replay_forward_and_backward(backend):
    torch.manual_seed(0)
    assert pf.id_check_enabled(), "the check stays on: capture must skip it by itself"
    layer = pf.SinusoidalEmbedding(1000, 64, mode="concat", d_pos=16, padding_idx=0, backend=backend).cuda()
    ids = torch.randint(0, 1000, (4, 32), device="cuda")
    grad_out = torch.randn(4, 32, 64, device="cuda")
    graph, out, grad = _capture_forward_and_backward(layer, ids, grad_out)
    ids.copy_(torch.randint(0, 1000, (4, 32), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    eager_out = layer(ids)
    (eager_grad,) = torch.autograd.grad(eager_out, layer.weight, grad_out)
    assert torch.equal(out, eager_out)
    assert torch.equal(grad, eager_grad)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_capture_with_dropout_draws_a_new_mask_each_replay(backend):
    """The seed is drawn on the device inside the graph: each replay gets a fresh mask, and the
    captured backward regenerates that replay's mask (a table of ones without PE and one token per
    row make the output keep * scale, and the gradient of sum(output) the same)."""
    torch.manual_seed(0)
    layer = pf.SinusoidalEmbedding(64, 32, pe_scale=0.0, dropout=0.5, backend=backend).cuda()
    with torch.no_grad():
        layer.weight.fill_(1.0)
    ids = torch.randperm(64, device="cuda").reshape(4, 16)
    grad_out = torch.ones(4, 16, 32, device="cuda")
    graph, out, grad = _capture_forward_and_backward(layer, ids, grad_out)
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(grad[ids.reshape(-1)], out.reshape(-1, 32))
        masks.append(out != 0)
    assert not torch.equal(masks[0], masks[1]), "every replay used the same mask"


class Tiny(nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.embed = pf.SinusoidalEmbedding(500, 32, embed_scale=2.0, backend=backend)
        self.head = nn.Linear(32, 500)

    def forward(self, ids):
        return self.head(self.embed(ids))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_compile_reduce_overhead_matches_eager(backend):
    torch.manual_seed(0)
    model = Tiny(backend).cuda()
    ids = torch.randint(0, 500, (8, 16), device="cuda")
    targets = torch.randint(0, 500, (8, 16), device="cuda")

    def loss_of(m):
        return nn.functional.cross_entropy(m(ids).reshape(-1, 500), targets.reshape(-1))

    eager_loss = loss_of(model)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # the first calls record the graph, later ones replay it
        loss = loss_of(compiled)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
