"""The op under torch's transforms, on every backend target: forward-mode AD, torch.func (grad, vjp,
jacrev, jvp, jacfwd, hessian, vmap), gradcheck with forward mode, jit.trace, and that none of them
(nor torch.export, a fake mode or a dispatch mode) leaves anything behind in the process-wide caches.
Also: vmap of the layer against the batched call, double backward (a gradient penalty) against float64,
and torch.jit.script refused with a clear error.

Every entry point is one row of ``ENTRIES``; every mode one row of ``MODES``.  Both ops are linear in
their differentiable input (the table, or ``x``), so every derivative has an exact value to compare
with: the layer on the tangent with no PE (``embed_scale * T[ids]``, nothing at padding tokens, nothing
in concat's PE columns) and, for ``add_sinusoidal``, ``x_scale * t``.
"""

import itertools
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import TorchDispatchMode

import posenc_fast as pf
from posenc_fast import reference

from cases import assert_within, backend_targets, output_bound, targets

TARGETS = backend_targets()
VOCAB, WIDTH, BATCH, SEQ, OFFSET, SCALE = 23, 10, 2, 5, 7, 1.5
_bases = itertools.count(20000)


def fresh_base() -> float:
    """A base no other call has used: its spec (and the spec's device tensors) are made by this test."""
    return float(next(_bases)) + 0.5


def _ids(seed, shape=(BATCH, SEQ), vocab=VOCAB, device="cpu"):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _randn(seed, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device, dtype)


# The differentiable entry points: (name, make(backend, base, device) -> f(ids, primal), primal width, exact
# tangent).  ``tangent_of(ids, t)`` is the derivative applied to a tangent t of the primal, in float64, on
# t's device.
class Entry:
    def __init__(self, name, make, primal_shape, tangent_of, module=False):
        self.name, self.make, self.primal_shape, self.tangent_of, self.module = (name, make, primal_shape,
                                                                                  tangent_of, module)

    def __repr__(self):
        return self.name


def _embedding_tangent(mode="add", padding_idx=None, d_pos=4):
    def tangent_of(ids, t):
        rows = SCALE * t.double()[ids]
        if padding_idx is not None:
            rows = torch.where((ids == padding_idx).unsqueeze(-1), 0.0, rows)
        if mode == "concat":
            rows = torch.cat([rows, rows.new_zeros(rows.shape[:-1] + (d_pos,))], dim=-1)
        return rows
    return tangent_of


def _functional(mode="add", padding_idx=None):
    def make(backend, base, device):
        kwargs = dict(embed_scale=SCALE, base=base, offset=OFFSET, padding_idx=padding_idx, backend=backend)
        if mode == "concat":
            kwargs.update(mode="concat", d_pos=4)
        return lambda ids, weight: pf.sinusoidal_embedding(ids, weight, **kwargs)
    return make


def _module(backend, base, device):
    layer = pf.SinusoidalEmbedding(VOCAB, WIDTH, embed_scale=SCALE, base=base, backend=backend, device=device)

    call = lambda ids, weight: torch.func.functional_call(layer, {"weight": weight}, (ids,), {"offset": OFFSET})  # noqa: E731
    call.layer, call.traced_input = layer, lambda ids, weight: ids
    return call


def _add(backend, base, device):
    return lambda ids, x: pf.add_sinusoidal(x, x_scale=SCALE, base=base, offset=OFFSET, backend=backend)


def _add_module(backend, base, device):
    layer = pf.SinusoidalPositionalEncoding(WIDTH, x_scale=SCALE, base=base, backend=backend).to(device)
    call = lambda ids, x: layer(x, offset=OFFSET)  # noqa: E731
    call.layer, call.traced_input = layer, lambda ids, x: x
    return call


ENTRIES = [
    Entry("embedding", _functional(), (VOCAB, WIDTH), _embedding_tangent()),
    Entry("embedding-padding", _functional(padding_idx=3), (VOCAB, WIDTH), _embedding_tangent(padding_idx=3)),
    Entry("embedding-concat", _functional("concat"), (VOCAB, WIDTH - 4), _embedding_tangent("concat")),
    Entry("module", _module, (VOCAB, WIDTH), _embedding_tangent(), module=True),
    Entry("add_sinusoidal", _add, (BATCH, SEQ, WIDTH), lambda ids, t: SCALE * t.double()),
    Entry("add_module", _add_module, (BATCH, SEQ, WIDTH), lambda ids, t: SCALE * t.double(), module=True),
]


