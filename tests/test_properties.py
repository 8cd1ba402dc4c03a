"""Property-based test (hypothesis): random valid and invalid argument combinations on every backend.

Every call either matches the float64 reference (forward, and the weight gradient for float32
tables) or raises a clear ValueError, TypeError or IndexError; never another exception, an
internal message, or a result the reference would have refused.  The example count is bounded
(``EXAMPLES`` per backend: about 35 s for the three CPU targets on two cores); the draws follow the
session seed (POSENC_FAST_TEST_SEED) and are printed, shrunk, on failure.
"""

import math
import re

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import posenc_fast as pf  # noqa: E402
from posenc_fast import reference  # noqa: E402

from cases import assert_within, output_bound, targets  # noqa: E402
from conftest import SESSION_SEED  # noqa: E402

EXAMPLES = 150
CLEAR_ERRORS = (ValueError, TypeError, IndexError)
# Messages that come from inside PyTorch, Triton or CUDA rather than from argument checking.
OPAQUE = re.compile(r"size of tensor|cudaError|InterpreterError|Cannot copy out of meta|out of bounds for dimension|"
                    r"must match the size|expected scalar type|not implemented for|Did you forget")

INT64 = st.integers(-(2**63), 2**63 - 1)
GOOD_SCALES = [1.0, 0.0, -2.5, 0.125, 1e30, -3e38]
BAD_SCALES = [3.5e38, float("nan"), float("inf"), 10**400]


