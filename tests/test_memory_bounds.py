"""Kernels read and write only inside their tensors, on every backend.

Outputs are views into larger buffers whose guard zones must stay untouched; tables are views into
NaN-padded storage, so that a read outside the table shows up in the output; inputs come with odd strides
(transposed ids, strided offsets, expanded and column-sliced tables).  The CPU kernel's positions are read
from a tensor that ends at a page with no access.
"""

import math
import subprocess
import sys

import pytest
import torch

import posenc_fast as pf
from posenc_fast import reference
from posenc_fast._dispatch import BACKENDS
from posenc_fast.backends import cpu_backend

from cases import assert_within, backend_targets, output_bound

TARGETS = backend_targets()


def _exact(ids, weight, **kwargs):
    return reference.sinusoidal_embedding(ids, weight.double(), **kwargs)


GUARD = 64  # elements of guard zone on each side of every kernel-written buffer
SENTINEL = 1234.5


@pytest.fixture
def guarded_buffers(monkeypatch):
    """Kernel outputs become views into larger buffers; returns a check that every guard zone is intact."""
    from posenc_fast import backends

    handed_out = []

    def new_buffer(shape, dtype, device):
        numel = math.prod(shape)
        storage = torch.full((numel + 2 * GUARD,), SENTINEL, dtype=dtype, device=device)
        storage[GUARD:GUARD + numel] = float("nan")
        handed_out.append((storage, numel))
        return storage[GUARD:GUARD + numel].view(shape)

    for module in (backends, *BACKENDS.values()):  # every backend that allocates kernel outputs
        if hasattr(module, "new_buffer"):
            monkeypatch.setattr(module, "new_buffer", new_buffer)

    def check(backend):
        assert handed_out or backend == "torch", "no kernel buffer was allocated"  # torch: plain torch ops
        for storage, numel in handed_out:
            guards = torch.cat([storage[:GUARD], storage[GUARD + numel:]])
            assert bool((guards == SENTINEL).all()), "a kernel wrote outside its buffer"

    return check


def _padded_table(rows, width, dtype, device, generator):
    """A [rows, width] table that is a view into NaN-filled storage (NaN rows before and after, NaN columns
    right of each row): any read outside the table shows up as NaN in the output."""
    storage = torch.full((rows + 4, width + 3), float("nan"), dtype=torch.float64)
    storage[2:rows + 2, :width] = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    return storage.to(dtype).to(device)[2:rows + 2, :width]


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("mode,d_pos,layout", [("add", None, "interleaved"), ("concat", 5, "split"),
                                               ("add", None, "split_cos_first")])
def test_kernels_stay_inside_their_tensors(mode, d_pos, layout, backend, device, guarded_buffers, seed):
    """Guard zones around every kernel output, NaN around the table, odd strides on every input."""
    g = torch.Generator().manual_seed(seed)
    d_model, vocab = 13, 17
    token_width = d_model - (d_pos or 0)
    weight = _padded_table(vocab, token_width, torch.float32, device, g).requires_grad_()
    ids = torch.randint(0, vocab, (9, 3), generator=g).to(device).t()  # non-contiguous
    offset = torch.randint(-1000, 1000, (6,), generator=g).to(device)[::2]  # strided
    out = pf.sinusoidal_embedding(ids, weight, mode=mode, d_pos=d_pos, layout=layout, offset=offset,
                                  padding_idx=2, backend=backend)
    exact = _exact(ids.cpu(), weight.detach().cpu(), mode=mode, d_pos=d_pos, layout=layout, offset=offset.cpu(),
                   padding_idx=2)
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), f"{backend} guarded forward")
    grad_out = torch.randn(out.shape, generator=g).to(device).transpose(0, 1).contiguous().transpose(0, 1)
    (grad,) = torch.autograd.grad(out, weight, grad_out)
    w64 = weight.detach().cpu().double().requires_grad_()
    (want,) = torch.autograd.grad(reference.sinusoidal_embedding(ids.cpu(), w64, mode=mode, d_pos=d_pos, layout=layout,
                                                                 offset=offset.cpu(), padding_idx=2),
                                  w64, grad_out.cpu().double())
    torch.testing.assert_close(grad.cpu().double(), want, rtol=1e-5, atol=1e-5)
    guarded_buffers(backend)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_expanded_and_offset_tables(backend, device, seed):
    """A table with row stride 0 (expand) and a column slice (row stride wider than the row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (2, 7), generator=g).to(device)
    for weight in (torch.randn(1, 8, generator=g).expand(6, 8), torch.randn(6, 20, generator=g)[:, 5:13]):
        weight = weight.to(device)
        out = pf.sinusoidal_embedding(ids, weight, backend=backend)
        exact = _exact(ids.cpu(), weight.cpu())
        assert_within(out.cpu(), exact, output_bound(exact, torch.float32), f"{backend} strided table")


_POSITIONS_AT_A_GUARD_PAGE = """
import ctypes, mmap, torch
from posenc_fast import ops
from posenc_fast._validate import make_spec
page = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
base = libc.mmap(None, 2 * page, 3, 0x22, -1, 0)  # read-write, private and anonymous
assert libc.mprotect(base + page, page, 0) == 0  # the second page: no access
n, seq_len, width = 25, 10, 4096
positions = torch.frombuffer((ctypes.c_int64 * n).from_address(base + page - 8 * n), dtype=torch.int64)
positions.copy_(torch.arange(n) % seq_len)  # the tensor's last byte is the page's
torch.set_num_threads(2)
spec = make_spec(20, width, "add", None, 10000.0, "interleaved", 1.0, 1.0, None)
out = ops.sinusoidal_embedding_op(torch.randint(0, 20, (n,)), torch.randn(20, width), spec.turns_tensor(torch.device("cpu")),
    positions, None, 0, seq_len, False, width, spec.columns.as_list(), 1.0, 1.0, -1, False, False, 0, 20, None, 0.0,
    backend="cpu")
print("inside", tuple(out.shape))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="maps a guard page with Linux's mmap flags")
def test_cpu_positions_with_a_short_last_sequence_stay_inside_the_tensor():
    """A direct op call may cut 25 tokens into sequences of 10 (the last one short) and give a positions
    tensor.  The CPU kernel takes it by sequence and column (position-major); on 2 threads at width 4096
    the short sequence is a group of its own, whose columns past its end have no token and must not be
    read.  The tensor ends at a page with no access: a read past it kills the subprocess."""
    if cpu_backend.extension() is None:
        pytest.skip("no CPU extension here")
    result = subprocess.run([sys.executable, "-c", _POSITIONS_AT_A_GUARD_PAGE], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "inside (25, 4096)" in result.stdout, (result.returncode, result.stderr[-2000:])
