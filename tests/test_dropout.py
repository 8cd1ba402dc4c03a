"""Fused dropout (posenc_fast._dropout; mask defined by reference.dropout_keep) on every backend.

The mask is a pure function of the seed, so each backend's output is compared element by
element with the reference given the same seed; dropped elements must be exactly 0.  The
mask's statistics (keep rate, independence of neighbours, the 1/(1-p) scale) are tested on
the reference and on every backend; backward must use the forward's mask.
"""

import math

import pytest
import torch

import posenc_fast as pf
from posenc_fast import _dropout, reference

from cases import CASES, assert_within, backend_targets, cases_on_targets, make_inputs, output_bound, targets

TARGETS = backend_targets()
RATES = [0.1, 0.5, 0.9]  # 0.9: threshold above 2**31 (unsigned compare)


def _rate_for(case) -> float:
    return RATES[CASES.index(case) % len(RATES)]


def _seed_drawn_after(torch_seed: int, device) -> torch.Tensor:
    """The dropout seed a call makes right after torch.manual_seed(torch_seed)."""
    torch.manual_seed(torch_seed)
    return _dropout.draw_seed(torch.device(device))


# Random123's published known answers for Philox4x32-10 (its kat_vectors): (counter, key, output).
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KNOWN_ANSWERS)
def test_reference_philox_matches_random123(counter, key, expected):
    out = reference.philox4x32_10(torch.tensor(counter), torch.tensor(key))
    assert out.tolist() == list(expected)


def test_reference_mask_layout():
    """Element (t, c) uses word c % 4 of the call with counter (c // 4, t_lo, t_hi, 0), key (seed_lo, seed_hi)."""
    seed_value = 0x0123456789ABCDEF
    seed = torch.tensor([seed_value])
    t = 2**33 + 5  # a token index above 2**32: both counter words
    words = reference.philox4x32_10(torch.tensor([[g, t & 0xFFFFFFFF, t >> 32, 0] for g in range(3)]),
                                    torch.tensor([seed_value & 0xFFFFFFFF, seed_value >> 32]))
    threshold = 2**31
    mask = reference.dropout_keep(seed, 1, 10, threshold, first_token=t)[0]
    assert mask.tolist() == (words.reshape(-1)[:10] >= threshold).tolist()
    # The reference computes the mask in slices of rows: a slice boundary changes nothing.
    whole = reference.dropout_keep(seed, 600, 4097, threshold)  # 1025 calls per row: slices of 255 rows
    assert torch.equal(whole[250:260], reference.dropout_keep(seed, 10, 4097, threshold, first_token=250))


@pytest.mark.parametrize("case,dtype,backend,device", cases_on_targets(CASES, [torch.float32, torch.bfloat16]))
def test_forward_with_dropout_matches_reference(case, dtype, backend, device, seed):
    """Every element against the float64 reference with the same seed; dropped ones exactly 0."""
    ids, weight, kwargs = make_inputs(case, device, dtype, seed)
    p = _rate_for(case)
    torch.manual_seed(seed)
    out = pf.sinusoidal_embedding(ids, weight, dropout_p=p, backend=backend, **kwargs)
    dropout_seed = _seed_drawn_after(seed, device)
    exact = reference.sinusoidal_embedding(ids, weight.double(), dropout_p=p, dropout_seed=dropout_seed, **kwargs)
    assert_within(out, exact, output_bound(exact, dtype, case.precision), f"{case.name} {backend} {dtype} p={p}")
    keep = reference.dropout_keep(dropout_seed, ids.numel(), case.d_model, _dropout.threshold_of(p))
    flat = out.reshape(-1, case.d_model)
    assert bool((flat[~keep] == 0).all()), "a dropped element is not exactly 0"


def _gradients(fn, weight, grad_out):
    w = weight.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(fn(w), w, grad_out)
    return grad


@pytest.mark.parametrize("backend,device", targets(
    slow_on_interpreter="dropout gradients through the interpreter: 1.5 to 9 s each, ~60 s in all"))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_weight_gradient_with_dropout(case, backend, device, seed):
    """Backward regenerates the mask: the gradient matches the reference's with the same seed, bitwise
    reproducibly (bar as in test_functional: 1e-5 of the summed magnitudes)."""
    dtype = torch.float32
    ids, weight, kwargs = make_inputs(case, device, dtype, seed)
    p = _rate_for(case)
    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(ids.shape + (case.d_model,), generator=g, dtype=torch.float64).to(dtype).to(device)

    def fused(w):
        torch.manual_seed(seed)
        return pf.sinusoidal_embedding(ids, w, dropout_p=p, backend=backend, **kwargs)

    grad = _gradients(fused, weight, grad_out)
    dropout_seed = _seed_drawn_after(seed, device)
    exact_fn = lambda w: reference.sinusoidal_embedding(  # noqa: E731
        ids, w, dropout_p=p, dropout_seed=dropout_seed, **kwargs)
    exact = _gradients(exact_fn, weight.double(), grad_out.double())
    magnitude = _gradients(exact_fn, weight.double(), grad_out.double().abs()).abs()
    assert_within(grad, exact, 1e-5 * magnitude + 1e-30, f"{case.name} grad {backend} p={p}")
    assert torch.equal(grad, _gradients(fused, weight, grad_out)), "not bitwise reproducible"


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("mode,d_pos,layout", [("add", None, "interleaved"), ("concat", 7, "split"),
                                                ("add", None, "split_cos_first")])
