"""posenc_fast.sinusoidal_embedding on every backend against float64 math (the reference on float64 weights).

Bars: fp32 output within 1e-6 + 2^-22|y| of exact; bf16/fp16 within one ulp
(see cases.output_bound); weight gradients within 1e-5 relative (per element, relative to the
sum of the magnitudes it adds up); gradients bitwise reproducible.  Also arguments at their limits:
the largest scale on zero rows, the smallest base whose frequencies are finite.
"""

import dataclasses
import math
from decimal import Decimal, localcontext

import pytest
import torch

import posenc_fast as pf
from posenc_fast import backends, functional, reference
from posenc_fast._spec import MAX_SCALE
from posenc_fast.backends import triton_backend

from cases import (CASES, DESIGN_POSITIONS, Case, assert_within, backend_targets, cases_on_targets, gpu_kernel_backends,
                   make_inputs, output_bound, targets, ulp)

TARGETS = backend_targets()
LOW_PRECISION = [torch.float32, torch.bfloat16, torch.float16]


def _exact(ids, weight, kwargs):
    return reference.sinusoidal_embedding(ids, weight.double(), **kwargs)


@pytest.mark.parametrize("case,dtype,backend,device", cases_on_targets(CASES, LOW_PRECISION))
def test_forward_matches_float64(case, dtype, backend, device, seed):
    ids, weight, kwargs = make_inputs(case, device, dtype, seed)
    out = pf.sinusoidal_embedding(ids, weight, backend=backend, **kwargs)
    assert out.dtype == dtype and out.device == weight.device
    assert out.shape == ids.shape + (case.d_model,)
    exact = _exact(ids, weight, kwargs)
    assert_within(out, exact, output_bound(exact, dtype, case.precision), f"{case.name} {backend} {dtype}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_float64_on_torch_backend(case, seed):
    ids, weight, kwargs = make_inputs(case, "cpu", torch.float64, seed)
    out = pf.sinusoidal_embedding(ids, weight, backend="torch", **kwargs)
    exact = _exact(ids, weight, kwargs)
    assert_within(out, exact, output_bound(exact, torch.float64), case.name)


def _gradients(fn, weight, grad_out):
    w = weight.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(fn(w), w, grad_out)
    return grad


# The weight gradient reads the ids, the table's width, the embed scale and the padding row, never the PE.
# Through Triton's interpreter it runs on the cases that differ in those; the cases that differ from them
# only in their PE (layout, frequencies, positions, float64 math) take the interpreter only with -m slow,
# and run natively wherever a GPU runs the suite.  Every other target runs every case.
_PE_ONLY_FOR_THE_GRADIENT = {
    "split", "odd_width_split", "concat_odd", "explicit_positions", "broadcast_positions", "far_positions",
    "far_positions_split_concat", "cos_first", "cos_first_odd", "cos_first_odd_tail", "split_odd_sin_tail",
    "interleaved_odd_sin_tail", "concat_sin_tail", "random_rates", "per_sequence_whole_vectors",
    "zero_pe_at_padding", "float64_math", "float64_math_concat_split_tail", "float64_math_cos_first"}
assert _PE_ONLY_FOR_THE_GRADIENT <= {case.name for case in CASES}, "a renamed case: name it here too"
GRADIENT_CASES = [dataclasses.replace(case, slow_on_interpreter="a case whose gradient another case's covers on "
                                      "the interpreter: 2 to 10 s each")
                  if case.name in _PE_ONLY_FOR_THE_GRADIENT else case for case in CASES]


@pytest.mark.parametrize("case,dtype,backend,device", cases_on_targets(GRADIENT_CASES, [torch.float32, torch.bfloat16]))
def test_weight_gradient(case, dtype, backend, device, seed):
    ids, weight, kwargs = make_inputs(case, device, dtype, seed)
    width = case.d_model
    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(ids.shape + (width,), generator=g, dtype=torch.float64).to(dtype).to(device)

    fused = lambda w: pf.sinusoidal_embedding(ids, w, backend=backend, **kwargs)  # noqa: E731
    grad = _gradients(fused, weight, grad_out)
    assert grad.dtype == dtype and grad.shape == weight.shape

    exact_fn = lambda w: reference.sinusoidal_embedding(ids, w, **kwargs)  # noqa: E731
    exact = _gradients(exact_fn, weight.double(), grad_out.double())
    magnitude = _gradients(exact_fn, weight.double(), grad_out.double().abs()).abs()
    bound = 1e-5 * magnitude + 1e-30
    if dtype != torch.float32:
        bound = bound + ulp(exact, dtype)
    assert_within(grad, exact, bound, f"{case.name} grad {backend} {dtype}")
    if case.padding_idx is not None:
        assert torch.count_nonzero(grad[case.padding_idx]) == 0

    again = _gradients(fused, weight, grad_out)
    assert torch.equal(grad, again), "weight gradient is not bitwise reproducible"


@pytest.mark.parametrize("backend,device", targets(slow_on_interpreter="16384 tokens through the interpreter: 4 minutes"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_long_run_of_one_id_keeps_the_gradient_bound(dtype, backend, device, seed):
    """A frequent id (a BOS token, say) over a batch of 8 x 2048 under a mean loss: one run of 16384 tokens
    whose gradients are one constant, not a power of two.  A running fp32 sum of that run drifts with its
    length (1e-4 here); the bound is the same 1e-5 of the sum of |contributions| as for short runs."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(4, 7, generator=g).to(dtype).to(device)
    ids = torch.full((8, 2048), 1, device=device)
    ids[:, :3] = torch.randint(0, 4, (8, 3), generator=g).to(device)  # and a few short runs
    kwargs = dict(embed_scale=1.5)
    grad = _gradients(lambda w: pf.sinusoidal_embedding(ids, w, backend=backend, **kwargs).mean(), weight, None)
    exact = _gradients(lambda w: reference.sinusoidal_embedding(ids.cpu(), w, **kwargs).mean(),
                       weight.double().cpu(), None)  # every term of one sign: |contributions| sum to |exact|
    bound = 1e-5 * exact.abs() + (ulp(exact, dtype) if dtype != torch.float32 else 0.0)
    assert_within(grad, exact, bound, f"a run of 16384 tokens, {backend} {dtype}")


@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_triton_gradient_runs_across_chunks(chunk, seed, monkeypatch):
    """Runs of equal ids crossing 1, several and many stage-1 chunks combine exactly once."""
    target = [p for p in TARGETS if p.values[0] == "triton"]
    if not target:
        pytest.skip("Triton unavailable")
    device = target[0].values[1]
    monkeypatch.setattr(triton_backend, "GRAD_CHUNK", chunk)
    case = Case("runs", (2, 45), 6, 10, mode="concat", d_pos=3, padding_idx=2, hot_id=True)
    ids, weight, kwargs = make_inputs(case, device, torch.float32, seed)
    ids.view(-1)[:20] = 4  # one long run, one padding run, short runs
    ids.view(-1)[-7:] = 5
    grad_out = torch.randn(ids.shape + (10,), dtype=torch.float64).float().to(device)
    grad = _gradients(lambda w: pf.sinusoidal_embedding(ids, w, backend="triton", **kwargs), weight, grad_out)
    exact_fn = lambda w: reference.sinusoidal_embedding(ids, w, **kwargs)  # noqa: E731
    exact = _gradients(exact_fn, weight.double(), grad_out.double())
    magnitude = _gradients(exact_fn, weight.double(), grad_out.double().abs())
    assert_within(grad, exact, 1e-5 * magnitude + 1e-30, f"chunk={chunk}")


WIDE_INDEX_CASES = [c for c in CASES if c.name in (
    "basic", "odd_width_split", "three_d", "explicit_positions", "far_positions", "long_sequence", "float64_math")]


@pytest.mark.parametrize("case", WIDE_INDEX_CASES, ids=lambda c: c.name)
def test_triton_add_forward_64_bit_index_path(case, seed, monkeypatch):
    """The add-mode forward's 64-bit index math (taken for outputs past 2**31 elements, too large
    to run here) computes the same as the 32-bit path: forced on for small inputs."""
    target = [p for p in TARGETS if p.values[0] == "triton"]
    if not target:
        pytest.skip("Triton unavailable")
    monkeypatch.setattr(triton_backend, "_needs_wide_index", lambda *args: True)
    ids, weight, kwargs = make_inputs(case, target[0].values[1], torch.bfloat16, seed)
    out = pf.sinusoidal_embedding(ids, weight, backend="triton", **kwargs)
    exact = _exact(ids, weight, kwargs)
    assert_within(out, exact, output_bound(exact, torch.bfloat16, case.precision), f"{case.name} wide index")


def test_triton_wide_index_threshold():
    """64-bit index math exactly when a token index or an element offset can pass 2**31 - 1."""
    wide = triton_backend._needs_wide_index
    assert not wide(2**20, 16, 1024, 32768, 1024)
    assert wide(2**21, 16, 1024, 32768, 1024)  # 2**31 + 16K output elements
    assert not wide((2**31 - 1) // 1024 - 16, 16, 1024, 10, 1024)
    assert wide((2**31 - 1) // 1024 - 15, 16, 1024, 10, 1024)
    assert wide(100, 16, 1024, 2**21 + 1, 1024)  # the weight table passes 2**31 elements
    assert wide(2**31 - 16, 16, 1, 10, 1)  # the last program's token index


def _decimal_pe(position: int, frequency: float, pe_width: int) -> tuple:
    """sin and cos of position * frequency, reduced mod 2*pi in 50-digit decimal arithmetic."""
    with localcontext() as ctx:
        ctx.prec = 50
        two_pi = Decimal("6.283185307179586476925286766559005768394338798750211641949889")
        angle = (Decimal(position) * Decimal(frequency)) % two_pi
        return math.sin(float(angle)), math.cos(float(angle))


@pytest.mark.parametrize("backend,device", TARGETS)
def test_design_positions_exact(backend, device):
    """The design's test vectors (docs/design.md) and beyond (|p| up to 2^40), against decimal arithmetic, fp32 bar."""
    positions = DESIGN_POSITIONS + [2**31 - 1, 2**31, 2**32 - 1, -(2**32), 2**40, -(2**40) + 12345]
    d = 64
    weight = torch.zeros(1, d)  # the PE alone: y = PE(p)
    ids = torch.zeros(len(positions), dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    out = pf.sinusoidal_embedding(ids.to(device), weight.to(device), positions=pos.to(device), backend=backend)
    exact = torch.empty(len(positions), d, dtype=torch.float64)
    for row, p in enumerate(positions):
        for i in range(d // 2):
            s, c = _decimal_pe(p, 10000.0 ** (-2.0 * i / d), d)
            exact[row, 2 * i], exact[row, 2 * i + 1] = s, c
    assert_within(out, exact, output_bound(exact, torch.float32), f"design positions {backend}")


def test_fp32_table_would_fail_the_bar():
    """The bar is sharp: an fp32 angle table (what eager code builds) violates it at p = 2^24."""
    p = torch.tensor([2**24 - 1, 2**24, 3 * 10**7])
    w = torch.tensor([10000.0 ** (-2.0 * i / 64) for i in range(32)])
    fp32_table = torch.sin(p[:, None].float() * w.float()[None, :])
    exact = reference.sinusoidal_table(p, 64)[:, 0::2]
    err = (fp32_table.double() - exact).abs()
    assert bool((err > output_bound(exact, torch.float32)).any())


GPU_KERNEL_BACKENDS = gpu_kernel_backends()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with ~10 GB free")
@pytest.mark.parametrize("backend", GPU_KERNEL_BACKENDS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no GPU kernel backend here"))])
def test_output_larger_than_2_pow_31_elements(backend):
    """int64 index arithmetic: 2^31 + 2^20 output elements, every one checked (in row chunks), per GPU backend."""
    d = 1024
    tokens = (2**31 + 2**20) // d
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 4096, (tokens,), device="cuda", generator=g)
    weight = torch.randn(4096, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out = pf.sinusoidal_embedding(ids, weight, offset=2**24 - tokens // 2, backend=backend)
    assert out.numel() > 2**31
    step = 2**18
    for start in range(0, tokens, step):
        stop = min(start + step, tokens)
        exact = reference.sinusoidal_embedding(
            ids[start:stop], weight.double(), offset=2**24 - tokens // 2 + start
        )
        assert_within(out[start:stop], exact, output_bound(exact, torch.bfloat16), f"rows {start}:{stop}")


def test_functional_compiles_fullgraph():
    """The functional API, host parameters included, traces without graph breaks."""

    def step(ids, weight, offsets):
        out = pf.sinusoidal_embedding(ids, weight, mode="concat", d_pos=5, layout="split", offset=offsets,
                                      embed_scale=3.0, padding_idx=1)
        return out.square().sum()

    torch._dynamo.reset()
    weight = torch.randn(30, 11, requires_grad=True)
    ids = torch.randint(0, 30, (2, 7))
    offsets = torch.tensor([0, 2**30])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss, eager = compiled(ids, weight, offsets), step(ids, weight, offsets)
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(torch.autograd.grad(loss, weight)[0], torch.autograd.grad(eager, weight)[0])


def test_functional_with_frequencies_compiles_fullgraph_dynamic():
    """Explicit frequencies are checked against the PE width, which is symbolic under dynamic=True: the
    functional forms still trace in one graph."""
    torch._dynamo.reset()
    weight, ids, x = torch.randn(40, 10), torch.randint(0, 40, (2, 5)), torch.randn(2, 5, 6)
    embedding = lambda ids, w: pf.sinusoidal_embedding(ids, w, frequencies=[1.0, 0.5, 0.01, 1e-4, 3.3])  # noqa: E731
    addition = lambda x: pf.add_sinusoidal(x, frequencies=[1.0, 0.1, 0.01])  # noqa: E731
    compiled = torch.compile(embedding, fullgraph=True, dynamic=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids, weight), embedding(ids, weight), rtol=0, atol=0)
    compiled = torch.compile(addition, fullgraph=True, dynamic=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), addition(x), rtol=0, atol=0)


def _through_the_op(monkeypatch, fn):
    """``fn()`` with every call going through the torch.library op, as under torch.compile or a dispatch mode."""
    from posenc_fast import _dispatch, functional, module

    with monkeypatch.context() as patch:
        patch.setattr(_dispatch, "eager_call", lambda ids, weight: False)  # the route: the op
        patch.setattr(functional, "_eager_call", lambda ids, weight: False)  # no functional prepared launch
        patch.setattr(module, "eager_call", lambda ids, weight: False)  # and no module's
        return fn()


def _no_dispatcher(monkeypatch):
    from posenc_fast import functional

    def dispatcher_called(*args, **kwargs):
        raise AssertionError("torch.library dispatch was used for an eager call")

    monkeypatch.setattr(functional, "sinusoidal_embedding_op", dispatcher_called)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_eager_inference_skips_the_dispatcher_with_the_same_result(backend, device, monkeypatch):
    """Under no_grad the eager call runs the implementation directly (its prepared launch): the same
    output bit for bit as through torch.library, and the same id check."""
    weight = torch.randn(40, 10, device=device, requires_grad=True)
    ids = torch.randint(0, 40, (3, 7), device=device)
    through_op = _through_the_op(monkeypatch, lambda: pf.sinusoidal_embedding(ids, weight, offset=5, backend=backend))
    _no_dispatcher(monkeypatch)
    with torch.no_grad():
        direct = pf.sinusoidal_embedding(ids, weight, offset=5, backend=backend)
        with pytest.raises(IndexError, match="id 40 "):
            pf.sinusoidal_embedding(torch.full_like(ids, 40), weight, backend=backend)
    assert torch.equal(direct, through_op.detach())


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_eager_training_skips_the_dispatcher_with_the_same_gradients(backend, device, dropout_p, monkeypatch):
    """With autograd, eager calls run ops.EmbeddingFunction instead of the op's custom-op wrapper: the same
    output, weight gradient and double backward (gradient of a gradient penalty) bit for bit."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(40, 12, generator=g).to(device).requires_grad_()
    ids = torch.randint(0, 40, (3, 7), generator=g).to(device)
    grad_out = torch.randn(3, 7, 12, generator=g).to(device).requires_grad_()
    kwargs = dict(offset=5, embed_scale=3.0, padding_idx=2, dropout_p=dropout_p, backend=backend)

    def run():
        torch.manual_seed(3)  # the dropout seed: the same for both paths
        out = pf.sinusoidal_embedding(ids, weight, **kwargs)
        (grad,) = torch.autograd.grad(out, weight, grad_out, create_graph=True)
        (second,) = torch.autograd.grad((grad * grad).sum(), grad_out)  # the weight gradient is linear in grad_out
        return out.detach(), grad.detach(), second

    expected = _through_the_op(monkeypatch, run)
    _no_dispatcher(monkeypatch)
    for got, want, what in zip(run(), expected, ("output", "weight gradient", "double backward")):
        assert torch.equal(got, want), what
    with pytest.raises(IndexError, match="id 40 "):
        pf.sinusoidal_embedding(torch.full_like(ids, 40), weight, backend=backend)


def test_dispatch_modes_see_the_op(monkeypatch):
    """Under a TorchDispatchMode (FlopCounterMode, a user's op logger) the call goes through the
    dispatcher, so the mode sees posenc_fast's op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    weight = torch.randn(40, 10)
    ids = torch.randint(0, 40, (2, 5))
    with torch.no_grad(), Log():
        pf.sinusoidal_embedding(ids, weight, backend="torch")
    assert any("posenc_fast" in name for name in seen), seen


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_broadcast_gradient_is_read_as_one_row(backend, device, dtype, monkeypatch):
    """``loss = out.sum()`` broadcasts one value to every element of the output's gradient: the weight
    gradient reads it as one row (``backends.gradient_rows``: no tokens x width copy), and equals the
    gradient of the same values given in full."""
    weight = torch.randn(30, 12, dtype=dtype).to(device).requires_grad_()
    ids = torch.randint(0, 30, (4, 9)).to(device)
    kwargs = dict(offset=3, embed_scale=2.0, padding_idx=1, backend=backend)
    for path in ("prepared launch", "general path"):  # (the prepared launch where the backend has one)
        with monkeypatch.context() as patch:
            if path == "general path":
                patch.setattr(functional, "_eager_call", lambda ids, weight: False)  # the entry point tries no launch
            (broadcast,) = torch.autograd.grad(pf.sinusoidal_embedding(ids, weight, **kwargs).sum(), weight)
            out = pf.sinusoidal_embedding(ids, weight, **kwargs)
            (full,) = torch.autograd.grad(out, weight, torch.ones_like(out))
        assert torch.equal(broadcast, full), path
    rows = backends.gradient_rows(torch.ones((), dtype=dtype, device=device).expand(36, 12), dtype)
    assert rows.shape == (36, 12) and rows.stride() == (0, 1)
    assert rows.untyped_storage().nbytes() == 12 * rows.element_size()


# -- arguments at their limits: the largest scale, the smallest base -----------------------------------

@pytest.mark.parametrize("backend,device", TARGETS)
def test_largest_scale_with_zero_rows_is_not_nan(backend, device):
    ids = torch.arange(6, device=device).reshape(2, 3)
    weight = torch.zeros(6, 8, device=device)
    out = pf.sinusoidal_embedding(ids, weight, embed_scale=MAX_SCALE, pe_scale=1.0, offset=0, backend=backend)
    exact = _exact(ids.cpu(), weight.cpu(), dict(embed_scale=MAX_SCALE))
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), f"{backend} largest scale")
    # position 0 and pe_scale at the limit: sin 0 * scale = 0, cos 0 * scale = the scale itself
    out = pf.sinusoidal_embedding(ids, weight, pe_scale=MAX_SCALE, backend=backend)
    exact = _exact(ids.cpu(), weight.cpu(), dict(pe_scale=MAX_SCALE))
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), f"{backend} largest pe_scale")


@pytest.mark.parametrize("backend,device", TARGETS)
def test_tiny_base_with_finite_frequencies(backend, device):
    """base=5e-324 at width 8: frequencies up to 1e242 rad per position are finite, and exact (turns wrap)."""
    ids = torch.randint(0, 11, (2, 5), device=device)
    weight = torch.randn(11, 8, device=device)
    out = pf.sinusoidal_embedding(ids, weight, base=5e-324, offset=12345, backend=backend)
    exact = _exact(ids.cpu(), weight.cpu(), dict(base=5e-324, offset=12345))
    assert_within(out.cpu(), exact, output_bound(exact, torch.float32), f"{backend} tiny base")