def _assert_tangent(actual, expected, what):
    """A tangent computed in fp32 from fp32 tangents: scale * t rounded once (exact for SCALE = 1.5 up to
    one rounding), so the fp32 bar of the forward applies."""
    assert actual is not None, f"{what}: the tangent was dropped"
    assert_within(actual, expected, 1e-6 + 2.0**-22 * expected.abs(), what)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_forward_mode_ad_tangent(entry, backend, device, seed):
    """A dual table (or dual x) under torch.autograd.forward_ad: the output carries the exact tangent, and
    its primal is the plain call's output; with and without grad mode."""
    f = entry.make(backend, fresh_base(), device)
    ids, primal, tangent = (_ids(seed, device=device), _randn(seed + 1, *entry.primal_shape, device=device),
                            _randn(seed + 2, *entry.primal_shape, device=device))
    plain = f(ids, primal)
    for grad_mode in (False, True):
        with torch.set_grad_enabled(grad_mode), fwAD.dual_level():
            out = f(ids, fwAD.make_dual(primal, tangent))
            out_primal, out_tangent = fwAD.unpack_dual(out)
            torch.testing.assert_close(out_primal, plain, atol=0, rtol=0)
            _assert_tangent(out_tangent, entry.tangent_of(ids, tangent), f"{entry} {backend} forward AD")


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_func_jvp_and_vjp_are_exact_and_adjoint(entry, backend, device, seed):
    """torch.func.jvp gives the exact tangent, torch.func.vjp the exact cotangent, and the two are
    adjoint: <J t, u> = <t, J^T u> (so jacfwd and jacrev describe one Jacobian, padding included)."""
    f = entry.make(backend, fresh_base(), device)
    ids, primal, tangent = (_ids(seed, device=device), _randn(seed + 1, *entry.primal_shape, device=device),
                            _randn(seed + 2, *entry.primal_shape, device=device))
    out, out_tangent = torch.func.jvp(lambda p: f(ids, p), (primal,), (tangent,))
    torch.testing.assert_close(out, f(ids, primal), atol=0, rtol=0)
    _assert_tangent(out_tangent, entry.tangent_of(ids, tangent), f"{entry} {backend} jvp")
    cotangent = _randn(seed + 3, *out.shape, device=device)
    _, pullback = torch.func.vjp(lambda p: f(ids, p), primal)
    (primal_cotangent,) = pullback(cotangent)
    exact_forward = (entry.tangent_of(ids, tangent) * cotangent.double()).sum()
    exact_backward = (tangent.double() * primal_cotangent.double()).sum()
    assert abs(exact_forward - exact_backward) <= 1e-5 * (1 + abs(exact_forward)), (exact_forward, exact_backward)
    # The cotangent itself, against autograd on the same call.
    leaf = primal.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(f(ids, leaf), leaf, cotangent)
    torch.testing.assert_close(primal_cotangent, expected, atol=0, rtol=0)


@pytest.mark.parametrize("backend,device", targets(
    slow_on_interpreter="a full Jacobian and Hessian through the interpreter: 40 to 75 s"))
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.name in ("embedding", "embedding-padding",
                                                                     "add_sinusoidal")], ids=repr)
def test_jacfwd_equals_jacrev_and_hessian(entry, backend, device, seed):
    """The full Jacobian both ways on a small case, and the Hessian of a quadratic loss (which goes
    through the weight gradient's own jvp: jacfwd(jacrev(...))), against the float64 Jacobian."""
    f = entry.make(backend, fresh_base(), device)
    ids, primal = _ids(seed, shape=(1, 3), device=device), _randn(seed + 1, *entry.primal_shape[:-2], *(
        (1, 3) if entry.name == "add_sinusoidal" else entry.primal_shape[-2:-1]), entry.primal_shape[-1],
        device=device)
    forward = torch.func.jacfwd(lambda p: f(ids, p))(primal)
    backward = torch.func.jacrev(lambda p: f(ids, p))(primal)
    torch.testing.assert_close(forward, backward, atol=0, rtol=0)
    # torch.autograd.functional's vectorized forward mode: its tangents are legacy-vmap batched tensors.
    legacy = torch.autograd.functional.jacobian(lambda p: f(ids, p), primal, vectorize=True, strategy="forward-mode")
    torch.testing.assert_close(legacy, forward, atol=0, rtol=0)
    # The exact Jacobian: the tangent map applied to every basis tangent.
    basis = torch.eye(primal.numel(), dtype=torch.float64, device=device).reshape(primal.numel(), *primal.shape)
    exact = torch.stack([entry.tangent_of(ids, b) for b in basis], dim=-1).reshape(forward.shape)
    _assert_tangent(forward, exact, f"{entry} {backend} jacfwd")
    hessian = torch.func.hessian(lambda p: (f(ids, p) ** 2).sum() / 2)(primal)
    jacobian = exact.reshape(-1, primal.numel())
    exact_hessian = (jacobian.T @ jacobian).reshape(hessian.shape)
    assert_within(hessian, exact_hessian, 1e-5 + 1e-5 * exact_hessian.abs(), f"{entry} {backend} hessian")


