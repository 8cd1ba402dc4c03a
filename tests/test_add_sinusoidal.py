"""posenc_fast.add_sinusoidal / SinusoidalPositionalEncoding (the PE added to a float tensor) on every
backend target against float64 math, its torch.library registration (opcheck) and torch.compile.

The cases are the add-mode entries of ``cases.CASES`` (their widths, layouts, frequencies, scales,
position arguments and precisions), with ``x`` of shape ``ids.shape + (D,)`` in place of the ids.
"""

import pytest
import torch

import posenc_fast as pf
from posenc_fast import ops, reference
from posenc_fast._validate import make_spec

from cases import CASES, assert_within, backend_targets, cases_on_targets, make_inputs, output_bound

TARGETS = backend_targets()
ADD_CASES = [c for c in CASES if c.mode == "add" and not c.zero_pe_at_padding]


def _arguments(case, device, dtype, seed):
    """x, the add_sinusoidal keyword arguments, and the int64 position of every row (for the reference)."""
    ids, _, kwargs = make_inputs(case, device, dtype, seed)
    g = torch.Generator().manual_seed(seed + 11)
    x = torch.randn(ids.shape + (case.d_model,), generator=g, dtype=torch.float64).to(dtype).to(device)
    add_kwargs = dict(layout=kwargs["layout"], x_scale=kwargs["embed_scale"], pe_scale=kwargs["pe_scale"])
    for name in ("frequencies", "precision", "positions", "offset"):
        if name in kwargs:
            add_kwargs[name] = kwargs[name]
    seq_len = ids.shape[-1] if ids.dim() else 1
    t = torch.arange(seq_len, dtype=torch.int64)
    if "positions" in kwargs:
        positions = kwargs["positions"].cpu().to(torch.int64).expand(ids.shape)
    elif isinstance(kwargs.get("offset"), torch.Tensor):
        positions = kwargs["offset"].cpu().unsqueeze(-1) + t
    elif ids.dim():
        positions = (kwargs.get("offset", 0) + t).expand(ids.shape)
    else:
        positions = torch.tensor(kwargs.get("offset", 0))
    return x, add_kwargs, positions


def _exact(case, x, add_kwargs, positions):
    pe = reference.sinusoidal_table(positions, case.d_model, layout=add_kwargs["layout"],
                                    frequencies=add_kwargs.get("frequencies"))
    return x.double().cpu() * add_kwargs["x_scale"] + pe * add_kwargs["pe_scale"]


@pytest.mark.parametrize("case,dtype,backend,device", cases_on_targets(ADD_CASES, [torch.float32, torch.bfloat16]))
def test_add_matches_float64_and_gradient_is_scaled(case, dtype, backend, device, seed):
    x, add_kwargs, positions = _arguments(case, device, dtype, seed)
    x.requires_grad_(True)
    out = pf.add_sinusoidal(x, backend=backend, **add_kwargs)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    exact = _exact(case, x.detach(), add_kwargs, positions)
    precision = add_kwargs.get("precision", "float32")
    assert_within(out, exact, output_bound(exact, dtype, precision), f"{case.name} {backend} {dtype}")
    if out.numel():
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        (grad,) = torch.autograd.grad(out, x, grad_out.to(dtype).to(device))
        exact_grad = grad_out.to(dtype).double() * add_kwargs["x_scale"]
        assert_within(grad, exact_grad, output_bound(exact_grad, dtype), f"{case.name} gradient")


@pytest.mark.parametrize("backend,device", TARGETS)
def test_add_packed_sequences_and_module(backend, device, seed):
    """cu_seqlens restarts positions per sequence; the module is the functional op with a preset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(11, 10, generator=g).to(device)
    cu_seqlens = torch.tensor([0, 4, 4, 11], device=device)
    layer = pf.SinusoidalPositionalEncoding.from_preset("whisper", 10, backend=backend).to(device)
    out = layer(x, cu_seqlens=cu_seqlens)
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6])
    exact = x.double().cpu() + reference.sinusoidal_table(positions, 10, layout="split",
                                                          frequencies=pf.presets.get("whisper").frequencies(10))
    assert_within(out, exact, output_bound(exact, torch.float32), "packed")
    assert "preset='whisper'" in repr(layer)
    scaled = pf.SinusoidalPositionalEncoding.from_preset("fairseq", 10, backend=backend)
    assert scaled.spec.embed_scale == 10 ** 0.5  # the preset's embed scale is x_scale


def test_add_rejects_bad_input():
    with pytest.raises(TypeError, match="floating-point"):
        pf.add_sinusoidal(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="offset tensor has shape"):
        pf.add_sinusoidal(torch.ones(2, 3, 4), offset=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="do not broadcast"):
        pf.add_sinusoidal(torch.ones(2, 3, 4), positions=torch.arange(4))
    layer = pf.SinusoidalPositionalEncoding(8)
    with pytest.raises(ValueError, match="width 6"):
        layer(torch.ones(2, 6))


def _op_args(device, backend, kind):
    spec = make_spec(1, 10, "add", None, 10000.0, "split", 1.5, 0.5, None)
    x = torch.randn(12, 10, device=device, requires_grad=True)
    positions = torch.randint(-1000, 1000, (12,), device=device) if kind == "positions" else None
    offsets = torch.tensor([5, -9, 2**30], device=device) if kind == "offsets" else None
    return (x, spec.turns_tensor(device), positions, offsets, 7 if kind == "offset" else 0, 4, spec.columns.as_list(),
            spec.embed_scale, spec.pe_scale, False, backend)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("kind", ["offset", "offsets", "positions"])
def test_opcheck_add(backend, device, kind):
    torch.library.opcheck(ops.add_sinusoidal_op, _op_args(device, backend, kind))


def test_add_compiles_fullgraph():
    layer = pf.SinusoidalPositionalEncoding.from_preset("whisper", 8)
    conv = torch.nn.Conv1d(4, 8, 3, padding=1)

    def step(features):
        return layer(torch.nn.functional.gelu(conv(features)).permute(0, 2, 1)).square().sum()

    features = torch.randn(2, 4, 6)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    expected = step(features)
    expected_grad = torch.autograd.grad(expected, conv.weight)[0]
    got = compiled(features)
    got_grad = torch.autograd.grad(got, conv.weight)[0]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grad, expected_grad)
