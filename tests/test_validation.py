"""Bad input gets a clear Python exception naming the bad value, before any kernel runs, on every backend."""

import math
import warnings

import pytest
import torch

import posenc_fast as pf
from posenc_fast import backends, reference
from posenc_fast._dispatch import BACKENDS
from posenc_fast._validate import make_spec

from cases import backend_targets

TARGETS = backend_targets()


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail loudly if any backend's forward or backward is reached."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel ran before the input was rejected")

    for module in BACKENDS.values():
        monkeypatch.setattr(module, "forward", forbidden)
        monkeypatch.setattr(module, "backward", forbidden)


def _inputs(device, vocab=10, width=8, dtype=torch.float32):
    ids = torch.randint(0, vocab, (2, 5), device=device)
    weight = torch.randn(vocab, width, device=device, dtype=dtype)
    return ids, weight


def _nested_rows(t):
    """``t``'s rows as a nested tensor (torch.nested: 2-D, no sizes of its own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (its API "in prototype stage")
        return torch.nested.nested_tensor(list(t.unbind(0)))


BAD_CALLS = [
    # (name, exception, message fragment, call(ids, weight) -> kwargs / replacement)
    ("float_ids", TypeError, "float32", lambda ids, w: dict(ids=ids.float())),
    ("int16_ids", TypeError, "int16", lambda ids, w: dict(ids=ids.short())),
    ("nested_ids", TypeError, "nested", lambda ids, w: dict(ids=_nested_rows(ids))),
    ("nested_packed_ids", TypeError, "nested", lambda ids, w: dict(
        ids=_nested_rows(ids), cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32, device=ids.device))),
    ("id_too_large", IndexError, "id 10 ", lambda ids, w: dict(ids=torch.where(ids == ids[0, 0], 10, ids))),
    ("negative_id", IndexError, "id -3", lambda ids, w: dict(ids=torch.where(ids == ids[0, 0], -3, ids))),
    ("weight_1d", ValueError, "[80]", lambda ids, w: dict(weight=w.reshape(-1))),
    ("weight_3d", ValueError, "[2, 5, 8]", lambda ids, w: dict(weight=w.reshape(2, 5, 8))),
    ("weight_int", TypeError, "int64", lambda ids, w: dict(weight=w.long())),
    ("weight_nested", TypeError, "nested", lambda ids, w: dict(weight=_nested_rows(w))),
    ("unknown_mode", ValueError, "'sum'", lambda ids, w: dict(mode="sum")),
    ("unknown_layout", ValueError, "'blocked'", lambda ids, w: dict(layout="blocked")),
    ("concat_without_d_pos", ValueError, "d_pos", lambda ids, w: dict(mode="concat")),
    ("d_pos_with_add", ValueError, "d_pos=4", lambda ids, w: dict(d_pos=4)),
    ("d_pos_zero", ValueError, "d_pos=0", lambda ids, w: dict(mode="concat", d_pos=0)),
    ("d_pos_negative", ValueError, "d_pos=-2", lambda ids, w: dict(mode="concat", d_pos=-2)),
    ("d_pos_not_int", TypeError, "2.5", lambda ids, w: dict(mode="concat", d_pos=2.5)),
    ("d_pos_is_whole_width", ValueError, "d_pos=3", lambda ids, w: dict(mode="concat", d_pos=3, weight=w[:, :0])),
    ("offset_wrong_shape", ValueError, "[5]", lambda ids, w: dict(offset=torch.zeros(5, dtype=torch.int64, device=ids.device))),
    ("offset_float_tensor", TypeError, "float32", lambda ids, w: dict(offset=torch.zeros(2, device=ids.device))),
    ("offset_float", TypeError, "1.5", lambda ids, w: dict(offset=1.5)),
    ("positions_not_broadcastable", ValueError, "[3]", lambda ids, w: dict(positions=torch.arange(3, device=ids.device))),
    ("positions_bigger", ValueError, "[4, 5]", lambda ids, w: dict(positions=torch.zeros(4, 5, dtype=torch.int64, device=ids.device))),
    ("positions_float", TypeError, "float32", lambda ids, w: dict(positions=torch.zeros(2, 5, device=ids.device))),
    ("positions_with_offset", ValueError, "offset=7", lambda ids, w: dict(positions=torch.arange(5, device=ids.device), offset=7)),
    ("positions_with_offset_tensor", ValueError, "offset", lambda ids, w: dict(positions=torch.arange(5, device=ids.device), offset=torch.ones(2, dtype=torch.int64, device=ids.device))),
    ("ids_on_other_device", ValueError, "meta", lambda ids, w: dict(ids=ids.to("meta"))),
    ("base_zero", ValueError, "base", lambda ids, w: dict(base=0.0)),
    ("base_negative", ValueError, "-2.0", lambda ids, w: dict(base=-2.0)),
    ("base_inf", ValueError, "inf", lambda ids, w: dict(base=math.inf)),
    ("base_nan", ValueError, "nan", lambda ids, w: dict(base=math.nan)),
    ("embed_scale_nan", ValueError, "embed_scale", lambda ids, w: dict(embed_scale=math.nan)),
    ("embed_scale_tensor", TypeError, "embed_scale", lambda ids, w: dict(embed_scale=torch.tensor([1.0, 2.0]))),
    ("pe_scale_complex", TypeError, "pe_scale", lambda ids, w: dict(pe_scale=0j)),
    ("padding_idx_out_of_range", ValueError, "padding_idx=10", lambda ids, w: dict(padding_idx=10)),
    ("unknown_backend", ValueError, "'cudnn'", lambda ids, w: dict(backend="cudnn")),
]


def _call(function, ids, weight, overrides):
    kwargs = dict(overrides)
    ids = kwargs.pop("ids", ids)
    weight = kwargs.pop("weight", weight)
    return function(ids, weight, **kwargs)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("name,error,fragment,make", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_before_any_kernel(name, error, fragment, make, backend, device, no_kernel):
    ids, weight = _inputs(device)
    overrides = make(ids, weight)
    overrides.setdefault("backend", backend)
    with pytest.raises(error) as info:
        _call(pf.sinusoidal_embedding, ids, weight, overrides)
    assert fragment in str(info.value), f"message {str(info.value)!r} does not name {fragment!r}"


_NOT_FOR_REFERENCE = ("unknown_backend", "nested_packed_ids")  # (the reference has no backend or cu_seqlens)


@pytest.mark.parametrize("name,error,fragment,make", [c for c in BAD_CALLS if c[0] not in _NOT_FOR_REFERENCE],
                         ids=[c[0] for c in BAD_CALLS if c[0] not in _NOT_FOR_REFERENCE])
def test_reference_rejects_the_same_inputs(name, error, fragment, make):
    ids, weight = _inputs("cpu")
    with pytest.raises(error) as info:
        _call(reference.sinusoidal_embedding, ids, weight, make(ids, weight))
    assert fragment in str(info.value)


@pytest.mark.parametrize("backend,device", [t for t in TARGETS if t.values[0] == "triton"])
def test_unsupported_dtype_for_backend(backend, device, no_kernel):
    ids, weight = _inputs(device, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        pf.sinusoidal_embedding(ids, weight, backend=backend)


def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ids, weight = _inputs("cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        pf.sinusoidal_embedding(ids, weight, backend="triton")


@pytest.mark.parametrize("backend,device", TARGETS)
def test_id_check_off_never_reads_outside_the_table(backend, device):
    """With the range check off an out-of-range id contributes a zero token vector and no gradient."""
    ids, weight = _inputs(device)
    bad = ids.clone()
    bad[0, 1], bad[1, 3] = 10**9, -1  # -1 is also the "no pe_zero_id" code: it must keep its PE
    weight.requires_grad_()
    with pf.id_check(False):
        assert not pf.id_check_enabled()
        out = pf.sinusoidal_embedding(bad, weight, backend=backend)
        grad = torch.autograd.grad(out.sum(), weight)[0]
    assert pf.id_check_enabled()
    pe = reference.sinusoidal_table(torch.arange(5), 8, dtype=torch.float32).to(device)
    torch.testing.assert_close(out[0, 1], pe[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1, 3], pe[3], rtol=0, atol=1e-6)
    counts = torch.bincount(torch.cat([ids[0, :1], ids[0, 2:], ids[1, :3], ids[1, 4:]]).cpu(), minlength=10)
    torch.testing.assert_close(grad.cpu(), counts[:, None].float().expand(10, 8), rtol=0, atol=1e-6)


@pytest.mark.parametrize("argument,valid,invalid", [
    ("embed_scale", 1, True), ("pe_scale", 0, False), ("padding_idx", 1, True), ("padding_idx", 1, 1.0),
    ("d_pos", 4, 4.0), ("zero_pe_at_padding", False, 0), ("base", 10000, torch.tensor(10000.0)),
])
def test_a_repeated_call_is_checked_as_the_first(argument, valid, invalid):
    """make_spec remembers the arguments it has checked (a functional call builds its spec on every call);
    an argument equal to a checked one but of a type the checks refuse (True == 1, 1.0 == 1) is still refused."""
    weight = torch.randn(10, 8)
    ids = torch.randint(0, 10, (2, 3))
    kwargs = {"mode": "concat"} if argument == "d_pos" else {}
    if argument != "padding_idx":
        kwargs["padding_idx"] = 2
    for _ in range(2):
        pf.sinusoidal_embedding(ids, weight, **kwargs, **{argument: valid})
    with pytest.raises((TypeError, ValueError), match=argument):
        pf.sinusoidal_embedding(ids, weight, **kwargs, **{argument: invalid})


@pytest.mark.parametrize("argument", ["embed_scale", "pe_scale"])
def test_a_zero_scale_keeps_its_sign_through_the_spec_caches(argument):
    """-0.0 == 0.0 with one hash, but w * -0.0 and w * 0.0 differ in sign: a spec remembered for one zero is
    not handed out for the other (make_spec's checked-argument cache, or the spec cache beneath it), in
    either order and through the functional call that builds its spec each time."""
    weight = torch.randn(10, 8)
    ids = torch.randint(0, 10, (2, 3))
    for zeros in ((-0.0, 0.0, -0.0), (0.0, -0.0, 0.0), (0, -0.0)):
        for zero in zeros:
            spec = make_spec(10, 8, "add", None, 10000.0, "interleaved", **{"embed_scale": 1.0, "pe_scale": 1.0,
                                                                              argument: zero}, padding_idx=None)
            assert math.copysign(1.0, getattr(spec, argument)) == math.copysign(1.0, zero), (zeros, zero)
            out = pf.sinusoidal_embedding(ids, weight, backend="torch", offset=5, **{argument: zero})
            exact = reference.sinusoidal_embedding(ids, weight.double(), offset=5, **{argument: zero})
            assert torch.equal(torch.signbit(out), torch.signbit(exact.float())), (zeros, zero)
