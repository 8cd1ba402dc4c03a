"""Hostile and unusual input (issue 14), one regression test per finding, on every backend.

Each finding is either refused with a Python exception that names the argument and the bad value
before any kernel runs, or computed equal to the float64 reference on every backend.  Kernels are
also watched for reads and writes outside their tensors: outputs are views into larger buffers
whose guard zones must stay untouched, and tables are views into NaN-padded storage.
"""

import math
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import posenc_fast as pf
from posenc_fast import ops, reference
from posenc_fast._dispatch import BACKENDS
from posenc_fast.backends import cpu_backend
from posenc_fast._spec import MAX_ROW_WIDTH, MAX_SCALE
from posenc_fast._validate import make_spec

from cases import assert_within, backend_targets, output_bound, targets

TARGETS = backend_targets()


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail loudly if any backend's forward or backward is reached."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel ran before the input was rejected")

    for module in BACKENDS.values():
        monkeypatch.setattr(module, "forward", forbidden)
        monkeypatch.setattr(module, "backward", forbidden)


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


def _exact(ids, weight, **kwargs):
    return reference.sinusoidal_embedding(ids, weight.double(), **kwargs)


# -- 1. out-of-bounds write: a replaced weight of another width -------------------------------------

@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("mode,d_pos,new_width", [("add", None, 4), ("add", None, 12), ("concat", 3, 2),
                                                  ("concat", 3, 9)])
def test_replaced_weight_of_another_width_is_refused(mode, d_pos, new_width, backend, device, no_kernel):
    m = pf.SinusoidalEmbedding(11, 8, mode=mode, d_pos=d_pos, backend=backend).to(device)
    m.weight = nn.Parameter(torch.randn(11, new_width, device=device))
    ids = torch.randint(0, 11, (2, 5), device=device)
    with pytest.raises(ValueError, match=rf"\[11, {new_width}\]"):
        m(ids)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_replaced_weight_that_is_not_a_table_is_refused(backend, device, no_kernel):
    m = pf.SinusoidalEmbedding(11, 8, padding_idx=9, backend=backend).to(device)
    ids = torch.randint(0, 5, (2, 5), device=device)
    for weight, error, fragment in [(torch.randn(11, 8, 1), ValueError, "[11, 8, 1]"),
                                    (torch.ones(11, 8, dtype=torch.int64), TypeError, "int64"),
                                    (torch.randn(5, 8), ValueError, "padding_idx=9")]:
        m.weight = nn.Parameter(weight.to(device), requires_grad=weight.is_floating_point())
        with pytest.raises(error) as info:
            m(ids)
        assert fragment in str(info.value)


def _op_arguments(device, **changes):
    spec = make_spec(20, 8, "add", None, 10000.0, "interleaved", 1.0, 1.0, None)
    args = dict(ids=torch.randint(0, 20, (12,), device=device), weight=torch.randn(20, 8, device=device),
                turns=spec.turns_tensor(device), positions=None, offsets=None, offset=0, seq_len=4, concat=False,
                pe_width=8, pe_columns=spec.columns.as_list(), embed_scale=1.0, pe_scale=1.0, padding_idx=-1,
                zero_pe_at_padding=False, float64_math=False, vocab_start=0, vocab_size=20, dropout_seed=None,
                dropout_p=0.0)
    args.update(changes)
    return args


def _bad_op_calls(device):
    i64 = dict(dtype=torch.int64, device=device)
    return [
        ("pe_width", dict(pe_width=16)),  # the repro, at the op: PE columns beyond the output row
        ("pe_width", dict(weight=torch.randn(20, 4, device=device))),
        ("pe_width", dict(concat=True, pe_width=0)),
        ("turns", dict(turns=torch.zeros(7, **i64))),
        ("turns", dict(turns=torch.zeros(4, dtype=torch.int32, device=device))),
        ("pe_columns", dict(pe_columns=[1, 0, 8, 8, 4])),
        ("positions", dict(positions=torch.zeros(11, **i64))),
        ("positions", dict(positions=torch.zeros(12, dtype=torch.int32, device=device))),
        ("positions", dict(positions=torch.zeros(12, 2, **i64)[:, 0])),
        ("offsets", dict(offsets=torch.zeros(2, **i64))),
        ("seq_len", dict(seq_len=0)),
        ("seq_len", dict(seq_len=13)),
        ("seq_len", dict(positions=torch.zeros(12, **i64), seq_len=13)),  # positions cut by sequence too (CPU)
        ("seq_len", dict(positions=torch.zeros(12, **i64), seq_len=2**62)),
        ("ids", dict(ids=torch.zeros(4, 3, **i64))),
        ("ids", dict(ids=torch.zeros(24, **i64)[::2])),
        ("ids", dict(ids=torch.zeros(12, device=device))),
        ("weight", dict(weight=torch.randn(20, 8, 1, device=device))),
        ("dropout_seed", dict(dropout_seed=torch.zeros(2, **i64), dropout_p=0.5)),
    ]


