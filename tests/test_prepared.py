"""posenc_fast._prepared: every entry point's repeated eager call (inference and training) through its prepared launch.

The prepared launch must be invisible: every call it serves gives what the general path gives (the
float64 reference's bars, and bit for bit the general path of the same backend), and whatever a user
changes between calls (the table's values, storage, dtype, size or device, the module's settings,
grad mode, the backend's extension) either keeps it valid or sends the call back to the general path.
"""

import copy
import functools
import itertools
import pickle
import sys
import warnings

import pytest
import torch
from torch import nn

import posenc_fast as pf
from posenc_fast import _prepared, functional, reference
from posenc_fast.backends import cpu_backend, cuda_backend
from posenc_fast.backends._extension import Extension

from cases import (CASES, PREPARED_BACKENDS, assert_within, backend_targets, cases_on_targets, make_inputs,
                   output_bound, targets)

TARGETS = backend_targets()
# The refusals of bad calls are posenc_fast's own checks, made before any launch, so every target checks
# the same code; through Triton's interpreter they take 10 to 13 s each, so they run there only with -m slow
# (and natively wherever a GPU runs the suite).
REFUSAL_TARGETS = targets(slow_on_interpreter="bad calls after prepared ones, through the interpreter: 10 to 13 s each")
TRITON_INTERPRETER = [t for t in TARGETS if t.values[0] == "triton" and t.values[1] == "cpu"]
# Cases whose positions an int offset gives: the calls a prepared launch serves.
OFFSET_CASES = [c for c in CASES if c.position_rule in ("zero", "int")]


@pytest.fixture
def prepared_runs(monkeypatch):
    """How many calls the prepared launch served (``PreparedForward.run`` returned an output)."""
    served = []

    def counting(run):
        def counting_run(self, *args):
            out = run(self, *args)
            if out is not None:
                served.append(out)
            return out
        return counting_run

    for kind in (_prepared.PreparedForward, _prepared.PreparedAddition):
        monkeypatch.setattr(kind, "run", counting(kind.run))
    return served


def _general_path_only(patch):
    """No prepared launch serves a call (each takes the general path)."""
    for kind in (_prepared.PreparedForward, _prepared.PreparedAddition):
        patch.setattr(kind, "run", lambda self, *args: None)


def _no_functional_attempt(patch):
    """The functional entry points try no prepared launch: their own eager check (not the general path's route,
    ``_dispatch.route``) says the call is not eager."""
    patch.setattr(functional, "_eager_call", lambda *args: False)


def _layer(case, weight, backend, **extra):
    """The module for ``case`` around ``weight`` (a copy, so that tests may change it)."""
    _, _, kwargs = make_inputs(case, "cpu", torch.float32, 0)
    settings = {k: v for k, v in kwargs.items() if k not in ("offset", "positions")}
    return pf.SinusoidalEmbedding.from_pretrained(weight.clone(), backend=backend, **settings, **extra)


class _ServesNothing:
    """A module's prepared launch that serves no call and is never prepared again: every call takes the
    general path."""

    def run(self, *args):
        return None

    def prepared_for(self, *args):
        return True


def _fresh(layer):
    """A copy of ``layer`` whose calls take the general path."""
    twin = copy.deepcopy(layer)
    assert twin._prepared is None
    twin._prepared = _ServesNothing()
    return twin


@pytest.mark.parametrize("case,dtype,backend,device", cases_on_targets(OFFSET_CASES, [torch.float32, torch.bfloat16]))
def test_repeated_calls_match_float64(case, dtype, backend, device, seed, prepared_runs):
    """Decoding-like calls: fresh ids and offsets each time, against the float64 reference."""
    _, weight, _ = make_inputs(case, device, dtype, seed)
    layer = _layer(case, weight, backend).eval()
    g = torch.Generator().manual_seed(seed)
    settings = {k: v for k, v in make_inputs(case, "cpu", torch.float32, 0)[2].items()
                if k not in ("offset", "positions")}
    calls = 4
    with torch.no_grad():
        for call in range(calls):
            ids = torch.randint(0, case.vocab, case.ids_shape, generator=g).to(case.ids_dtype).to(device)
            offset = int(torch.randint(-(2**24), 2**24, (), generator=g)) if call else 0
            out = layer(ids, offset=offset)
            assert out.dtype == dtype and out.shape == ids.shape + (case.d_model,)
            exact = reference.sinusoidal_embedding(ids, layer.weight.double(), offset=offset, **settings)
            assert_within(out, exact, output_bound(exact, dtype, case.precision), f"{case.name} call {call}")
    served = len(prepared_runs)
    assert served == (calls if backend in PREPARED_BACKENDS else 0), served


def _basic_layer(backend, device, **kwargs):
    torch.manual_seed(0)
    return pf.SinusoidalEmbedding(50, 16, padding_idx=1, backend=backend, **kwargs).to(device).eval()


def _ids(device, vocab=50, shape=(3, 5), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)


# What a user may change between two calls, and how the next call must then behave: each entry
# changes the layer (and may return ids to call it with); the call must equal a fresh copy's.
def _scale_weight_in_place(layer):
    with torch.no_grad():
        layer.weight.mul_(-3.0)


def _swap_weight_data(layer):
    layer.weight.data = torch.randn_like(layer.weight)


def _weight_data_to_bfloat16(layer):
    layer.weight.data = layer.weight.data.to(torch.bfloat16)


def _module_to_float16(layer):
    layer.to(torch.float16)


def _new_parameter_with_more_rows(layer):
    layer.weight = nn.Parameter(torch.randn(70, 16, device=layer.weight.device), requires_grad=False)
    return _ids(layer.weight.device, vocab=70, seed=2)  # ids past the old table's end


def _strided_weight(layer):
    wide = torch.randn(50, 24, device=layer.weight.device)
    layer.weight.data = wide[:, :16]  # rows 24 apart: not contiguous