@pytest.mark.parametrize("backend,device", targets(
    slow_on_interpreter="vmap runs the interpreter once per sample: ~4 s each"))
@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.name.startswith("add")], ids=repr)
def test_per_sample_gradients_with_vmap(entry, backend, device, seed):
    """Opacus-style per-sample gradients, vmap(grad(loss)) over the batch, equal one autograd call per
    sample; the weight gradient stays deterministic per sample."""
    f = entry.make(backend, fresh_base(), device)
    ids, weight = _ids(seed, shape=(4, SEQ), device=device), _randn(seed + 1, *entry.primal_shape, device=device)
    targets = _randn(seed + 2, 4, SEQ, f(ids[:1], weight).shape[-1], device=device)

    def loss(w, sample_ids, target):
        return ((f(sample_ids.unsqueeze(0), w) - target) ** 2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(weight, ids, targets)
    for n in range(ids.shape[0]):
        leaf = weight.clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(loss(leaf, ids[n], targets[n]), leaf)
        torch.testing.assert_close(per_sample[n], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_gradcheck_forward_and_reverse_mode(entry, seed):
    """torch.autograd.gradcheck / gradgradcheck with forward mode on the float64 backend (the only one
    with float64 tables), against finite differences."""
    f = entry.make("torch", fresh_base(), "cpu")
    ids = _ids(seed, shape=(2, 3))
    primal_shape = (2, 3, WIDTH) if entry.name.startswith("add") else entry.primal_shape
    primal = _randn(seed + 1, *primal_shape, dtype=torch.float64).requires_grad_(True)
    if entry.name == "embedding-padding":  # padding rows get no gradient by definition (as in nn.Embedding)
        ids = torch.where(ids == 3, 4, ids)
    assert torch.autograd.gradcheck(lambda p: f(ids, p), (primal,), check_forward_ad=True, check_batched_grad=True)
    assert torch.autograd.gradgradcheck(lambda p: f(ids, p), (primal,), check_fwd_over_rev=True,
                                        check_rev_over_rev=True)


def test_unsupported_functorch_transform_is_refused_clearly():
    weight = _randn(1, VOCAB, WIDTH)
    with pytest.raises(RuntimeError, match="posenc_fast does not support the torch.func transform"):
        torch.func.functionalize(lambda w: pf.sinusoidal_embedding(_ids(1), w, backend="torch"))(weight)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_jit_trace_is_refused(entry, backend, device):
    """Positions derived from the length and an offset: a trace would bake them in (silently wrong at any
    other length), so it is refused, pointing to explicit positions and torch.export; TorchScript's ONNX
    exporter traces, so it is refused the same way."""
    f = entry.make(backend, fresh_base(), device)
    primal = _randn(1, *entry.primal_shape, device=device)
    ids = _ids(2, device=device)
    with torch.no_grad():  # eager calls first, which keep a prepared launch: the trace must not reach it
        f(ids, primal)
        f(ids, primal)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)  # and it warns of nothing on the way
        with pytest.raises(RuntimeError, match="torch.jit.trace.*only for calls with explicit positions.*torch.export"):
            _trace(f, ids, primal)


class _WithPositions(torch.nn.Module):
    """A traceable caller: the layer's inputs and explicit positions are the trace's inputs."""

    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, first, positions):
        return self.call(first, positions)