@st.composite
def calls(draw):
    """(ids, weight, keyword arguments, id check on) for one call.  In half the calls each argument has one
    chance in four of an invalid value; the others are valid throughout."""
    some_invalid = draw(st.booleans())

    def pick(good, bad):
        if some_invalid and bad and draw(st.integers(0, 3)) == 0:
            return draw(st.sampled_from(bad))
        return draw(good if isinstance(good, st.SearchStrategy) else st.sampled_from(good))

    vocab = draw(st.integers(0, 12))
    mode = pick(["add", "add", "concat"], ["sum", None])
    token_width = draw(st.integers(1, 12))
    kwargs = dict(mode=mode)
    if mode == "concat":
        kwargs["d_pos"] = pick(st.integers(1, 9), [0, -1, 2.0, None, True])
    pe_width = kwargs.get("d_pos") if mode == "concat" else token_width
    kwargs["layout"] = pick(["interleaved", "split", "split_cos_first"], ["zigzag", 3])
    if draw(st.booleans()):
        kwargs["embed_scale"] = pick(GOOD_SCALES, BAD_SCALES)
    if draw(st.booleans()):
        kwargs["pe_scale"] = pick(GOOD_SCALES, BAD_SCALES)
    if draw(st.integers(0, 3)) == 0:
        kwargs["base"] = pick([10.0, 1.5, 5e-324, 1e300], [0.0, -3.0, float("nan"), "10000"])
    if draw(st.integers(0, 3)) == 0:
        kwargs["padding_idx"] = pick(st.integers(-vocab, vocab - 1) if vocab else st.none(), [vocab, -vocab - 1, 1.0])
        kwargs["zero_pe_at_padding"] = kwargs["padding_idx"] is not None and draw(st.booleans())
    if isinstance(pe_width, int) and pe_width > 0 and draw(st.integers(0, 4)) == 0:
        half = pe_width // 2
        count = pick([half, half + pe_width % 2], [half + 2, max(half - 1, 0)])
        rates = [draw(st.floats(-50.0, 50.0, allow_nan=False)) for _ in range(count)]
        kind = pick(["list", "tensor"], ["string", "inf"])
        kwargs["frequencies"] = {"list": rates, "tensor": torch.tensor(rates, dtype=torch.float64),
                                 "string": "".join(str(i % 10) for i in range(count)),
                                 "inf": rates[:-1] + [float("inf")]}[kind]
    if draw(st.integers(0, 5)) == 0:
        kwargs["precision"] = pick(["float64", "float32"], ["double"])

    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    ids_dtype = pick([torch.int64, torch.int32], [torch.int16, torch.float32])
    numel = math.prod(shape)
    low, high = (-3, vocab + 3) if pick([False], [True]) else (0, max(vocab - 1, 0))
    ids = torch.tensor([draw(st.integers(low, high)) for _ in range(numel)], dtype=torch.int64).reshape(shape)
    ids = ids.to(ids_dtype)
    if ids.dim() >= 2 and draw(st.booleans()):  # a non-contiguous view of the same ids
        ids = ids.transpose(0, -1).contiguous().transpose(0, -1)

    sequences = shape[:-1]
    rule = draw(st.sampled_from(["none", "int", "tensor", "positions", "cu_seqlens"]))
    if rule == "int":
        kwargs["offset"] = pick(st.one_of(st.integers(-1000, 1000), INT64), [2**63, 1.5, True])
    elif rule == "tensor":
        offset_shape = pick([sequences, ()], [(draw(st.integers(0, 4)),), (1,) + sequences])
        offsets = torch.tensor([draw(st.integers(-(2**40), 2**40)) for _ in range(math.prod(offset_shape))],
                               dtype=torch.int64).reshape(offset_shape)
        kwargs["offset"] = offsets.to(pick([torch.int64, torch.int32], [torch.float32]))
    elif rule == "positions":
        positions_shape = pick([shape, shape[-1:]], [shape + (2,), (7,)])
        positions = torch.tensor([draw(INT64) for _ in range(math.prod(positions_shape))],
                                 dtype=torch.int64).reshape(positions_shape)
        kwargs["positions"] = positions.to(pick([torch.int64], [torch.float64, torch.bool]))
    elif rule == "cu_seqlens":
        length = shape[-1] if shape else 1
        cuts = sorted(draw(st.lists(st.integers(0, length), max_size=3)))
        cu = [0] + cuts + [length]
        if pick([False], [True]):
            cu[draw(st.integers(0, len(cu) - 1))] += draw(st.sampled_from([-2, 1, 3]))
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=pick([torch.int32, torch.int64], [torch.float32]))

    weight_dtype = pick([torch.float32, torch.float32, torch.bfloat16, torch.float16],
                        [torch.float64, torch.int64])
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    weight = torch.randn(vocab, token_width, dtype=torch.float64, generator=generator) * 2
    if vocab and pick([False], [True]):
        weight[0] = float("inf")  # an out-of-range id must not pick it up (id check off)
        kwargs["_inf_row"] = True
    weight = weight.to(weight_dtype)
    if draw(st.integers(0, 5)) == 0:
        weight = torch.cat([weight, weight], dim=1)[:, :token_width]  # a strided table
    check_ids = draw(st.booleans())
    return ids, weight, kwargs, check_ids


def _reference(ids, weight, kwargs):
    kwargs = dict(kwargs)
    cu_seqlens = kwargs.pop("cu_seqlens", None)
    if cu_seqlens is not None:
        kwargs["positions"] = pf.packed_positions(cu_seqlens, ids.shape[-1] if ids.dim() else 1)
    return reference.sinusoidal_embedding(ids, weight.double() if weight.is_floating_point() else weight, **kwargs)


def _token_terms(ids, weight, kwargs):
    """|embed_scale * W[id]| per element (0 in PE-only columns)."""
    token_kwargs = dict(kwargs, embed_scale=abs(kwargs.get("embed_scale", 1.0)), pe_scale=0.0)
    return _reference(ids, weight.abs().nan_to_num(posinf=0.0), token_kwargs).abs().double()


def _assert_matches(actual, exact, bound, what):
    """assert_within, where a non-finite reference element in the output dtype (an inf row read by an
    in-range id, its NaN from inf * 0, or a sum beyond the dtype's range) must be the same inf or NaN."""
    rounded = exact.to(actual.dtype).to(torch.float64)
    special = ~torch.isfinite(rounded)
    same = (actual.double() == rounded) | (torch.isnan(actual) & torch.isnan(rounded))
    assert bool(same[special].all()), f"{what}: non-finite reference elements differ"
    assert_within(torch.where(special, 0.0, actual.double()), torch.where(special, 0.0, exact),
                  torch.where(special, 1.0, bound), what)