def _other_spec(layer):
    layer.spec = pf.SinusoidalEmbedding(50, 16, padding_idx=1, embed_scale=4.0, layout="split").spec


def _backend_torch(layer):
    layer.backend = "torch"


def _fairseq_positions(layer):
    layer.position_rule = "fairseq"
    ids = _ids(layer.weight.device)
    ids[0, 3:] = 1  # padding: fairseq positions skip it
    return ids


def _vocab_range_set(layer):
    layer.vocab_range, layer.num_embeddings = (10, 60), 60  # the table now holds rows 10..59 of 60: ids below 10 read nothing
    return _ids(layer.weight.device, vocab=60, seed=3)


def _int32_ids(layer):
    return _ids(layer.weight.device).to(torch.int32)


def _transposed_ids(layer):
    return _ids(layer.weight.device, shape=(5, 3)).t()


def _scalar_id(layer):
    return torch.tensor(7, device=layer.weight.device)


def _no_tokens(layer):
    return torch.empty((2, 0), dtype=torch.int64, device=layer.weight.device)


CHANGES = [_scale_weight_in_place, _swap_weight_data, _weight_data_to_bfloat16, _module_to_float16,
           _new_parameter_with_more_rows, _strided_weight, _other_spec, _backend_torch, _fairseq_positions,
           _vocab_range_set, _int32_ids, _transposed_ids, _scalar_id, _no_tokens]


# After these the calls keep taking the general path: another backend, a position rule or vocabulary
# range the prepared launch does not serve, ids or a table that are not contiguous.
GENERAL_PATH_ONLY = {_backend_torch, _fairseq_positions, _vocab_range_set, _transposed_ids, _strided_weight}


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.lstrip("_"))
def test_changes_between_calls(change, backend, device, prepared_runs):
    layer = _basic_layer(backend, device)
    ids = _ids(device)
    with torch.no_grad():
        first = layer(ids, offset=9)
        assert torch.equal(layer(ids, offset=9), first)
        new_ids = change(layer)
        if new_ids is not None:
            ids = new_ids
        want = _fresh(layer)(ids, offset=9)
        got = layer(ids, offset=9)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        served = len(prepared_runs)
        assert torch.equal(layer(ids, offset=9), want)  # and once more, prepared again where it can be
    runs_prepared = backend in PREPARED_BACKENDS and change not in GENERAL_PATH_ONLY
    assert len(prepared_runs) == served + runs_prepared


@pytest.mark.parametrize("backend,device", TARGETS)
def test_prepared_calls_equal_the_general_path_bitwise(backend, device, prepared_runs):
    layer = _basic_layer(backend, device, embed_scale=4.0, layout="split")
    with torch.no_grad():
        for offset in (0, 1, 2**31 + 5, -(2**40), 2**63 - 100):
            ids = _ids(device, seed=offset % 97)
            assert torch.equal(layer(ids, offset=offset), _fresh(layer)(ids, offset=offset)), offset
        for offset in (torch.tensor([0, 7, 2**40], device=device), torch.tensor(5, device=device)):
            assert torch.equal(layer(ids, offset=offset), _fresh(layer)(ids, offset=offset)), offset
    assert len(prepared_runs) == (5 if backend in PREPARED_BACKENDS else 0)  # tensor offsets: general path


@pytest.mark.parametrize("backend,device", REFUSAL_TARGETS)
def test_bad_calls_after_prepared_ones_still_raise(backend, device):
    """Each bad call comes right after good ones (a prepared launch in place where the backend has one)
    and must raise what the general path raises."""
    layer = _basic_layer(backend, device)
    ids = _ids(device)

    def bad_call(error, match, *args, **kwargs):
        with torch.no_grad():
            layer(ids)
            layer(ids, offset=3)
            assert (type(layer._prepared) is _prepared.PreparedForward) == (backend in PREPARED_BACKENDS)
            with pytest.raises(error, match=match):
                layer(*args, **kwargs)

    bad_call(IndexError, "id 50 is out of range", torch.full_like(ids, 50))
    one_bad = ids.clone()
    one_bad.view(-1)[-1] = -3  # one id, the last one: the CPU launch's own scan must see it
    bad_call(IndexError, "id -3 is out of range", one_bad)
    bad_call(IndexError, "id -3 is out of range", one_bad.to(torch.int32))
    bad_call(TypeError, "int32 or int64", ids.float())
    bad_call(TypeError, "dense", ids.to_sparse())
    bad_call(ValueError, "meta", ids.to("meta"))
    bad_call(ValueError, "negated", torch._neg_view(ids))
    bad_call(ValueError, "memory", torch._efficientzerotensor(ids.shape, dtype=ids.dtype, device=device))
    bad_call(TypeError, "nested", _nested(ids))
    bad_call(ValueError, "does not fit in int64", ids, offset=2**63)
    bad_call(ValueError, "nonzero offset", ids, positions=torch.zeros_like(ids), offset=3)
    bad_call(TypeError, "integer tensor", ids, positions=ids.float())
    bad_call(ValueError, "do not broadcast", ids, positions=ids[:, :2].contiguous())
    # Settings changed after the good calls: checked on every call, in eval mode too (as F.dropout does);
    # False and a tensor 0.0 compare equal to the prepared 0.0 and are still not probabilities.
    for value, match in ((1.5, "1.5"), (False, "dropout"), (torch.tensor(0.0), "dropout")):
        with torch.no_grad():
            layer(ids)
            layer(ids)
        layer.dropout = value
        with pytest.raises(ValueError, match=match), torch.no_grad():
            layer(ids)
        layer.dropout = 0.0
    table = layer.weight
    for bad_table, error, match in ((table.detach().to("meta"), ValueError, "meta"),
                                    (torch._neg_view(table.detach()), ValueError, "negated"),
                                    (torch._efficientzerotensor(table.shape, device=device), ValueError, "memory"),
                                    (_nested(table.detach()), TypeError, "nested")):
        with torch.no_grad():
            layer(ids)
            layer(ids)
        layer.weight = nn.Parameter(bad_table, requires_grad=False)  # the same shape (rows) and dtype
        with pytest.raises(error, match=match), torch.no_grad():
            layer(ids)
        layer.weight = table
    layer.weight = nn.Parameter(torch.randn(30, 16, device=device), requires_grad=False)
    ids = ids % 30
    bad_call(IndexError, "30 rows", torch.full_like(ids, 40))  # the check uses the new table's size