# name -> (make(backend, base, device) -> f(first input, positions), the first input at a shape (on the
# CPU), float64 definition (of CPU inputs))
_POSITIONED = {
    "functional": (lambda backend, base, device: lambda ids, positions: pf.sinusoidal_embedding(
                       ids, _TRACE_TABLE.to(device), positions=positions, embed_scale=SCALE, padding_idx=3,
                       zero_pe_at_padding=True, base=base, backend=backend),
                   lambda g, shape: torch.randint(0, VOCAB, shape, generator=g),
                   lambda ids, positions, base: reference.sinusoidal_embedding(
                       ids, _TRACE_TABLE.double(), positions=positions, embed_scale=SCALE, padding_idx=3,
                       zero_pe_at_padding=True, base=base)),
    "module": (lambda backend, base, device: _module_with_table(_TRACE_TABLE, embed_scale=SCALE, base=base,
                                                                 backend=backend, device=device),
               lambda g, shape: torch.randint(0, VOCAB, shape, generator=g),
               lambda ids, positions, base: reference.sinusoidal_embedding(
                   ids, _TRACE_TABLE.double(), positions=positions, embed_scale=SCALE, base=base)),
    "add_sinusoidal": (lambda backend, base, device: lambda x, positions: pf.add_sinusoidal(
                           x, positions=positions, x_scale=SCALE, base=base, backend=backend),
                       lambda g, shape: torch.randn(*shape, WIDTH, generator=g),
                       lambda x, positions, base: SCALE * x.double() + reference.sinusoidal_table(
                           positions, WIDTH, base=base)),
    "add_module": (lambda backend, base, device: pf.SinusoidalPositionalEncoding(WIDTH, x_scale=SCALE, base=base,
                                                                                 backend=backend).to(device),
                   lambda g, shape: torch.randn(*shape, WIDTH, generator=g),
                   lambda x, positions, base: SCALE * x.double() + reference.sinusoidal_table(
                       positions, WIDTH, base=base)),
    # A position rule passes explicit positions through, so a module with one traces as any other.
    "module, fairseq rule": (lambda backend, base, device: _module_with_table(
                                 _TRACE_TABLE, preset="fairseq", padding_idx=3, backend=backend, device=device),
                             lambda g, shape: torch.randint(0, VOCAB, shape, generator=g),
                             lambda ids, positions, base: reference.sinusoidal_embedding(
                                 ids, _TRACE_TABLE.double(), positions=positions, padding_idx=3,
                                 **pf.presets.get("fairseq").kwargs(WIDTH))),
    # Frequencies given as a tensor: read as floats when the trace is made (constants of the layer).
    "functional, tensor frequencies": (
        lambda backend, base, device: lambda ids, positions: pf.sinusoidal_embedding(
            ids, _TRACE_TABLE.to(device), positions=positions, frequencies=_TRACE_FREQUENCY_TENSOR, backend=backend),
        lambda g, shape: torch.randint(0, VOCAB, shape, generator=g),
        lambda ids, positions, base: reference.sinusoidal_embedding(
            ids, _TRACE_TABLE.double(), positions=positions, frequencies=_TRACE_FREQUENCIES)),
    "add_sinusoidal, tensor frequencies": (
        lambda backend, base, device: lambda x, positions: pf.add_sinusoidal(
            x, positions=positions, frequencies=_TRACE_FREQUENCY_TENSOR, backend=backend),
        lambda g, shape: torch.randn(*shape, WIDTH, generator=g),
        lambda x, positions, base: x.double() + reference.sinusoidal_table(
            positions, WIDTH, frequencies=_TRACE_FREQUENCIES)),
}
_TRACE_TABLE = _randn(5, VOCAB, WIDTH)
_TRACE_FREQUENCIES = [1.0, 0.5, 0.25, 0.125, 2.0**-10]
_TRACE_FREQUENCY_TENSOR = torch.tensor(_TRACE_FREQUENCIES, dtype=torch.float64)