def _assert_clear(error):
    assert isinstance(error, CLEAR_ERRORS), f"unclear exception {type(error).__name__}: {error}"
    assert str(error) and not OPAQUE.search(str(error)), f"unclear message: {error}"


def _check_call(backend, device, ids, weight, kwargs, check_ids):
    inf_row = kwargs.pop("_inf_row", False)
    ids, weight = ids.to(device), weight.to(device)
    trainable = weight.dtype == torch.float32 and not inf_row
    if trainable:
        weight = weight.detach().requires_grad_()
    with pf.id_check(check_ids):
        try:
            out = pf.sinusoidal_embedding(ids, weight, backend=backend, **kwargs)
        except CLEAR_ERRORS as error:
            _assert_clear(error)
            return "refused"
        except Exception as error:  # anything else fails the property, with its message
            _assert_clear(error)
        try:
            exact = _reference(ids.cpu(), weight.detach().cpu(), kwargs)
        except CLEAR_ERRORS as error:
            raise AssertionError(f"{backend} accepted what the reference refuses ({error})") from None
        precision = kwargs.get("precision", "float32")
        assert out.dtype == weight.dtype and out.shape == exact.shape
        # Arithmetic error is relative to the terms, not to their sum: with scales like 1e30 and a token
        # and a PE term that cancel, fp32 (or float64) rounding of each term is what bounds the result.
        # |embed_scale * W[id]| + |pe_scale| bounds the terms an element sums.
        token_terms = _token_terms(ids.cpu(), weight.detach().cpu(), kwargs)
        terms = token_terms + abs(kwargs.get("pe_scale", 1.0))
        relative = 2.0**-50 if precision == "float64" else 2.0**-22
        bound = output_bound(exact, weight.dtype, precision) + terms * relative
        actual = out.detach().cpu()
        if precision == "float32" and backend != "torch":
            # Documented limit of float32 arithmetic (docs/design.md, "Hostile input"): a token term
            # beyond the float32 range overflows to inf before the PE is added, even where the float64
            # sum is back in range.  Such elements may be that inf; every other element is checked.
            overflow = (token_terms > torch.finfo(torch.float32).max) & torch.isinf(actual)
            actual, exact = torch.where(overflow, 0.0, actual), torch.where(overflow, 0.0, exact.double())
        _assert_matches(actual, exact, bound, f"{backend} forward")
        if trainable and out.numel():
            grad_out = torch.randn(out.shape, dtype=torch.float64)
            (grad,) = torch.autograd.grad(out, weight, grad_out.to(device).float())
            w64 = weight.detach().cpu().double().requires_grad_()
            reference_out = _reference(ids.cpu(), w64, kwargs)
            (want,) = torch.autograd.grad(reference_out, w64, grad_out)
            (magnitude,) = torch.autograd.grad(_reference(ids.cpu(), w64, kwargs), w64, grad_out.abs())
            _assert_matches(grad.cpu(), want, 1e-5 * magnitude.abs() + 1e-30, f"{backend} weight gradient")
    return "computed"


@pytest.mark.parametrize("backend,device", targets(
    slow_on_interpreter="hypothesis examples through the interpreter: ~10 s"))
def test_every_call_matches_the_reference_or_is_refused_clearly(backend, device):
    outcomes = []

    @hypothesis_seed(SESSION_SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(calls())
    def run(call):
        ids, weight, kwargs, check_ids = call
        outcomes.append(_check_call(backend, device, ids, weight, kwargs, check_ids))

    run()
    # Both kinds of outcome were exercised (the strategy is meant to draw both).
    assert "computed" in outcomes and "refused" in outcomes, outcomes