@pytest.mark.parametrize("backend,device", [t for t in TARGETS if t.values[0] in ("cpu", "cuda")])
def test_a_changed_extension_is_not_used(backend, device, monkeypatch):
    """A prepared launch holds a binding object of the extension it was prepared with; once the backend's
    extension changes (a rebuild, tests switching host emulation), calls take the general path."""
    module = {"cpu": cpu_backend, "cuda": cuda_backend}[backend]
    layer = _basic_layer(backend, device)
    ids = _ids(device)
    with torch.no_grad():
        layer(ids)
        layer(ids)
        monkeypatch.setattr(module._lookup, "state", Extension(None, "extension unloaded by the test"))
        monkeypatch.setattr(module, "prepare", lambda device: None)  # no on-demand build either
        with pytest.raises(RuntimeError, match="extension unloaded by the test"):
            layer(ids)


@pytest.mark.parametrize("backend,device", TRITON_INTERPRETER)
def test_triton_launches_stop_when_the_interpreter_is_turned_off(backend, device, monkeypatch, prepared_runs):
    """Triton's prepared launch on CPU tensors runs in the interpreter: once TRITON_INTERPRET is unset,
    calls take the general path again, which names the setting."""
    layer = _basic_layer(backend, device)
    addition = pf.SinusoidalPositionalEncoding(16, backend=backend)
    ids, x = _ids(device), _addition_input(device, 1)
    with torch.no_grad():
        for _ in range(2):
            layer(ids)
            addition(x)
        assert len(prepared_runs) == 4
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            layer(ids)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            addition(x)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_out_of_range_ids_with_the_check_off(backend, device):
    """With the id check off an out-of-range id reads nothing (a zero token vector), as on the general path."""
    layer = _basic_layer(backend, device)
    ids = _ids(device)
    ids[0, 0], ids[1, 2] = 50, -7
    with torch.no_grad(), pf.id_check(False):
        layer(_ids(device))
        layer(_ids(device))
        assert torch.equal(layer(ids), _fresh(layer)(ids))


@pytest.mark.parametrize("backend,device", TARGETS)
def test_dropout_in_training_takes_the_general_path(backend, device, prepared_runs):
    layer = _basic_layer(backend, device)
    ids = _ids(device)
    with torch.no_grad():
        layer(ids)
        layer(ids)
    served = len(prepared_runs)
    layer.dropout = 0.5
    layer.train()
    with torch.no_grad():
        torch.manual_seed(5)
        dropped = layer(ids)
        torch.manual_seed(5)
        assert torch.equal(dropped, _fresh(layer)(ids))
        assert not torch.equal(dropped, layer.eval()(ids))  # eval: exact, no dropout
        layer.eval()(ids)
        torch.manual_seed(6)
        dropped = layer.train()(ids)  # prepared for dropout 0.5 in eval mode; training must still drop
        torch.manual_seed(6)
        assert torch.equal(dropped, _fresh(layer)(ids))
        assert torch.count_nonzero(dropped) < dropped.numel()
    torch.manual_seed(7)
    out = layer(ids)  # with autograd too
    torch.manual_seed(7)
    assert torch.equal(out, _fresh(layer)(ids)) and out.grad_fn is not None
    # Of these calls only the two in eval mode run prepared (prepared again for dropout 0.5 at the first eval
    # call: a training call with dropout prepares nothing); the training calls need dropout.
    assert served == (2 if backend in PREPARED_BACKENDS else 0)
    assert len(prepared_runs) == 2 * served


# Every entry point the prepared launches serve, as make(backend, device) -> (call(input, offset=),
# make_input(seed), trainable table or None: then the input is trainable): a new entry point is one more
# entry.  The functional ones keep their launch on the spec, which is cached per argument tuple, so each
# test takes a PE scale never used before: a new spec, whose first call prepares its launch.
_NEW_SCALES = itertools.count(1)


def _new_pe_scale() -> float:
    return 0.5 + next(_NEW_SCALES) / 1024


def _module_entry(backend, device):
    layer = _basic_layer(backend, device, embed_scale=2.5).train()
    return layer, lambda seed: _ids(device, seed=seed), layer.weight


def _functional_entry(backend, device):
    weight = torch.randn(50, 16, generator=torch.Generator().manual_seed(4)).to(device).requires_grad_()

    def call(ids, offset=0, positions=None):
        return pf.sinusoidal_embedding(ids, weight, padding_idx=1, embed_scale=2.5, pe_scale=pe_scale, layout="split",
                                       backend=backend, offset=offset, positions=positions)
    pe_scale = _new_pe_scale()
    return call, lambda seed: _ids(device, seed=seed), weight