@pytest.mark.parametrize("backend,device", TARGETS)
def test_op_refuses_tensors_that_disagree_with_its_numbers(backend, device, no_kernel):
    """Direct calls of the torch.library op: every bound a kernel uses must follow from the tensors."""
    for fragment, changes in _bad_op_calls(device):
        with pytest.raises(ValueError) as info:
            ops.sinusoidal_embedding_op(**_op_arguments(device, **changes), backend=backend)
        assert fragment in str(info.value), (fragment, str(info.value))


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


@pytest.mark.parametrize("backend,device", TARGETS)
def test_backward_op_refuses_mismatched_shapes(backend, device, no_kernel):
    ids = torch.randint(0, 20, (12,), device=device)
    for grad_out in (torch.randn(11, 8, device=device), torch.randn(12, 7, device=device),
                     torch.randn(12, 8, 1, device=device)):
        with pytest.raises(ValueError, match="grad_out"):
            ops.sinusoidal_embedding_backward_op(grad_out, ids, 20, 8, 1.0, -1, torch.float32, None, 0.0, backend)


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


# -- 2, 3. the fixed-point frequencies survive deferred init and casts -------------------------------

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


# -- 4. scales beyond the float32 range --------------------------------------------------------------

@pytest.mark.parametrize("name", ["embed_scale", "pe_scale"])
@pytest.mark.parametrize("value", [1e39, -1e39, 10**400])
def test_scales_beyond_float32_are_refused(name, value, no_kernel):
    with pytest.raises(ValueError, match=name):
        pf.SinusoidalEmbedding(11, 8, **{name: value})
    with pytest.raises(ValueError, match=name):
        pf.sinusoidal_embedding(torch.zeros(2, dtype=torch.int64), torch.randn(11, 8), **{name: value})


@pytest.mark.parametrize("backend,device", TARGETS)
def test_largest_scale_with_zero_rows_is_not_nan(backend, device):
    ids = torch.arange(6, device=device).reshape(2, 3)
    weight = torch.zeros(6, 8, device=device)
    out = pf.sinusoidal_embedding(ids, weight, embed_scale=MAX_SCALE, pe_scale=1.0, offset=0, backend=backend)
    exact = _exact(ids.cpu(), weight.cpu(), embed_scale=MAX_SCALE)
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), f"{backend} largest scale")
    # position 0 and pe_scale at the limit: sin 0 * scale = 0, cos 0 * scale = the scale itself
    out = pf.sinusoidal_embedding(ids, weight, pe_scale=MAX_SCALE, backend=backend)
    exact = _exact(ids.cpu(), weight.cpu(), pe_scale=MAX_SCALE)
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), f"{backend} largest pe_scale")


# -- 5, 12. with the id check off, out-of-range ids contribute exactly zero ---------------------------

@pytest.mark.parametrize("backend,device", TARGETS)
def test_out_of_range_ids_ignore_inf_in_row_zero(backend, device):
    weight = torch.randn(6, 8, device=device)
    weight[0] = float("inf")
    ids = torch.tensor([[1, 6, -1, 2], [10**6, 3, -(2**40), 5]], device=device)
    weight.requires_grad_()
    grad_out = torch.randn(2, 4, 8, device=device)
    grad_out[0, 1] = float("inf")  # the gradient of an out-of-range token
    grad_out[1, 2] = float("nan")
    with pf.id_check(False):
        out = pf.sinusoidal_embedding(ids, weight, backend=backend)
        (grad,) = torch.autograd.grad(out, weight, grad_out)
        ref = reference.sinusoidal_embedding(ids.cpu(), weight.detach().cpu().double())
    pe = reference.sinusoidal_table(4, 8)
    for t, s in [(0, 1), (0, 2), (1, 0), (1, 2)]:
        assert_within(out[t, s].detach().cpu(), pe[s], output_bound(pe[s], torch.float32), f"token {t, s}")
        assert torch.equal(ref[t, s], pe[s])
    assert bool(torch.isfinite(grad).all())
    assert torch.count_nonzero(grad[0]) == 0