def _module_with_table(table, device="cpu", preset=None, **kwargs):
    if preset is not None:
        layer = pf.SinusoidalEmbedding.from_preset(preset, *table.shape, **kwargs).to(device)
    else:
        layer = pf.SinusoidalEmbedding(*table.shape, device=device, **kwargs)
    with torch.no_grad():
        layer.weight.copy_(table)
    return layer


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("name", list(_POSITIONED))
def test_jit_trace_with_explicit_positions_is_right_at_other_shapes(name, backend, device, seed):
    """With explicit positions nothing is taken from the length: the trace (standard ops, as ONNX gets
    them) is right at other batch sizes, lengths and positions, against float64, with no TracerWarning."""
    import warnings

    make, first_input, definition = _POSITIONED[name]
    base = fresh_base()
    layer = make(backend, base, device)
    g = torch.Generator().manual_seed(seed)
    example = (first_input(g, (BATCH, SEQ)).to(device), torch.randint(0, 100, (BATCH, SEQ), generator=g).to(device))
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        with torch.no_grad():
            traced = torch.jit.trace(_WithPositions(layer).eval(), example, check_trace=False)
    for shape in [(BATCH, SEQ), (3, 11), (1, 1), (4, 2)]:
        first, positions = first_input(g, shape), torch.randint(-2**30, 2**30, shape, generator=g)
        exact = definition(first, positions, base)
        with torch.no_grad():
            got = traced(first.to(device), positions.to(device))
        assert_within(got, exact, output_bound(exact, torch.float32), f"{name} {backend} traced at {shape}")
        # The trace was the first call with these parameters: it left nothing behind for eager calls.
        with torch.no_grad():
            got = make(backend, base, device)(first.to(device), positions.to(device))
        assert_within(got, exact, output_bound(exact, torch.float32), f"{name} {backend} eager after the trace")


def _trace(f, ids, primal):
    """jit.trace of the module itself (a module entry), else of the function of the primal."""
    if hasattr(f, "layer"):
        return torch.jit.trace(f.layer, (f.traced_input(ids, primal),), check_trace=False)
    return torch.jit.trace(lambda p: f(ids, p), (primal,), check_trace=False)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_jit_trace_for_training_keeps_the_padding_row_out_of_the_gradient(backend, device, seed):
    """A traced training step: the gradient is nn.Embedding's with padding_idx (the padding row gets
    none), as eager; sparse=True, which the trace cannot keep, is refused."""
    layer = _module_with_table(_TRACE_TABLE, device, embed_scale=SCALE, padding_idx=3, backend=backend)
    g = torch.Generator().manual_seed(seed)
    ids, positions = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, 100, (BATCH, SEQ), generator=g)
    ids[0, :2] = 3
    traced = torch.jit.trace(_WithPositions(layer), (ids.to(device), positions.to(device)), check_trace=False)
    ids, positions = torch.randint(0, VOCAB, (3, 7), generator=g), torch.randint(0, 100, (3, 7), generator=g)
    ids[1, 1:4] = 3
    target = torch.randn(3, 7, WIDTH, generator=g)
    ids, positions, target = ids.to(device), positions.to(device), target.to(device)
    (traced_grad,) = torch.autograd.grad((traced(ids, positions) * target).sum(), layer.weight)
    (eager_grad,) = torch.autograd.grad((layer(ids, positions=positions) * target).sum(), layer.weight)
    assert not traced_grad[3].any()
    torch.testing.assert_close(traced_grad, eager_grad, atol=1e-5, rtol=1e-5)
    sparse = _module_with_table(_TRACE_TABLE, device, sparse=True, backend=backend)
    with pytest.raises(NotImplementedError, match="sparse=True.*jit.trace"):
        torch.jit.trace(_WithPositions(sparse), (ids, positions), check_trace=False)


# --- No state left behind -------------------------------------------------------------------------
class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# Each mode gets ``build`` (makes the layer: inside the mode where the mode can see it) and the inputs.
def _under_fake_mode(build, ids, primal):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        build()(mode.from_tensor(ids), mode.from_tensor(primal))


def _under_export(build, ids, primal):
    f = build()

    class Wrapper(torch.nn.Module):
        def forward(self, ids, primal):
            return f(ids, primal)

    torch.export.export(Wrapper(), (ids, primal), strict=False)


def _under_dispatch_mode(build, ids, primal):
    with _PassThrough():
        build()(ids, primal)


def _under_jit_trace(build, ids, primal):
    _trace(build(), ids, primal)


def _under_forward_ad(build, ids, primal):
    with fwAD.dual_level():
        build()(ids, fwAD.make_dual(primal, primal))


def _under_inference_mode(build, ids, primal):
    with torch.inference_mode():
        build()(ids, primal)


def _under_func_grad(build, ids, primal):
    torch.func.grad(lambda p: build()(ids, p).sum())(primal)


def _under_func_jvp(build, ids, primal):
    torch.func.jvp(lambda p: build()(ids, p), (primal,), (primal,))


def _under_vmap(build, ids, primal):
    torch.func.vmap(lambda p: build()(ids, p), randomness="same")(primal.unsqueeze(0).expand(2, *primal.shape))


MODES = {name[len("_under_"):]: fn for name, fn in globals().items() if name.startswith("_under_")}