def _addition_input(device, seed, shape=(3, 5, 16)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _addition_module_entry(backend, device):
    layer = pf.SinusoidalPositionalEncoding(16, x_scale=1.5, layout="split", backend=backend)
    return layer, lambda seed: _addition_input(device, seed), None


def _addition_functional_entry(backend, device):
    def call(x, offset=0, positions=None):
        return pf.add_sinusoidal(x, x_scale=1.5, pe_scale=pe_scale, backend=backend, offset=offset, positions=positions)
    pe_scale = _new_pe_scale()
    return call, lambda seed: _addition_input(device, seed, (2, 3, 4, 16)), None


ENTRY_POINTS = [_module_entry, _functional_entry, _addition_module_entry, _addition_functional_entry]


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("autograd", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__.strip("_"))
def test_every_entry_point_equals_the_general_path(entry, autograd, backend, device, prepared_runs, monkeypatch):
    """Repeated calls of each entry point, inference and training, at int offsets and at explicit positions:
    output, gradient (to the table or to x) and double backward bit for bit those of the general path, and
    every call served prepared."""
    call, make_input, table = entry(backend, device)

    def step(seed, offset):
        source = make_input(seed)
        trainable = table
        if table is None:
            source = trainable = source.requires_grad_(autograd)
        with torch.set_grad_enabled(autograd):
            if offset is None:  # explicit positions, one per token
                tokens = source.shape if table is not None else source.shape[:-1]
                positions = torch.randint(-(2**40), 2**40, tokens, generator=torch.Generator().manual_seed(seed))
                out = call(source, positions=positions.to(device))
            else:
                out = call(source, offset=offset)
        if not autograd:
            assert out.grad_fn is None
            return (out,)
        assert out.grad_fn is not None
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(device).requires_grad_()
        (grad,) = torch.autograd.grad(out, trainable, grad_out, create_graph=True)
        second = torch.autograd.grad((grad * grad).sum(), grad_out, allow_unused=True)[0]
        return out.detach(), grad.detach(), second

    calls = [(1, 0), (2, 7), (3, None), (4, 2**40 + 3), (5, -5), (6, None)]
    got = [step(*c) for c in calls]
    served = len(prepared_runs)
    with monkeypatch.context() as patch:
        _general_path_only(patch)
        want = [step(*c) for c in calls]
    assert len(prepared_runs) == served
    for c, g, w in zip(calls, got, want):
        for part, (a, b) in enumerate(zip(g, w)):
            assert (a is None and b is None) or torch.equal(a, b), (c, part)
    assert served == (len(calls) if backend in PREPARED_BACKENDS else 0), served


# The functional entry points' calls, each with a new spec (_new_pe_scale), on a table (the embedding's) or on x.
def _embedding_call(backend, frequencies=None):
    pe_scale = _new_pe_scale()
    ids = _ids("cpu")
    return lambda table: pf.sinusoidal_embedding(ids.to(table.device) if isinstance(table, torch.Tensor) else ids,
                                                 table, embed_scale=2.5, pe_scale=pe_scale, frequencies=frequencies,
                                                 backend=backend, offset=3)


def _addition_call(backend, frequencies=None):
    pe_scale = _new_pe_scale()
    return lambda x: pf.add_sinusoidal(x, x_scale=1.5, pe_scale=pe_scale, frequencies=frequencies, backend=backend,
                                       offset=3)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("frequencies", [None, [0.9 ** i for i in range(8)]], ids=["base", "frequencies"])
@pytest.mark.parametrize("make_call,shape", [(_embedding_call, (50, 16)), (_addition_call, (3, 5, 16))],
                         ids=["sinusoidal_embedding", "add_sinusoidal"])
def test_functional_calls_alternating_kinds_of_table(make_call, shape, frequencies, backend, device, prepared_runs,
                                                     monkeypatch):
    """A functional entry point called in turn on two kinds of table (fp32, bf16) under one spec: each call as
    the general path gives it, each kind's launch prepared once, and every call served by it (the launch its
    slot holds does not serve the other kind: the one kept for that kind does).  With the frequencies given
    too (the presets' calls), whose spec is found only after the checks."""
    builds = []
    for kind in (_prepared.PreparedForward, _prepared.PreparedAddition):
        real_build = kind.build
        monkeypatch.setattr(kind, "build", staticmethod(lambda *args, real_build=real_build: builds.append(args)
                                                        or real_build(*args)))
    call = make_call(backend, frequencies)
    generator = torch.Generator().manual_seed(5)
    tables = [torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
              for dtype in (torch.float32, torch.bfloat16)]
    got = [call(tables[turn % 2]) for turn in range(6)]
    served = len(prepared_runs)
    with monkeypatch.context() as patch:
        _general_path_only(patch)
        want = [call(tables[turn % 2]) for turn in range(6)]
    for turn, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == tables[turn % 2].dtype and torch.equal(a, b), turn
    prepared = backend in PREPARED_BACKENDS
    assert len(builds) == 2 and served == (6 if prepared else 0), (len(builds), served)


@pytest.mark.parametrize("backend,device", REFUSAL_TARGETS)
@pytest.mark.parametrize("frequencies", [None, [0.9 ** i for i in range(8)]], ids=["base", "frequencies"])
@pytest.mark.parametrize("make_call,shape", [(_embedding_call, (50, 16)), (_addition_call, (3, 5, 16))],
                         ids=["sinusoidal_embedding", "add_sinusoidal"])
def test_functional_bad_tables_after_prepared_calls_raise_as_the_general_path(make_call, shape, frequencies, backend,
                                                                             device, monkeypatch):
    """The functional entry points try their prepared launch before checking the table (or x), or after the
    checks where their spec is not found without them (frequencies given): a bad one right after good calls
    (a launch prepared for a good one of the same shape) gives what the general path gives for it: the same
    error, or the same output."""
    good = torch.randn(shape, generator=torch.Generator().manual_seed(6)).to(device)
    bad_inputs = {
        "integer": good.to(torch.int64), "float64": good.double(), "meta": good.to("meta"),
        "negated": torch._neg_view(good), "zero tensor": torch._efficientzerotensor(shape, device=device),
        "sparse": good.to_sparse(), "not contiguous": good.transpose(-1, -2).contiguous().transpose(-1, -2),
        "one more dimension": good.unsqueeze(0), "one fewer": good[0], "a list": good.tolist(),
        "a subclass": good.as_subclass(_TensorSubclass),
        "nested": _nested(good), "nested integer": _nested(good.to(torch.int64)),
    }

    def outcome(call, value):
        try:
            out = call(value)
        except Exception as error:  # what the call raises is what is compared
            return type(error), str(error)
        return out.dtype, out.shape, out.device, out.cpu() if out.device.type != "meta" else None

    for name, bad in bad_inputs.items():
        call = make_call(backend, frequencies)
        first = call(good)
        call(good)
        got = outcome(call, bad)
        with monkeypatch.context() as patch:
            _no_functional_attempt(patch)  # the general path, nothing tried before it
            want = outcome(call, bad)
        assert got[:2] == want[:2], (name, got, want)
        if len(got) > 2 and got[-1] is not None:
            assert torch.equal(got[-1], want[-1]), name
        assert torch.equal(call(good), first)  # and the good input is still served as before


class _TensorSubclass(torch.Tensor):
    pass


def _nested(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as a nested tensor (torch.nested), which has no sizes of its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (its API "in prototype stage")
        return torch.nested.nested_tensor(list(t.unbind(0)))


@pytest.mark.parametrize("backend,device", TARGETS)
def test_sparse_gradients_of_prepared_training_calls(backend, device, prepared_runs):
    layer = _basic_layer(backend, device, sparse=True).train()
    for seed in range(3):
        ids = _ids(device, seed=seed)
        twin = _fresh(layer)
        layer.weight.grad = twin.weight.grad = None
        layer(ids, offset=seed).sum().backward()
        twin(ids, offset=seed).sum().backward()
        assert layer.weight.grad.is_sparse and torch.equal(layer.weight.grad.to_dense(), twin.weight.grad.to_dense())
    assert len(prepared_runs) == (3 if backend in PREPARED_BACKENDS else 0)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_addition_calls_the_launch_does_not_serve(backend, device, prepared_runs):
    """Inputs of add_sinusoidal's layer that its prepared launch declines (not contiguous, one row, another
    width, dtype or device kind) give what the general path gives, and bad ones its errors."""
    layer = pf.SinusoidalPositionalEncoding(16, backend=backend)
    x = _addition_input(device, 1)
    with torch.no_grad():
        layer(x)
        layer(x)
        for other in (x.transpose(0, 1), x[0, 0], x.to(torch.bfloat16), x[:, :0]):
            want = _fresh(pf.SinusoidalPositionalEncoding(16, backend=backend))(other, offset=3)
            assert torch.equal(layer(other, offset=3), want)
        served = len(prepared_runs)
        for shape in ((9, 11, 16), (2, 16), (40, 3, 16)):  # more rows than numbered so far: they grow
            other = _addition_input(device, 2, shape)
            want = _fresh(pf.SinusoidalPositionalEncoding(16, backend=backend))(other, offset=5)
            assert torch.equal(layer(other, offset=5), want)
        assert len(prepared_runs) == served + (3 if backend in PREPARED_BACKENDS else 0)
        with pytest.raises(ValueError, match="width 8"):
            layer(x[..., :8])
        with pytest.raises(TypeError, match="floating-point"):
            layer(x.to(torch.int64))
        with pytest.raises(TypeError, match="nested"):
            layer(_nested(x))


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("entry", [_module_entry, _addition_module_entry], ids=["embedding", "addition"])
def test_positions_the_launch_does_not_serve(entry, backend, device, prepared_runs):
    """Explicit positions that a prepared launch declines (broadcast, int32, not contiguous) give what the
    general path gives; contiguous int64 positions of the tokens' shape it serves."""
    layer, make_input, table = entry(backend, device)
    source = make_input(1)
    tokens = source.shape if table is not None else source.shape[:-1]
    positions = torch.randint(-(2**40), 2**40, tokens, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        layer(source)
        layer(source)
        served = len(prepared_runs)
        for other in (positions[0], positions[:1], positions.to(torch.int32), positions.t().contiguous().t()):
            assert torch.equal(layer(source, positions=other), _fresh(layer)(source, positions=other))
        assert len(prepared_runs) == served
        assert torch.equal(layer(source, positions=positions), _fresh(layer)(source, positions=positions))
    assert len(prepared_runs) == served + (backend in PREPARED_BACKENDS)


@pytest.mark.parametrize("backend,device", TARGETS)
def test_outputs_are_not_views(backend, device):
    """As nn.Embedding's: a view made under no_grad could not later be modified in place with grad on."""
    layer = _basic_layer(backend, device)
    scale = torch.tensor(2.0, requires_grad=True)
    for call in range(3):
        with torch.no_grad():
            out = layer(_ids(device), offset=call)
        assert not out._is_view(), call
        out.mul_(scale)  # raises for a view created in no_grad mode
        assert out.requires_grad


@pytest.mark.parametrize("backend,device", TARGETS)
def test_copies_and_pickles_after_prepared_calls(backend, device):
    layer = _basic_layer(backend, device)
    ids = _ids(device)
    with torch.no_grad():
        want = layer(ids)
        layer(ids)
        for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer)), copy.copy(layer)):
            assert torch.equal(twin(ids), want)
            assert torch.equal(twin(ids), want)