@pytest.mark.parametrize("backend,device", TARGETS)
def test_empty_table_with_the_check_off(backend, device):
    weight = torch.zeros(0, 8, device=device, requires_grad=True)
    ids = torch.tensor([[0, 3, -1]], device=device)
    with pytest.raises(IndexError, match="table has no rows"):
        pf.sinusoidal_embedding(ids, weight, backend=backend)
    with pf.id_check(False):
        out = pf.sinusoidal_embedding(ids, weight, backend=backend)
        (grad,) = torch.autograd.grad(out.sum(), weight)
    pe = reference.sinusoidal_table(3, 8)[None]
    assert_within(out.detach().cpu(), pe, output_bound(pe, torch.float32), f"{backend} empty table")
    assert grad.shape == (0, 8)


# -- 6. cu_seqlens contents ---------------------------------------------------------------------------

BAD_CU_SEQLENS = [([0, 5, 3, 8], "decreases from 5 to 3"), ([2, 5, 8], "starts at 2"), ([0, 3, 5], "ends at 5"),
                  ([0, 3, 20], "ends at 20"), ([-4, 0, 8], "starts at -4")]


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("cu,fragment", BAD_CU_SEQLENS, ids=[str(c[0]) for c in BAD_CU_SEQLENS])
def test_bad_cu_seqlens_are_refused(cu, fragment, backend, device, no_kernel):
    ids = torch.randint(0, 10, (8,), device=device)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    with pytest.raises(ValueError) as info:
        pf.sinusoidal_embedding(ids, torch.randn(10, 6, device=device), cu_seqlens=cu_seqlens, backend=backend)
    assert fragment in str(info.value) and "cu_seqlens" in str(info.value)
    m = pf.SinusoidalEmbedding(10, 6, backend=backend).to(device)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(ids, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_cu_seqlens_unchecked_with_the_check_off(backend, device):
    """The check follows the id-check switch; unchecked contents give positions, never a bad access."""
    ids = torch.randint(0, 10, (2, 8), device=device)
    weight = torch.randn(10, 6, device=device)
    cu_seqlens = torch.tensor([0, 5, 3, 8], device=device)
    with pf.id_check(False):
        out = pf.sinusoidal_embedding(ids, weight, cu_seqlens=cu_seqlens, backend=backend)
    with pf.id_check(False):
        positions = pf.packed_positions(cu_seqlens.cpu(), 8)
    exact = _exact(ids.cpu(), weight.cpu(), positions=positions)
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), "unchecked cu_seqlens")
    good = torch.tensor([0, 3, 3, 8], device=device)  # an empty sequence is fine
    out = pf.sinusoidal_embedding(ids, weight, cu_seqlens=good, backend=backend)
    exact = _exact(ids.cpu(), weight.cpu(), positions=torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]))
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), "cu_seqlens with an empty sequence")


# -- 7, 11. frequencies and base -------------------------------------------------------------------------

@pytest.mark.parametrize("frequencies,error,fragment", [
    ("1234", TypeError, "'1234'"),
    (b"12", TypeError, "b'12'"),
    ([1.0, True, 0.5, 0.25], TypeError, "True"),
    ([1.0, "2", 0.5, 0.25], TypeError, "'2'"),
    (torch.ones(4, dtype=torch.complex64), TypeError, "complex64"),
    (torch.ones(4, device="meta"), ValueError, "meta"),
    (5, TypeError, "5"),
    ([1.0, float("inf"), 0.5, 0.25], ValueError, "inf"),
])
def test_bad_frequencies(frequencies, error, fragment, no_kernel):
    with pytest.raises(error) as info:
        pf.SinusoidalEmbedding(11, 8, frequencies=frequencies)
    assert "frequencies" in str(info.value) and fragment in str(info.value)


def test_base_whose_frequencies_overflow_is_refused_by_name(no_kernel):
    with pytest.raises(ValueError, match="base=5e-324"):
        pf.SinusoidalEmbedding(11, 64, base=5e-324)
    with pytest.raises(ValueError, match="base=5e-324"):
        pf.sinusoidal_embedding(torch.zeros(2, dtype=torch.int64), torch.randn(11, 64), base=5e-324)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_tiny_base_with_finite_frequencies(backend, device):
    """base=5e-324 at width 8: frequencies up to 1e242 rad per position are finite, and exact (turns wrap)."""
    ids = torch.randint(0, 11, (2, 5), device=device)
    weight = torch.randn(11, 8, device=device)
    out = pf.sinusoidal_embedding(ids, weight, base=5e-324, offset=12345, backend=backend)
    exact = _exact(ids.cpu(), weight.cpu(), base=5e-324, offset=12345)
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), f"{backend} tiny base")


# -- 8, 11. offsets of the fairseq position rule ---------------------------------------------------------