def test_backward_uses_the_forward_mask(mode, d_pos, layout, backend, device, seed):
    """One token per row and a PE-free table of ones: forward gives keep * scale per element, and so
    does the gradient of sum(output); both must agree bit for bit (a mask regenerated wrongly, or
    a stored one misaligned, differs in about half the elements)."""
    tokens, d_model = 40, 21
    token_width = d_model - d_pos if mode == "concat" else d_model
    weight = torch.ones(tokens, token_width, device=device, requires_grad=True)
    ids = torch.randperm(tokens, device=device).reshape(4, 10)
    torch.manual_seed(seed)
    out = pf.sinusoidal_embedding(ids, weight, mode=mode, d_pos=d_pos, layout=layout, pe_scale=0.0,
                                  dropout_p=0.5, backend=backend)
    (grad,) = torch.autograd.grad(out.sum(), weight)
    forward_mask = out.detach().reshape(-1, d_model)[:, :token_width]
    assert torch.equal(grad[ids.reshape(-1)], forward_mask)
    assert 0 < int(torch.count_nonzero(forward_mask)) < forward_mask.numel()


def _binomial_ok(count: int, n: int, rate: float, sigmas: float = 6.0) -> bool:
    return abs(count - n * rate) <= sigmas * math.sqrt(n * rate * (1 - rate)) + 1


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_reference_mask_statistics(p):
    """Keep rate 1 - p overall, per column lane (c % 4, the four words of one Philox call), and
    independence of neighbours along columns, within a call and across calls, and along tokens
    (P(both kept) = (1 - p)**2), over 2**20 elements."""
    tokens, width = 1024, 1024
    keep = reference.dropout_keep(torch.tensor([987654321987]), tokens, width, _dropout.threshold_of(p))
    rate = 1 - p
    assert _binomial_ok(int(keep.sum()), keep.numel(), rate)
    for lane in range(4):
        lane_keep = keep[:, lane::4]
        assert _binomial_ok(int(lane_keep.sum()), lane_keep.numel(), rate), f"lane {lane}"
    pairs = {"columns within a call": (keep[:, 0::4], keep[:, 1::4]),
             "columns across calls": (keep[:, 3:-1:4], keep[:, 4::4]),
             "tokens": (keep[:-1], keep[1:])}
    for what, (a, b) in pairs.items():
        both = a & b
        assert _binomial_ok(int(both.sum()), both.numel(), rate * rate), what


@pytest.mark.parametrize("backend,device", targets(
    slow_on_interpreter="a large dropout sample through the interpreter: ~25 s"))
@pytest.mark.parametrize("p", [0.2, 0.7])
def test_keep_rate_and_scale(p, backend, device, seed):
    """On each backend: kept elements carry exactly scale * value (value 1 here), the keep rate is
    1 - p and the mean output is the no-dropout value (E[keep * scale] = 1)."""
    weight = torch.ones(1, 256, device=device)
    ids = torch.zeros(64, 32, dtype=torch.int64, device=device)
    torch.manual_seed(seed)
    out = pf.sinusoidal_embedding(ids, weight, pe_scale=0.0, dropout_p=p, backend=backend).cpu()
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    kept = out != 0
    assert bool((out[kept] == scale).all())
    n = out.numel()
    assert _binomial_ok(int(kept.sum()), n, 1 - p)
    mean_sigma = math.sqrt(p / (1 - p) / n)  # std of keep * scale is sqrt(p / (1 - p))
    assert abs(out.double().mean().item() - 1.0) <= 6 * mean_sigma


@pytest.mark.parametrize("backend,device", TARGETS)
def test_same_seed_same_output_and_fresh_masks(backend, device, seed):
    layer = pf.SinusoidalEmbedding(30, 24, dropout=0.5, backend=backend).to(device)
    ids = torch.randint(0, 30, (3, 16), device=device)
    torch.manual_seed(seed)
    first, second = layer(ids), layer(ids)
    torch.manual_seed(seed)
    assert torch.equal(layer(ids), first), "torch.manual_seed does not reproduce the output"
    agree = ((first == 0) == (second == 0)).double().mean().item()
    assert agree < 0.8, "two calls drew the same mask"  # independent masks agree on half the elements