def test_dispatch_modes_see_the_op_after_prepared_calls():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    layer = _basic_layer("auto", "cpu")
    ids = _ids("cpu")
    with torch.no_grad():
        want = layer(ids)
        layer(ids)
        with Log():
            got = layer(ids)
    assert any("posenc_fast" in name for name in seen), seen
    assert torch.equal(got, want)


def test_compile_after_prepared_calls():
    layer = _basic_layer("auto", "cpu")
    ids = _ids("cpu")
    with torch.no_grad():
        want = layer(ids, offset=4)
        layer(ids, offset=4)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(ids, offset=4), want)
        assert torch.equal(layer(ids, offset=4), want)  # and eager again


def test_row_numbers_only_grow_whatever_the_threads_do(monkeypatch):
    """Two threads call the same add_sinusoidal layer, one with few rows, one with many: the thread making the
    short row numbers is held up while the other one needs long ones.  Every launch reads numbers at least as
    long as its rows (the lock, and the numbers handed to the launch), so both outputs are the general path's."""
    import threading
    import time
    import types

    if "cpu" not in [t.values[0] for t in TARGETS]:
        pytest.skip("the CPU extension is not available")
    layer = pf.SinusoidalPositionalEncoding(8, backend="cpu")
    layer(torch.randn(1, 1, 8))
    layer(torch.randn(1, 1, 8))
    real_torch = _prepared.torch

    class SlowArange(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real_torch, name)

        def arange(self, count, **kwargs):
            if count == 100:
                time.sleep(0.3)  # the short numbers are made slowly: the other thread runs meanwhile
            return real_torch.arange(count, **kwargs)

    monkeypatch.setattr(_prepared, "torch", SlowArange("torch"))
    short, long = torch.randn(1, 100, 8), torch.randn(1, 1000, 8)
    results = {}
    first = threading.Thread(target=lambda: results.__setitem__("short", layer(short)))
    second = threading.Thread(target=lambda: results.__setitem__("long", layer(long)))
    first.start()
    time.sleep(0.05)
    second.start()
    first.join()
    second.join()
    monkeypatch.setattr(_prepared, "torch", real_torch)
    for name, x in (("short", short), ("long", long)):
        assert torch.equal(results[name], _fresh(pf.SinusoidalPositionalEncoding(8, backend="cpu"))(x)), name
    assert layer._prepared.numbers[0].shape[0] >= 1000