@pytest.mark.parametrize("offset,error,fragment", [
    (2**63, ValueError, "offset=9223372036854775808"),
    (2**64 + 5, ValueError, "offset=18446744073709551621"),
    (-(2**63) - 1, ValueError, "offset=-9223372036854775809"),
    (torch.zeros(2), TypeError, "offset must be an integer tensor, got dtype torch.float32"),
    (torch.zeros(3, dtype=torch.int64), ValueError, "offset tensor has shape [3]"),
    (1.5, TypeError, "offset must be an int"),
])
def test_fairseq_rule_checks_the_offset_by_name(offset, error, fragment, no_kernel):
    m = pf.SinusoidalEmbedding.from_preset("fairseq", 10, 8, padding_idx=1)
    with pytest.raises(error) as info:
        m(torch.randint(0, 10, (2, 5)), offset=offset)
    assert fragment in str(info.value)


def test_make_positions_checks_past_length_range():
    with pytest.raises(ValueError, match="past_length=9223372036854775808"):
        pf.make_positions(torch.ones(2, 3, dtype=torch.int64), 1, past_length=2**63)


# -- 10. the widest row ----------------------------------------------------------------------------------

def test_rows_wider_than_the_launch_limits_are_refused(no_kernel):
    with pytest.raises(ValueError, match=f"{MAX_ROW_WIDTH + 1}.*{MAX_ROW_WIDTH}"):
        pf.SinusoidalEmbedding(2, MAX_ROW_WIDTH + 1, device="meta")
    with pytest.raises(ValueError, match=f"{MAX_ROW_WIDTH + 8}"):
        pf.SinusoidalEmbedding(2, MAX_ROW_WIDTH + 8, mode="concat", d_pos=16, device="meta")
    weight = torch.empty(1, MAX_ROW_WIDTH + 2)
    with pytest.raises(ValueError, match=f"{MAX_ROW_WIDTH + 2}"):
        pf.sinusoidal_embedding(torch.zeros(1, dtype=torch.int64), weight)


# -- 11. ids of a vocabulary shard are named as given ---------------------------------------------------

@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("dtype,bad", [(torch.int32, -(2**31)), (torch.int64, -(2**63)), (torch.int32, 2**31 - 1)])
def test_shard_names_the_global_id(dtype, bad, backend, device, no_kernel):
    m = pf.SinusoidalEmbedding(10, 8, vocab_range=(4, 8), backend=backend).to(device)
    ids = torch.tensor([[5, bad, 9]], dtype=dtype, device=device)
    with pytest.raises(IndexError, match=f"id {bad} "):
        m(ids)


# -- 9. torch.compile with dynamic shapes ---------------------------------------------------------------

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


# -- 13. vmap, torch.func and double backward -----------------------------------------------------------

@pytest.mark.parametrize("backend,device", TARGETS)
def test_vmap_matches_the_batched_call(backend, device):
    m = pf.SinusoidalEmbedding(30, 8, mode="concat", d_pos=3, padding_idx=0, backend=backend).to(device)
    ids = torch.randint(0, 30, (3, 2, 5), device=device)
    offsets = torch.randint(0, 100, (3, 2), device=device)
    with torch.no_grad():
        want = m(ids, offset=offsets)
        assert torch.equal(torch.vmap(lambda i, o: m(i, offset=o))(ids, offsets), want)
    assert torch.equal(torch.vmap(m)(ids).detach(), m(ids).detach())
    with pytest.raises(IndexError, match="id 30 "):
        torch.vmap(m)(torch.full((2, 3), 30, device=device))