@pytest.mark.parametrize("backend,device", TARGETS)
def test_eval_mode_is_exact_and_draws_nothing(backend, device, seed):
    layer = pf.SinusoidalEmbedding(30, 24, dropout=0.5, backend=backend).to(device)
    plain = pf.SinusoidalEmbedding(30, 24, backend=backend).to(device)
    plain.load_state_dict(layer.state_dict())
    ids = torch.randint(0, 30, (3, 16), device=device)
    layer.eval()
    rng_state = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    state = rng_state()
    out = layer(ids)
    assert torch.equal(rng_state(), state), "eval mode consumed random numbers"
    assert torch.equal(out, plain(ids))
    functional = pf.sinusoidal_embedding(ids, layer.weight, dropout_p=0.5, training=False, backend=backend)
    assert torch.equal(functional, out)
    exact = reference.sinusoidal_embedding(ids, layer.weight.double())
    assert_within(out, exact, output_bound(exact, torch.float32), "eval")


@pytest.mark.parametrize("backend,device", TARGETS)
def test_only_ids_and_seed_are_saved_for_backward(backend, device):
    """No mask (or output) is kept for backward: the saved tensors are the ids and the 1-element seed."""
    weight = torch.randn(50, 64, device=device, requires_grad=True)
    ids = torch.randint(0, 50, (4, 32), device=device)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pf.sinusoidal_embedding(ids, weight, dropout_p=0.3, backend=backend)
    assert sorted(saved) == [1, ids.numel()]


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_bad_rate_is_rejected(p):
    ids, weight = torch.zeros(2, 3, dtype=torch.int64), torch.randn(4, 8)
    with pytest.raises(ValueError, match="dropout probability") as info:
        pf.sinusoidal_embedding(ids, weight, dropout_p=p)
    assert repr(p) in str(info.value)
    with pytest.raises(ValueError, match="dropout probability"):
        pf.SinusoidalEmbedding(4, 8, dropout=p)


def test_reference_needs_a_valid_seed():
    ids, weight = torch.zeros(2, 3, dtype=torch.int64), torch.randn(4, 8)
    with pytest.raises(ValueError, match="dropout_seed"):
        reference.sinusoidal_embedding(ids, weight, dropout_p=0.5)
    with pytest.raises(ValueError, match="-1"):
        reference.sinusoidal_embedding(ids, weight, dropout_p=0.5, dropout_seed=-1)
    with pytest.raises(ValueError, match="-5"):
        reference.sinusoidal_embedding(ids, weight, dropout_p=0.5, dropout_seed=torch.tensor([-5]))
    with pytest.raises(ValueError, match="int64"):
        reference.sinusoidal_embedding(ids, weight, dropout_p=0.5, dropout_seed=torch.tensor([5], dtype=torch.int32))


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("p", [1.0, 1.0 - 2.0**-40], ids=["one", "below_one"])
def test_rate_one_gives_zeros_and_zero_gradient(p, backend, device):
    """p = 1, and p too close to 1 for a 32-bit threshold, drop everything (no huge scale)."""
    weight = torch.randn(10, 8, device=device, requires_grad=True)
    out = pf.sinusoidal_embedding(torch.arange(10, device=device), weight, dropout_p=p, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    (grad,) = torch.autograd.grad(out.sum(), weight)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_rate_is_checked_at_every_call():
    """Like F.dropout: a module attribute changed later, and a rate given with training=False."""
    layer = pf.SinusoidalEmbedding(4, 8, dropout=0.1)
    layer.dropout = 1.5
    with pytest.raises(ValueError, match="1.5"):
        layer(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="-0.5"):
        pf.sinusoidal_embedding(torch.zeros(2, 3, dtype=torch.int64), layer.weight, dropout_p=-0.5, training=False)


def test_op_needs_a_seed_for_dropout():
    from posenc_fast import _dropout as host

    with pytest.raises(ValueError, match="dropout_seed"):
        host.dropout_for(None, 0.25)
    assert host.dropout_for(None, 0.0) is None


def test_module_repr_shows_dropout():
    assert "dropout=0.1" in repr(pf.SinusoidalEmbedding(10, 8, dropout=0.1))
    assert "dropout" not in repr(pf.SinusoidalEmbedding(10, 8))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiles_fullgraph_with_dropout(dynamic):
    """The seed draw and the op trace into one graph; with the same torch seed, compiled and eager
    draw the same seed and give the same output and gradient.  With dynamic shapes the op's fake
    implementation still gives the output's shape, not its standard-ops decomposition (which has
    no dropout: ops.py, ONNX)."""
    layer = pf.SinusoidalEmbedding(30, 16, mode="concat", d_pos=6, dropout=0.4)

    def step(ids):
        out = layer(ids)
        return out, torch.autograd.grad(out.square().sum(), layer.weight)[0]

    torch._dynamo.reset()
    compiled = torch.compile(lambda i: layer(i).square().sum(), fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for shape in [(2, 9), (3, 5)]:
        ids = torch.randint(0, 30, shape)
        torch.manual_seed(7)
        loss = compiled(ids)
        (grad,) = torch.autograd.grad(loss, layer.weight)
        torch.manual_seed(7)
        eager_out, eager_grad = step(ids)
        torch.testing.assert_close(loss, eager_out.square().sum())
        torch.testing.assert_close(grad, eager_grad)