@pytest.mark.parametrize("backend,device", [t for t in TARGETS if t.values[0] not in PREPARED_BACKENDS])
def test_backends_without_a_launch_are_asked_once(backend, device, monkeypatch):
    """A module whose backend has no prepared launch keeps a stand-in: it does not resolve the backend again
    on every call to find out, and asks again once something changes (here the table's dtype)."""
    built = []
    for kind in (_prepared.PreparedForward, _prepared.PreparedAddition):
        build = kind.__dict__["build"].__func__
        monkeypatch.setattr(kind, "build", staticmethod(lambda *args, _build=build: built.append(1) or _build(*args)))
    layer = _basic_layer(backend, device)
    addition = pf.SinusoidalPositionalEncoding(16, backend=backend)
    ids, x = _ids(device), _addition_input(device, 1)
    with torch.no_grad():
        for _ in range(4):
            layer(ids)
            addition(x)
        assert len(built) == 2
        layer.to(torch.bfloat16)
        got = layer(ids)
        addition(x.to(torch.bfloat16))
        assert len(built) == 4
        assert torch.equal(got, _fresh(layer)(ids))


@pytest.mark.parametrize("backend,device", [t for t in TARGETS if t.values[0] in PREPARED_BACKENDS])
def test_activation_checkpointing_across_the_two_paths(backend, device, monkeypatch):
    """Non-reentrant activation checkpointing recomputes the forward through the prepared launch, and it must
    save what the general path saves (the general path's gradients, compared)."""
    from torch.utils.checkpoint import checkpoint

    layer = _basic_layer(backend, device).train()
    twin = _fresh(layer)
    weight = torch.randn(50, 16, device=device, requires_grad=True)
    for step in range(3):
        ids = _ids(device, seed=step)
        checkpoint(layer, ids, use_reentrant=False).sum().backward()
        twin(ids).sum().backward()
        assert torch.equal(layer.weight.grad, twin.weight.grad), step
        (grad,) = torch.autograd.grad(checkpoint(lambda i, w: pf.sinusoidal_embedding(i, w, backend=backend), ids,
                                                 weight, use_reentrant=False).sum(), weight)
        with monkeypatch.context() as patch:
            _general_path_only(patch)
            (want,) = torch.autograd.grad(pf.sinusoidal_embedding(ids, weight, backend=backend).sum(), weight)
        assert torch.equal(grad, want), step


@pytest.mark.parametrize("backend,device", TARGETS)
def test_bad_and_unusual_inputs_after_prepared_calls(backend, device):
    """What the general path refuses or handles specially, the functional entry points still do after
    prepared calls: an unhashable backend, zero tensors (no memory), a tensor kept from a finished
    torch.func transform (a functorch wrapper whose type is plain torch.Tensor)."""
    weight = torch.randn(50, 16, device=device)
    ids = _ids(device)
    x = _addition_input(device, 1)
    with torch.no_grad():
        for _ in range(2):
            pf.sinusoidal_embedding(ids, weight, backend=backend)
            pf.add_sinusoidal(x, backend=backend)
        with pytest.raises(ValueError, match="unknown backend"):
            pf.sinusoidal_embedding(ids, weight, backend=[backend])
        with pytest.raises(ValueError, match="unknown backend"):
            pf.add_sinusoidal(x, backend=[backend])
        with pytest.raises(ValueError, match="zero tensor"):
            pf.sinusoidal_embedding(torch._efficientzerotensor(ids.shape, dtype=ids.dtype, device=device), weight,
                                    backend=backend)
        with pytest.raises(ValueError, match="zero tensor"):
            pf.add_sinusoidal(torch._efficientzerotensor(x.shape, device=device), backend=backend)
    kept = []
    torch.func.grad(lambda w: (kept.append(w), w.sum())[1])(weight.clone())
    layer = pf.SinusoidalEmbedding.from_pretrained(weight.clone(), backend=backend)
    for _ in range(3):
        out = torch.func.functional_call(layer, {"weight": kept[0]}, (ids,))
        assert torch.equal(out.detach(), pf.SinusoidalEmbedding.from_pretrained(weight, backend=backend)(ids).detach())