# torch.func (grad, jvp, hessian, per-sample gradients), forward-mode AD and the refusal of jit.trace:
# tests/test_transforms.py.


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("dropout", [0.0, 0.4])
def test_double_backward(dropout, backend, device, seed):
    """A gradient penalty: d/dW |dL/dW|^2, against the reference differentiated by PyTorch in float64."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (3, 7), generator=g)
    ids[0, :3] = 2  # runs of one id, and the padding row
    weight = torch.randn(12, 6, generator=g, dtype=torch.float64)
    target = torch.randn(3, 7, 10, generator=g, dtype=torch.float64)
    kwargs = dict(mode="concat", d_pos=4, embed_scale=1.5, padding_idx=2)
    seed_tensor = torch.tensor([987654321], dtype=torch.int64)

    def penalty(fn, w):
        out = fn(w)
        (gw,) = torch.autograd.grad(((out - target.to(out)) ** 2 * target.to(out)).sum(), w, create_graph=True)
        return (gw ** 2).sum()

    w = weight.float().to(device).requires_grad_()
    torch.manual_seed(seed)
    if dropout:
        drawn = pf._dropout.draw_seed(torch.device(device))
        torch.manual_seed(seed)
        seed_tensor = drawn.cpu()
    fused = lambda v: pf.sinusoidal_embedding(ids.to(device), v, dropout_p=dropout, backend=backend, **kwargs)  # noqa
    (got,) = torch.autograd.grad(penalty(fused, w), w)
    w64 = weight.clone().requires_grad_()
    exact_fn = lambda v: reference.sinusoidal_embedding(  # noqa: E731
        ids, v, dropout_p=dropout, dropout_seed=seed_tensor, **kwargs)
    (want,) = torch.autograd.grad(penalty(exact_fn, w64), w64)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.count_nonzero(got[2]) == 0


def test_double_backward_gradgradcheck():
    ids = torch.tensor([[1, 4, 4, 0, 7], [2, 2, 9, 4, 1]])
    weight = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    fn = lambda w: pf.sinusoidal_embedding(ids, w, mode="concat", d_pos=3, embed_scale=0.7, padding_idx=9,  # noqa
                                           backend="torch")
    assert torch.autograd.gradgradcheck(fn, (weight,))


# -- 14. TorchScript --------------------------------------------------------------------------------------

def test_torchscript_is_refused_clearly_every_time():
    m = pf.SinusoidalEmbedding(10, 8)
    for _ in range(2):
        with pytest.raises(TypeError, match="TorchScript"):
            torch.jit.script(m)
    assert m(torch.zeros(3, dtype=torch.int64)).shape == (3, 8)


# -- 15. threads ---------------------------------------------------------------------------------------

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


# -- module attributes changed after construction ----------------------------------------------------

@pytest.mark.parametrize("attribute,value,error,fragment", [
    ("position_rule", "bogus", ValueError, "'bogus'"),
    ("backend", "fastest", ValueError, "'fastest'"),
    ("dropout", 1.5, ValueError, "1.5"),
    ("dropout", float("nan"), ValueError, "nan"),
])
def test_mutated_module_attributes(attribute, value, error, fragment, no_kernel):
    m = pf.SinusoidalEmbedding(10, 8)
    setattr(m, attribute, value)
    with pytest.raises(error) as info:
        m(torch.zeros(2, 3, dtype=torch.int64))
    assert fragment in str(info.value)


# -- beyond the list: other tensors and arguments a kernel could disagree with ---------------------------

@pytest.mark.parametrize("make,error,fragment", [
    (lambda: pf.sinusoidal_embedding(torch.zeros(2, 3, dtype=torch.int64), torch.randn(10, 8).to_sparse()),
     TypeError, "sparse_coo"),
    (lambda: pf.sinusoidal_embedding(torch.zeros(2, 3, dtype=torch.int64).to_sparse(), torch.randn(10, 8)),
     TypeError, "sparse_coo"),
    (lambda: pf.sinusoidal_embedding(torch.zeros(2, 3, dtype=torch.int64), torch.randn(10, 8),
                                     positions=torch.ones(3, dtype=torch.int64).to_sparse()), TypeError, "positions"),
    (lambda: pf.SinusoidalEmbedding(10, 8, vocab_range=(0.5, 3)), TypeError, "(0.5, 3)"),
    (lambda: pf.SinusoidalEmbedding(2**70, 8, device="meta"), ValueError, str(2**70)),
    (lambda: pf.SinusoidalEmbedding.from_pretrained(torch.ones(3, 4, dtype=torch.int64)), TypeError, "int64"),
    (lambda: pf.SinusoidalEmbedding.from_pretrained(torch.ones(3, 4, 2)), ValueError, "[3, 4, 2]"),
    (lambda: pf.sinusoidal_embedding(torch.zeros(4, dtype=torch.int64), torch.randn(10, 8),
                                     cu_seqlens=torch.tensor([0.0, 4.0])), TypeError, "cu_seqlens"),
])
def test_other_unusual_arguments(make, error, fragment, no_kernel):
    with pytest.raises(error) as info:
        make()
    assert fragment in str(info.value)


def test_meta_tensors_give_meta_results():
    """Shape inference on the meta device: no values, so no id or cu_seqlens check, and no kernel."""
    ids = torch.zeros(2, 3, dtype=torch.int64, device="meta")
    out = pf.sinusoidal_embedding(ids, torch.empty(10, 8, device="meta"),
                                  cu_seqlens=torch.tensor([0, 3], device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3, 8)
    m = pf.SinusoidalEmbedding(10, 8, mode="concat", d_pos=3, device="meta")
    assert m(ids).shape == (2, 3, 8)