# What a transform could leave behind is posenc_fast's host state (cached frequencies, kept launches), the same
# for every backend; Triton's own (its kept kernels) exists on a GPU only.  So the interpreter adds nothing here.
@pytest.mark.parametrize("backend,device", targets(
    slow_on_interpreter="host state that every target checks, through the interpreter: ~1.5 s each"))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_no_state_left_behind(entry, mode, backend, device, seed):
    """The first call with a new set of parameters happens under ``mode`` (whatever it makes of it,
    a refusal included); every later plain call, of a fresh layer too, is still right."""
    base = fresh_base()
    ids, primal = _ids(seed, device=device), _randn(seed + 1, *entry.primal_shape, device=device)
    try:
        MODES[mode](lambda: entry.make(backend, base, device), ids, primal)
    except RuntimeError as error:  # posenc_fast's own refusal (jit.trace) is fine; nothing else is
        assert str(error).startswith("posenc_fast supports torch.jit.trace"), error
    for f in (entry.make(backend, base, device), entry.make(backend, base, device)):
        for grad_mode in (False, True):
            with torch.set_grad_enabled(grad_mode):
                out = f(ids, primal.clone().requires_grad_(grad_mode))
            _assert_output(entry, base, ids.cpu(), primal.cpu(), out, f"{entry} after {mode} on {backend}")


def _assert_output(entry, base, ids, primal, out, what):
    if entry.name.startswith("add"):
        positions = (OFFSET + torch.arange(SEQ)).expand(ids.shape)
        exact = SCALE * primal.double() + reference.sinusoidal_table(positions, WIDTH, frequencies=[
            base ** (-2.0 * i / WIDTH) for i in range(WIDTH // 2)])
    else:
        kwargs = dict(embed_scale=SCALE, base=base, offset=OFFSET)
        if entry.name == "embedding-padding":
            kwargs["padding_idx"] = 3
        if entry.name == "embedding-concat":
            kwargs.update(mode="concat", d_pos=4)
        exact = reference.sinusoidal_embedding(ids, primal.double(), **kwargs)
    assert_within(out.detach(), exact, output_bound(exact, torch.float32), what)


# --- vmap of the layer, double backward, TorchScript ------------------------------------------------

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


def test_torchscript_is_refused_clearly_every_time():
    m = pf.SinusoidalEmbedding(10, 8)
    for _ in range(2):
        with pytest.raises(TypeError, match="TorchScript"):
            torch.jit.script(m)
    assert m(torch.zeros(3, dtype=torch.int64)).shape == (3, 8)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_forward_ad_and_torch_func_inside_torch_compile(backend, device):
    """Inside torch.compile, forward-mode AD and torch.func's transforms take the Functions, as in eager: the
    op's autograd formula has no tangent, which torch would drop silently.  Tangents, gradients and vmap's
    rows equal eager's."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(40, 6, generator=g).to(device)
    tangent = torch.randn(40, 6, generator=g).to(device)
    ids = torch.randint(0, 40, (2, 3), generator=g).to(device)

    def layer(w):
        return pf.sinusoidal_embedding(ids, w, offset=5, backend=backend)

    def dual_tangent(w, t):
        with fwAD.dual_level():
            return fwAD.unpack_dual(layer(fwAD.make_dual(w, t))).tangent

    calls = {
        "forward_ad": (dual_tangent, (weight, tangent)),
        "func.jvp": (lambda w, t: torch.func.jvp(layer, (w,), (t,))[1], (weight, tangent)),
        "func.grad": (torch.func.grad(lambda w: layer(w).square().sum()), (weight,)),
        "func.vmap": (torch.func.vmap(layer), (torch.stack([weight, tangent]),)),
    }
    if backend == "triton" and device == "cpu":  # Dynamo traces torch.func's calls into the interpreter's Python
        calls = {"forward_ad": calls["forward_ad"]}
    for name, (fn, args) in calls.items():
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Dynamo's notes on what it runs eagerly
            compiled = torch.compile(fn, backend="aot_eager")(*args)
        assert compiled is not None, name
        torch.testing.assert_close(compiled, fn(*args), rtol=0, atol=0, msg=name)
    exact = weight.new_zeros(2, 3, 6)  # the tangent is the layer on the tangent table without PE
    exact += tangent[ids]
    torch.testing.assert_close(dual_tangent(weight, tangent), exact, rtol=0, atol=0)