class _Doubled(nn.Module):
    def forward(self, weight):
        return 2 * weight


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("kind", ["parametrization", "plain attribute", "new parameter"])
def test_the_weight_the_module_reads_is_its_attribute(kind, backend, device, prepared_runs):
    """The module reads its weight from its parameters (the cheap lookup) only where it is registered there:
    a parametrization's property (torch.nn.utils.parametrize, parametrizations.weight_norm) and a plain
    tensor attribute (the old weight_norm's hook sets one) are what it reads, on prepared calls too."""
    layer = _basic_layer(backend, device)
    table = layer.weight.detach().clone()
    ids = _ids(device)
    with torch.no_grad():
        layer(ids, offset=9)
        layer(ids, offset=9)
    if kind == "parametrization":
        torch.nn.utils.parametrize.register_parametrization(layer, "weight", _Doubled())
    elif kind == "plain attribute":
        del layer.weight
        layer.weight = 2 * table
    else:
        layer.weight = nn.Parameter(2 * table)
    exact = reference.sinusoidal_embedding(ids.cpu(), 2 * table.double().cpu(), offset=9, padding_idx=1)
    for _ in range(3):
        with torch.no_grad():
            got = layer(ids, offset=9)
        assert_within(got.cpu(), exact, output_bound(exact, torch.float32), f"{kind} {backend}")


@pytest.mark.parametrize("backend,device", TARGETS)
def test_addition_outputs_are_laid_out_as_the_general_paths(backend, device):
    """A contiguous x may carry any stride on a size-1 dimension: the output has the standard strides on
    both paths (the general path's and the prepared launch's)."""
    storage = torch.randn(1000, device=device)
    for x in (storage[:80].view(5, 16).unsqueeze(0).transpose(0, 1).transpose(0, 1),
              storage.as_strided((1, 5, 16), (1000, 16, 1)), storage.as_strided((5, 1, 16), (16, 999, 1))):
        assert x.is_contiguous()
        layer = pf.SinusoidalPositionalEncoding(16, backend=backend)
        with torch.no_grad():
            outs = ([layer(x, offset=3) for _ in range(3)] + [_fresh(layer)(x, offset=3)]
                    + [pf.add_sinusoidal(x, offset=3, backend=backend) for _ in range(3)])
        for out in outs:
            assert out.stride() == torch.empty(x.shape).stride(), (x.stride(), out.stride())
            assert torch.equal(out, outs[0])


@pytest.mark.parametrize("backend,device", TRITON_INTERPRETER)
def test_triton_launches_follow_the_kernel_module(backend, device, monkeypatch, prepared_runs):
    """A prepared Triton launch holds the kernels it was prepared with: once the backend's kernel module is
    another (a benchmark's stubs, restored), the next call prepares it again."""
    from types import SimpleNamespace

    from posenc_fast.backends import triton_backend

    layer = _basic_layer(backend, device)
    ids = _ids(device)
    with torch.no_grad():
        want = layer(ids)
        layer(ids)
        assert len(prepared_runs) == 2
        kernels = triton_backend._load_kernels()
        monkeypatch.setattr(triton_backend._Kernels, "state", SimpleNamespace(
            forward_kernel=kernels.forward_kernel, grad_chunk_kernel=kernels.grad_chunk_kernel,
            grad_carry_kernel=kernels.grad_carry_kernel))
        assert torch.equal(layer(ids), want)
        assert len(prepared_runs) == 3  # prepared again at once, on the new module
        assert torch.equal(layer(ids), want)
        assert len(prepared_runs) == 4


def test_backend_traits_name_every_backend():
    """tests/cases.py's BACKEND_TRAITS has a row per registered backend, and its prepared_launch says which
    backends have a prepared launch (the tests above expect calls served by it exactly there)."""
    from posenc_fast import _dispatch
    from cases import BACKEND_TRAITS

    assert set(BACKEND_TRAITS) == set(_dispatch.BACKENDS)
    for name, traits in BACKEND_TRAITS.items():
        assert traits.prepared_launch == hasattr(_dispatch.get_backend(name), "prepare_forward"), name


def _files_entered(call):
    """The package files whose functions ``call()`` enters, in order (a run of calls within one file counted
    once), and each call from one package file into another as (caller, callee) paths under posenc_fast/.
    The first call is the entry point's; after it, only calls from the package count (not a kernel's)."""
    root = pf.__file__.rsplit("/", 1)[0] + "/"
    files, crossings = [], []

    def profile(frame, event, arg):
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        # (After the entry point, only calls from the package: Triton's interpreter calling the kernel is not.)
        if event != "call" or not callee.startswith(root) or (files and not caller.startswith(root)):
            return
        callee = callee[len(root):]
        if not files or files[-1] != callee:
            files.append(callee)
        if caller.startswith(root) and caller[len(root):] != callee:
            crossings.append((caller[len(root):], callee))

    _run_profiled(call, profile)
    return files, crossings


def _run_profiled(call, profile) -> None:
    """``call()`` with ``profile`` as the interpreter's profile function (sys.setprofile)."""
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize("backend,device", [t for t in TARGETS if t.values[0] in PREPARED_BACKENDS])
@pytest.mark.parametrize("autograd", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("where", ["offset", "positions"])
@pytest.mark.parametrize("entry", [_module_entry, _addition_module_entry], ids=["embedding", "addition"])
def test_a_repeated_module_call_goes_down_to_its_launch(entry, where, autograd, backend, device):
    """A module's repeated call, at an offset or at explicit positions, reaches its backend's launch through six
    of the package's files at most, each entered once, and every call from one file into another goes to the
    same layer or a lower one (tests/test_layering.py's layers): nothing calls back up."""
    from test_layering import LAYER_OF

    layer, make_input, table = entry(backend, device)
    source = make_input(1)
    if table is None:
        source.requires_grad_(autograd)
    tokens = source.shape if table is not None else source.shape[:-1]
    where = dict(offset=3) if where == "offset" else dict(positions=torch.arange(tokens.numel(), device=device)
                                                          .view(tokens))
    with torch.set_grad_enabled(autograd):
        for _ in range(2):  # the launch prepared, then run again (Triton: its tiles, kept)
            layer(source, **where)
        files, crossings = _files_entered(lambda: layer(source, **where))
    assert files[0] == "module.py" and any(path.startswith("backends/") for path in files), files
    assert len(files) <= 6 and len(set(files)) == len(files), files
    layer_of = {path: LAYER_OF[path.split("/")[0].removesuffix(".py")] for path in files}
    upward = [(a, b) for a, b in crossings if layer_of[b] > layer_of[a]]
    assert not upward, (upward, files)


@pytest.mark.parametrize("backend,device", [t for t in TARGETS if t.values[0] in PREPARED_BACKENDS])
@pytest.mark.parametrize("autograd", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("entry", [_module_entry, _addition_module_entry], ids=["embedding", "addition"])
def test_a_first_module_call_prepares_its_launch_on_the_way_down(entry, autograd, backend, device):
    """A module's first call checks its settings, resolves its backend and binds its launch on its way to the
    launch, through eight of the package's files at most, none of them the general path's, and nothing calls
    back up a layer."""
    from test_layering import LAYER_OF

    layer, make_input, table = entry(backend, device)
    source = make_input(1)
    if table is None:
        source.requires_grad_(autograd)
    with torch.set_grad_enabled(autograd):
        files, crossings = _files_entered(lambda: layer(source, offset=3))
    assert isinstance(layer._prepared, (_prepared.PreparedForward, _prepared.PreparedAddition))
    assert len(set(files)) <= 8 and "functional.py" not in files and "ops.py" not in files, " ".join(files)
    layer_of = {path: LAYER_OF[path.split("/")[0].removesuffix(".py")] for path in files}
    upward = [(a, b) for a, b in crossings if layer_of[b] > layer_of[a]]
    assert not upward, (upward, files)


def _resolutions(call) -> int:
    """How many times ``call()`` resolves a backend (enters ``_dispatch.resolve_backend``)."""
    from posenc_fast._dispatch import resolve_backend

    code, entered = resolve_backend.__code__, []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            entered.append(frame)

    _run_profiled(call, profile)
    return len(entered)


def _module_with(backend, device, **settings):
    layer = _basic_layer(backend, device).train()
    for name, value in settings.items():
        setattr(layer, name, value)
    return layer


# Three calls of each entry point; the first call of a kind that a launch serves resolves its backend to
# prepare the launch and its repeats never do; a call that no launch can serve (a tensor offset, dropout to
# apply, a dropout that is not a float) takes the general path each time, resolving once there and preparing
# nothing.
RESOLUTION_CALLS = {
    "embedding module at an int offset": ([1, 0, 0], lambda b, d: functools.partial(
        _module_with(b, d), _ids(d), offset=3)),
    "embedding module at a tensor offset": ([1, 1, 1], lambda b, d: functools.partial(
        _module_with(b, d), _ids(d), offset=torch.tensor(3, device=d))),
    "embedding module with dropout in training": ([1, 1, 1], lambda b, d: functools.partial(
        _module_with(b, d, dropout=0.25), _ids(d))),
    "embedding module with dropout in eval": ([1, 0, 0], lambda b, d: functools.partial(
        _module_with(b, d, dropout=0.25, training=False), _ids(d))),
    "embedding module with an int dropout": ([1, 1, 1], lambda b, d: functools.partial(
        _module_with(b, d, dropout=0), _ids(d))),
    "sinusoidal_embedding at a tensor offset": ([1, 1, 1], lambda b, d: functools.partial(
        pf.sinusoidal_embedding, _ids(d), torch.randn(50, 16, device=d), pe_scale=_new_pe_scale(), backend=b,
        offset=torch.tensor(3, device=d))),
    "sinusoidal_embedding with dropout in training": ([1, 1, 1], lambda b, d: functools.partial(
        pf.sinusoidal_embedding, _ids(d), torch.randn(50, 16, device=d), pe_scale=_new_pe_scale(), backend=b,
        dropout_p=0.25, training=True)),
    "add_sinusoidal at an int offset": ([1, 0, 0], lambda b, d: functools.partial(
        pf.add_sinusoidal, _addition_input(d, 1), pe_scale=_new_pe_scale(), backend=b, offset=3)),
    "add_sinusoidal at a tensor offset": ([1, 1, 1], lambda b, d: functools.partial(
        pf.add_sinusoidal, _addition_input(d, 1), pe_scale=_new_pe_scale(), backend=b,
        offset=torch.tensor(3, device=d))),
    "addition module at a tensor offset": ([1, 1, 1], lambda b, d: functools.partial(
        pf.SinusoidalPositionalEncoding(16, backend=b), _addition_input(d, 1), offset=torch.tensor(3, device=d))),
}


@pytest.mark.parametrize("backend,device", [t for t in TARGETS if t.values[0] in PREPARED_BACKENDS])
@pytest.mark.parametrize("kind", RESOLUTION_CALLS)
def test_a_call_resolves_its_backend_once_at_most(kind, backend, device):
    """Whether or not a prepared launch can serve it, no call resolves its backend twice (RESOLUTION_CALLS)."""
    expected, make_call = RESOLUTION_CALLS[kind]
    call = make_call(backend, device)
    with torch.no_grad():
        assert [_resolutions(call) for _ in expected] == expected
