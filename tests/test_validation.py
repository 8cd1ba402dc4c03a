"""Bad input gets a clear Python exception naming the bad value, before any kernel runs, on every backend.

Every refused call is one row of ``BAD_CALLS``: the functional op's arguments, the layer's constructor
and its changed state, presets' position rules, the torch.library ops called directly.  With the id
check off (``pf.id_check(False)``) out-of-range ids and unchecked ``cu_seqlens`` are computed, never read
outside the table.  The spec caches check a repeated argument as they checked the first.
"""

import math
import warnings

import pytest
import torch
from torch import nn

import posenc_fast as pf
from posenc_fast import ops, reference
from posenc_fast._dispatch import BACKENDS
from posenc_fast._spec import MAX_ROW_WIDTH
from posenc_fast._validate import make_spec

from cases import assert_within, backend_targets, output_bound

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


def _exact(ids, weight, **kwargs):
    return reference.sinusoidal_embedding(ids, weight.double(), **kwargs)


def _nested_rows(t):
    """``t``'s rows as a nested tensor (torch.nested: 2-D, no sizes of its own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (its API "in prototype stage")
        return torch.nested.nested_tensor(list(t.unbind(0)))


def _call(function, ids, weight, overrides):
    kwargs = dict(overrides)
    ids = kwargs.pop("ids", ids)
    weight = kwargs.pop("weight", weight)
    return function(ids, weight, **kwargs)


# -- the calls of BAD_CALLS: each is call(backend, device) ---------------------------------------------------

class _Functional:
    """``sinusoidal_embedding`` on fresh inputs (ids [2, 5] of a vocabulary of 10, a [10, 8] table) with the
    arguments ``change(ids, weight)`` replaces or adds; ``reference``: the reference refuses it alike."""

    def __init__(self, change, reference=True):
        self.change, self.reference = change, reference

    def __call__(self, backend, device):
        ids, weight = _inputs(device)
        overrides = dict(self.change(ids, weight))
        overrides.setdefault("backend", backend)
        return _call(pf.sinusoidal_embedding, ids, weight, overrides)

    def on_reference(self):
        ids, weight = _inputs("cpu")
        return _call(reference.sinusoidal_embedding, ids, weight, self.change(ids, weight))


def functional(change):
    return _Functional(change)


def functional_only(change):
    """As ``functional``, for arguments the reference does not take (backend, cu_seqlens)."""
    return _Functional(change, reference=False)


def layer(*args, **kwargs):
    """``SinusoidalEmbedding(*args, **kwargs)``, on the target's backend and device unless kwargs name them."""
    return lambda backend, device: pf.SinusoidalEmbedding(*args, **{"backend": backend, "device": device, **kwargs})


def from_pretrained(make_weight):
    return lambda backend, device: pf.SinusoidalEmbedding.from_pretrained(make_weight(device), backend=backend)


def changed_attribute(attribute, value):
    """A layer whose attribute is set to ``value`` after construction, then called."""

    def call(backend, device):
        m = pf.SinusoidalEmbedding(10, 8, backend=backend).to(device)
        setattr(m, attribute, value)
        return m(torch.zeros(2, 3, dtype=torch.int64, device=device))

    return call


def replaced_weight(make_weight, mode="add", d_pos=None, padding_idx=None, vocab_in_use=11):
    """An [11, 8] layer whose weight is replaced by ``make_weight(device)`` (a table of another width, no
    table at all, too few rows for padding_idx), then called with ids below ``vocab_in_use``."""

    def call(backend, device):
        m = pf.SinusoidalEmbedding(11, 8, mode=mode, d_pos=d_pos, padding_idx=padding_idx, backend=backend).to(device)
        weight = make_weight(device)
        m.weight = nn.Parameter(weight, requires_grad=weight.is_floating_point())
        return m(torch.randint(0, vocab_in_use, (2, 5), device=device))

    return call


def fairseq_offset(offset):
    """The fairseq position rule's offset (past length) checked by name."""

    def call(backend, device):
        m = pf.SinusoidalEmbedding.from_preset("fairseq", 10, 8, padding_idx=1, backend=backend).to(device)
        return m(torch.randint(0, 10, (2, 5), device=device),
                 offset=offset.to(device) if isinstance(offset, torch.Tensor) else offset)

    return call


def packed(cu, through_layer=False):
    """Eight packed tokens with ``cu_seqlens=cu``, through the functional op or the layer."""

    def call(backend, device):
        ids = torch.randint(0, 10, (8,), device=device)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        if through_layer:
            return pf.SinusoidalEmbedding(10, 6, backend=backend).to(device)(ids, cu_seqlens=cu_seqlens)
        return pf.sinusoidal_embedding(ids, torch.randn(10, 6, device=device), cu_seqlens=cu_seqlens, backend=backend)

    return call


def shard(dtype, bad):
    """A vocabulary shard (global ids 4..7 of 10) given global id ``bad``: the message names it as given."""

    def call(backend, device):
        m = pf.SinusoidalEmbedding(10, 8, vocab_range=(4, 8), backend=backend).to(device)
        return m(torch.tensor([[5, bad, 9]], dtype=dtype, device=device))

    return call


def _op_arguments(device, **changes):
    spec = make_spec(20, 8, "add", None, 10000.0, "interleaved", 1.0, 1.0, None)
    args = dict(ids=torch.randint(0, 20, (12,), device=device), weight=torch.randn(20, 8, device=device),
                turns=spec.turns_tensor(device), positions=None, offsets=None, offset=0, seq_len=4, concat=False,
                pe_width=8, pe_columns=spec.columns.as_list(), embed_scale=1.0, pe_scale=1.0, padding_idx=-1,
                zero_pe_at_padding=False, float64_math=False, vocab_start=0, vocab_size=20, dropout_seed=None,
                dropout_p=0.0)
    args.update(changes)
    return args


def op(change):
    """A direct call of the torch.library op, its arguments consistent but for ``change(device)``: every
    bound a kernel uses must follow from the tensors."""
    return lambda backend, device: ops.sinusoidal_embedding_op(**_op_arguments(device, **change(device)),
                                                                backend=backend)


def backward_op(grad_out_shape):
    """The backward op given a grad_out whose shape does not match the 12 ids of width 8."""

    def call(backend, device):
        ids = torch.randint(0, 20, (12,), device=device)
        return ops.sinusoidal_embedding_backward_op(torch.randn(grad_out_shape, device=device), ids, 20, 8, 1.0, -1,
                                                    torch.float32, None, 0.0, backend)

    return call


def addition(make_x, through_layer=False):
    """``add_sinusoidal`` (or its module, of width 8) on ``x = make_x(device)``."""

    def call(backend, device):
        if through_layer:
            return pf.SinusoidalPositionalEncoding(8, backend=backend)(make_x(device))
        return pf.add_sinusoidal(make_x(device), backend=backend)

    return call


def _negated(*shape, device):
    """A lazily negated view (``is_neg()``): the kernels would read its memory unnegated."""
    return torch.randn(*shape, dtype=torch.complex64, device=device).conj().imag


def _i64(*shape, device):
    return torch.zeros(*shape, dtype=torch.int64, device=device)


def _cu_seqlens_calls():
    calls = []
    for name, cu, fragment in [("decreasing", [0, 5, 3, 8], "decreases from 5 to 3"),
                               ("not_from_zero", [2, 5, 8], "starts at 2"),
                               ("short_of_the_tokens", [0, 3, 5], "ends at 5"),
                               ("past_the_tokens", [0, 3, 20], "ends at 20"),
                               ("negative", [-4, 0, 8], "starts at -4")]:
        calls.append((f"cu_seqlens_{name}", ValueError, ("cu_seqlens", fragment), packed(cu)))
        calls.append((f"cu_seqlens_{name}_layer", ValueError, ("cu_seqlens", fragment), packed(cu, through_layer=True)))
    return calls


BEYOND_FLOAT32 = [("1e39", 1e39), ("-1e39", -1e39), ("1e400", 10**400)]  # (label, scale)

# (name, exception, message fragment or fragments (in this order), call(backend, device))
BAD_CALLS = [
    # -- the functional op's arguments
    ("float_ids", TypeError, "float32", functional(lambda ids, w: dict(ids=ids.float()))),
    ("int16_ids", TypeError, "int16", functional(lambda ids, w: dict(ids=ids.short()))),
    ("nested_ids", TypeError, "nested", functional(lambda ids, w: dict(ids=_nested_rows(ids)))),
    ("nested_packed_ids", TypeError, "nested", functional_only(lambda ids, w: dict(
        ids=_nested_rows(ids), cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32, device=ids.device)))),
    ("sparse_ids", TypeError, ("ids", "sparse_coo"), functional(lambda ids, w: dict(ids=ids.to_sparse()))),
    ("id_too_large", IndexError, "id 10 ", functional(lambda ids, w: dict(ids=torch.where(ids == ids[0, 0], 10, ids)))),
    ("negative_id", IndexError, "id -3", functional(lambda ids, w: dict(ids=torch.where(ids == ids[0, 0], -3, ids)))),
    ("weight_1d", ValueError, "[80]", functional(lambda ids, w: dict(weight=w.reshape(-1)))),
    ("weight_3d", ValueError, "[2, 5, 8]", functional(lambda ids, w: dict(weight=w.reshape(2, 5, 8)))),
    ("weight_int", TypeError, "int64", functional(lambda ids, w: dict(weight=w.long()))),
    ("weight_nested", TypeError, "nested", functional(lambda ids, w: dict(weight=_nested_rows(w)))),
    ("weight_sparse", TypeError, ("weight", "sparse_coo"), functional(lambda ids, w: dict(weight=w.to_sparse()))),
    ("row_wider_than_the_launch_limits", ValueError, f"{MAX_ROW_WIDTH + 2}", functional(lambda ids, w: dict(
        ids=torch.zeros_like(ids), weight=torch.empty(1, MAX_ROW_WIDTH + 2, device=w.device)))),
    ("unknown_mode", ValueError, "'sum'", functional(lambda ids, w: dict(mode="sum"))),
    ("unknown_layout", ValueError, "'blocked'", functional(lambda ids, w: dict(layout="blocked"))),
    ("concat_without_d_pos", ValueError, "d_pos", functional(lambda ids, w: dict(mode="concat"))),
    ("d_pos_with_add", ValueError, "d_pos=4", functional(lambda ids, w: dict(d_pos=4))),
    ("d_pos_zero", ValueError, "d_pos=0", functional(lambda ids, w: dict(mode="concat", d_pos=0))),
    ("d_pos_negative", ValueError, "d_pos=-2", functional(lambda ids, w: dict(mode="concat", d_pos=-2))),
    ("d_pos_not_int", TypeError, "2.5", functional(lambda ids, w: dict(mode="concat", d_pos=2.5))),
    ("d_pos_is_whole_width", ValueError, "d_pos=3", functional(lambda ids, w: dict(mode="concat", d_pos=3,
                                                                                   weight=w[:, :0]))),
    ("offset_wrong_shape", ValueError, "[5]", functional(lambda ids, w: dict(
        offset=torch.zeros(5, dtype=torch.int64, device=ids.device)))),
    ("offset_float_tensor", TypeError, "float32", functional(lambda ids, w: dict(
        offset=torch.zeros(2, device=ids.device)))),
    ("offset_float", TypeError, "1.5", functional(lambda ids, w: dict(offset=1.5))),
    ("positions_not_broadcastable", ValueError, "[3]", functional(lambda ids, w: dict(
        positions=torch.arange(3, device=ids.device)))),
    ("positions_bigger", ValueError, "[4, 5]", functional(lambda ids, w: dict(
        positions=torch.zeros(4, 5, dtype=torch.int64, device=ids.device)))),
    ("positions_float", TypeError, "float32", functional(lambda ids, w: dict(
        positions=torch.zeros(2, 5, device=ids.device)))),
    ("positions_sparse", TypeError, ("positions", "sparse_coo"), functional(lambda ids, w: dict(
        positions=torch.ones(5, dtype=torch.int64, device=ids.device).to_sparse()))),
    ("positions_with_offset", ValueError, "offset=7", functional(lambda ids, w: dict(
        positions=torch.arange(5, device=ids.device), offset=7))),
    ("positions_with_offset_tensor", ValueError, "offset", functional(lambda ids, w: dict(
        positions=torch.arange(5, device=ids.device), offset=torch.ones(2, dtype=torch.int64, device=ids.device)))),
    ("positions_nested", TypeError, ("positions", "nested"), functional(lambda ids, w: dict(
        positions=_nested_rows(torch.zeros_like(ids))))),
    ("offset_nested", TypeError, ("offset", "nested"), functional(lambda ids, w: dict(
        offset=_nested_rows(torch.zeros(2, 1, dtype=torch.int64, device=ids.device))))),
    ("cu_seqlens_nested", TypeError, ("cu_seqlens", "nested"), functional_only(lambda ids, w: dict(
        ids=ids.reshape(-1), cu_seqlens=_nested_rows(torch.tensor([[0, 4], [8, 10]], device=ids.device))))),
    ("training_not_bool", TypeError, ("training", "'no'"), functional_only(lambda ids, w: dict(
        dropout_p=0.5, training="no"))),
    ("training_not_bool_without_dropout", TypeError, ("training", "1"), functional_only(lambda ids, w: dict(
        training=1))),
    ("cu_seqlens_float", TypeError, ("cu_seqlens", "float32"), functional_only(lambda ids, w: dict(
        ids=ids.reshape(-1), cu_seqlens=torch.tensor([0.0, 4.0, 10.0], device=ids.device)))),
    *_cu_seqlens_calls(),
    ("ids_on_other_device", ValueError, "meta", functional(lambda ids, w: dict(ids=ids.to("meta")))),
    ("base_zero", ValueError, "base", functional(lambda ids, w: dict(base=0.0))),
    ("base_negative", ValueError, "-2.0", functional(lambda ids, w: dict(base=-2.0))),
    ("base_inf", ValueError, "inf", functional(lambda ids, w: dict(base=math.inf))),
    ("base_nan", ValueError, "nan", functional(lambda ids, w: dict(base=math.nan))),
    # at width 64 the frequencies of base 5e-324 overflow float64 (at width 8 they do not: test_functional.py)
    ("base_whose_frequencies_overflow", ValueError, "base=5e-324", functional(lambda ids, w: dict(
        weight=torch.randn(10, 64, device=w.device), base=5e-324))),
    ("embed_scale_nan", ValueError, "embed_scale", functional(lambda ids, w: dict(embed_scale=math.nan))),
    ("embed_scale_tensor", TypeError, "embed_scale", functional(lambda ids, w: dict(
        embed_scale=torch.tensor([1.0, 2.0])))),
    ("pe_scale_complex", TypeError, "pe_scale", functional(lambda ids, w: dict(pe_scale=0j))),
    *[(f"{name}_{label}_beyond_float32", ValueError, name,
       functional(lambda ids, w, name=name, value=value: {name: value}))
      for name in ("embed_scale", "pe_scale") for label, value in BEYOND_FLOAT32],
    ("padding_idx_out_of_range", ValueError, "padding_idx=10", functional(lambda ids, w: dict(padding_idx=10))),
    ("unknown_backend", ValueError, "'cudnn'", functional_only(lambda ids, w: dict(backend="cudnn"))),
    # -- the layer's constructor and from_pretrained
    ("layer_d_pos_is_whole_width", ValueError, "d_pos=12", layer(10, 12, mode="concat", d_pos=12)),
    ("layer_d_pos_zero", ValueError, "d_pos=0", layer(10, 12, mode="concat", d_pos=0)),
    ("layer_concat_without_d_pos", ValueError, "d_pos", layer(10, 12, mode="concat")),
    ("layer_unknown_layout", ValueError, "'zigzag'", layer(10, 12, layout="zigzag")),
    ("layer_unknown_backend", ValueError, "'fastest'", layer(10, 12, backend="fastest")),
    ("layer_base_negative", ValueError, "-1.0", layer(10, 12, base=-1.0)),
    ("layer_d_model_zero", ValueError, ("d_model", "got 0"), layer(10, 0)),
    ("layer_d_model_negative", ValueError, ("d_model", "got -3"), layer(10, -3)),
    ("layer_d_model_not_int", ValueError, ("d_model", "got 2.5"), layer(10, 2.5)),
    ("layer_vocab_range_not_ints", TypeError, "(0.5, 3)", layer(10, 8, vocab_range=(0.5, 3))),
    ("layer_vocabulary_beyond_int64", ValueError, str(2**70), layer(2**70, 8, device="meta")),
    ("layer_row_wider_than_the_launch_limits", ValueError, (f"{MAX_ROW_WIDTH + 1}", f"{MAX_ROW_WIDTH}"),
     layer(2, MAX_ROW_WIDTH + 1, device="meta")),
    ("layer_concat_row_wider_than_the_launch_limits", ValueError, f"{MAX_ROW_WIDTH + 8}",
     layer(2, MAX_ROW_WIDTH + 8, mode="concat", d_pos=16, device="meta")),
    ("layer_base_whose_frequencies_overflow", ValueError, "base=5e-324", layer(11, 64, base=5e-324)),
    *[(f"layer_{name}_{label}_beyond_float32", ValueError, name, layer(11, 8, **{name: value}))
      for name in ("embed_scale", "pe_scale") for label, value in BEYOND_FLOAT32],
    ("layer_frequencies_str", TypeError, ("frequencies", "'1234'"), layer(11, 8, frequencies="1234")),
    ("layer_frequencies_bytes", TypeError, ("frequencies", "b'12'"), layer(11, 8, frequencies=b"12")),
    ("layer_frequencies_bool", TypeError, ("frequencies", "True"), layer(11, 8, frequencies=[1.0, True, 0.5, 0.25])),
    ("layer_frequencies_str_element", TypeError, ("frequencies", "'2'"),
     layer(11, 8, frequencies=[1.0, "2", 0.5, 0.25])),
    ("layer_frequencies_complex", TypeError, ("frequencies", "complex64"),
     layer(11, 8, frequencies=torch.ones(4, dtype=torch.complex64))),
    ("layer_frequencies_meta", ValueError, ("frequencies", "meta"),
     layer(11, 8, frequencies=torch.ones(4, device="meta"))),
    ("layer_frequencies_int", TypeError, ("frequencies", "5"), layer(11, 8, frequencies=5)),
    ("layer_frequencies_inf", ValueError, ("frequencies", "inf"),
     layer(11, 8, frequencies=[1.0, float("inf"), 0.5, 0.25])),
    ("from_pretrained_int", TypeError, "int64",
     from_pretrained(lambda d: torch.ones(3, 4, dtype=torch.int64, device=d))),
    ("from_pretrained_3d", ValueError, "[3, 4, 2]", from_pretrained(lambda d: torch.ones(3, 4, 2, device=d))),
    # -- a layer's state changed after construction
    ("changed_position_rule", ValueError, "'bogus'", changed_attribute("position_rule", "bogus")),
    ("changed_backend", ValueError, "'fastest'", changed_attribute("backend", "fastest")),
    ("changed_dropout", ValueError, "1.5", changed_attribute("dropout", 1.5)),
    ("changed_dropout_nan", ValueError, "nan", changed_attribute("dropout", float("nan"))),
    *[(f"replaced_weight_{mode}_width_{width}", ValueError, f"[11, {width}]",
       replaced_weight(lambda d, width=width: torch.randn(11, width, device=d), mode=mode, d_pos=d_pos))
      for mode, d_pos, width in [("add", None, 4), ("add", None, 12), ("concat", 3, 2), ("concat", 3, 9)]],
    ("replaced_weight_3d", ValueError, "[11, 8, 1]",
     replaced_weight(lambda d: torch.randn(11, 8, 1, device=d), padding_idx=9, vocab_in_use=5)),
    ("replaced_weight_int", TypeError, "int64",
     replaced_weight(lambda d: torch.ones(11, 8, dtype=torch.int64, device=d), padding_idx=9, vocab_in_use=5)),
    ("replaced_weight_without_the_padding_row", ValueError, "padding_idx=9",
     replaced_weight(lambda d: torch.randn(5, 8, device=d), padding_idx=9, vocab_in_use=5)),
    # -- ids of a vocabulary shard, named as given (not shifted to the shard's rows)
    ("shard_id_int32_min", IndexError, f"id {-(2**31)} ", shard(torch.int32, -(2**31))),
    ("shard_id_int64_min", IndexError, f"id {-(2**63)} ", shard(torch.int64, -(2**63))),
    ("shard_id_int32_max", IndexError, f"id {2**31 - 1} ", shard(torch.int32, 2**31 - 1)),
    # -- the fairseq position rule's offset
    ("fairseq_offset_2_63", ValueError, "offset=9223372036854775808", fairseq_offset(2**63)),
    ("fairseq_offset_2_64_5", ValueError, "offset=18446744073709551621", fairseq_offset(2**64 + 5)),
    ("fairseq_offset_below_int64", ValueError, "offset=-9223372036854775809", fairseq_offset(-(2**63) - 1)),
    ("fairseq_offset_float_tensor", TypeError, "offset must be an integer tensor, got dtype torch.float32",
     fairseq_offset(torch.zeros(2))),
    ("fairseq_offset_wrong_shape", ValueError, "offset tensor has shape [3]",
     fairseq_offset(torch.zeros(3, dtype=torch.int64))),
    ("fairseq_offset_float", TypeError, "offset must be an int", fairseq_offset(1.5)),
    ("make_positions_past_length_beyond_int64", ValueError, "past_length=9223372036854775808",
     lambda backend, device: pf.make_positions(torch.ones(2, 3, dtype=torch.int64, device=device), 1,
                                               past_length=2**63)),
    ("make_positions_past_length_meta", ValueError, ("past_length", "meta"),
     lambda backend, device: pf.make_positions(torch.ones(2, 3, dtype=torch.int64, device=device), 1,
                                               past_length=torch.tensor(3, device="meta"))),
    # -- add_sinusoidal and its module
    ("add_layer_fairseq_preset_without_positions", ValueError, ("fairseq", "positions=posenc_fast.make_positions"),
     lambda backend, device: pf.SinusoidalPositionalEncoding.from_preset("fairseq", 8, backend=backend)(
         torch.randn(2, 3, 8, device=device))),
    ("add_layer_preset_embed_scale", TypeError, "x_scale=",
     lambda backend, device: pf.SinusoidalPositionalEncoding.from_preset("fairseq", 8, embed_scale=1.0,
                                                                         backend=backend)),
    ("preset_base_overflows", ValueError, ("base=5e-324", "overflow"),
     lambda backend, device: pf.SinusoidalEmbedding.from_preset("vaswani", 10, 4096, base=5e-324, backend=backend)),
    ("add_x_scale_nan", ValueError, ("x_scale", "nan"),
     lambda backend, device: pf.add_sinusoidal(torch.randn(2, 3, 8, device=device), x_scale=float("nan"),
                                               backend=backend)),
    ("add_x_scale_beyond_float32", ValueError, ("x_scale=1e+300", "float32 range"),
     lambda backend, device: pf.add_sinusoidal(torch.randn(2, 3, 8, device=device), x_scale=1e300, backend=backend)),
    ("add_layer_x_scale_str", TypeError, ("x_scale", "'2'"),
     lambda backend, device: pf.SinusoidalPositionalEncoding(8, x_scale="2", backend=backend)),
    ("add_positions_shape", ValueError, ("[5]", "x.shape[:-1]"),
     lambda backend, device: pf.add_sinusoidal(torch.randn(3, 9, 8, device=device),
                                               positions=torch.arange(5, device=device), backend=backend)),
    ("cpu_backend_on_meta", RuntimeError, ("'meta'", "'torch'"),
     lambda backend, device: pf.SinusoidalEmbedding(50, 12, backend="cpu", device="meta")(
         torch.zeros(2, 3, dtype=torch.int64, device="meta"))),
    *[(f"from_pretrained_{name}_ignored", ValueError, ("from_pretrained", shown),
       lambda backend, device, kwargs=kwargs: pf.SinusoidalEmbedding.from_pretrained(
           torch.randn(10, 8, device=device), backend=backend, **kwargs))
      for name, shown, kwargs in [("dtype", "dtype=torch.float16", dict(dtype=torch.float16)),
                                  ("device", "device=meta", dict(device="meta"))]],
    ("add_x_nested", TypeError, ("x", "nested"), addition(lambda d: _nested_rows(torch.randn(2, 3, 8, device=d)))),
    *[(f"add_x_{what}{'_layer' if through_layer else ''}", error, ("x",) + fragments,
       addition(make_x, through_layer=through_layer))
      for what, error, fragments, make_x in [
          ("int", TypeError, ("int64",), lambda d: torch.ones(2, 3, 8, dtype=torch.int64, device=d)),
          ("0d", ValueError, ("0-d",), lambda d: torch.tensor(1.0, device=d)),
          ("sparse", TypeError, ("sparse_coo",), lambda d: torch.randn(2, 3, 8, device=d).to_sparse()),
          ("negated", ValueError, ("x.is_neg()",), lambda d: _negated(2, 3, 8, device=d))]
      for through_layer in (False, True)],
    # -- the torch.library ops called directly
    ("op_pe_columns_beyond_the_row", ValueError, "pe_width", op(lambda d: dict(pe_width=16))),
    ("op_table_narrower_than_pe", ValueError, "pe_width", op(lambda d: dict(weight=torch.randn(20, 4, device=d)))),
    ("op_concat_without_pe", ValueError, "pe_width", op(lambda d: dict(concat=True, pe_width=0))),
    ("op_turns_too_long", ValueError, "turns", op(lambda d: dict(turns=_i64(7, device=d)))),
    ("op_turns_int32", ValueError, "turns", op(lambda d: dict(turns=torch.zeros(4, dtype=torch.int32, device=d)))),
    ("op_pe_columns_out_of_order", ValueError, "pe_columns", op(lambda d: dict(pe_columns=[1, 0, 8, 8, 4]))),
    ("op_positions_short", ValueError, "positions", op(lambda d: dict(positions=_i64(11, device=d)))),
    ("op_positions_int32", ValueError, "positions", op(lambda d: dict(positions=torch.zeros(12, dtype=torch.int32,
                                                                                              device=d)))),
    ("op_positions_strided", ValueError, "positions", op(lambda d: dict(positions=_i64(12, 2, device=d)[:, 0]))),
    ("op_offsets_short", ValueError, "offsets", op(lambda d: dict(offsets=_i64(2, device=d)))),
    ("op_seq_len_zero", ValueError, "seq_len", op(lambda d: dict(seq_len=0))),
    ("op_seq_len_beyond_the_tokens", ValueError, "seq_len", op(lambda d: dict(seq_len=13))),
    # positions are cut by sequence too (the CPU kernel's position-major order)
    ("op_seq_len_beyond_the_positions", ValueError, "seq_len", op(lambda d: dict(positions=_i64(12, device=d),
                                                                                 seq_len=13))),
    ("op_seq_len_2_62", ValueError, "seq_len", op(lambda d: dict(positions=_i64(12, device=d), seq_len=2**62))),
    ("op_ids_2d", ValueError, "ids", op(lambda d: dict(ids=_i64(4, 3, device=d)))),
    ("op_ids_strided", ValueError, "ids", op(lambda d: dict(ids=_i64(24, device=d)[::2]))),
    ("op_ids_float", ValueError, "ids", op(lambda d: dict(ids=torch.zeros(12, device=d)))),
    ("op_weight_3d", ValueError, "weight", op(lambda d: dict(weight=torch.randn(20, 8, 1, device=d)))),
    ("op_dropout_seed_two_values", ValueError, "dropout_seed", op(lambda d: dict(dropout_seed=_i64(2, device=d),
                                                                                 dropout_p=0.5))),
    ("backward_op_grad_out_short", ValueError, "grad_out", backward_op((11, 8))),
    ("backward_op_grad_out_narrow", ValueError, "grad_out", backward_op((12, 7))),
    ("backward_op_grad_out_3d", ValueError, "grad_out", backward_op((12, 8, 1))),
]


def _assert_names(error, fragments):
    """``str(error)`` holds each fragment, in the order given."""
    message = str(error)
    at = 0
    for fragment in (fragments,) if isinstance(fragments, str) else fragments:
        found = message.find(fragment, at)
        assert found >= 0, f"message {message!r} does not name {fragment!r} (after {message[:at]!r})"
        at = found + len(fragment)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("name,error,fragment,call", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_before_any_kernel(name, error, fragment, call, backend, device, no_kernel):
    with pytest.raises(error) as info:
        call(backend, device)
    _assert_names(info.value, fragment)


REFERENCE_CALLS = [c for c in BAD_CALLS if isinstance(c[3], _Functional) and c[3].reference]


@pytest.mark.parametrize("name,error,fragment,call", REFERENCE_CALLS, ids=[c[0] for c in REFERENCE_CALLS])
def test_reference_rejects_the_same_inputs(name, error, fragment, call):
    with pytest.raises(error) as info:
        call.on_reference()
    _assert_names(info.value, fragment)


def test_bad_call_names_are_unique():
    names = [c[0] for c in BAD_CALLS]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("backend,device", [t for t in TARGETS if t.values[0] == "triton"])
def test_unsupported_dtype_for_backend(backend, device, no_kernel):
    ids, weight = _inputs(device, dtype=torch.float64)
    with pytest.raises(TypeError, match="weight dtype torch.float64"):
        pf.sinusoidal_embedding(ids, weight, backend=backend)
    with pytest.raises(TypeError, match="x dtype torch.float64"):  # add_sinusoidal has no weight
        pf.add_sinusoidal(weight[None], backend=backend)


def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ids, weight = _inputs("cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        pf.sinusoidal_embedding(ids, weight, backend="triton")


# -- with the id check off: out-of-range ids contribute exactly zero, and nothing outside the table is read --

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


@pytest.mark.parametrize("backend,device", TARGETS)
def test_out_of_range_ids_ignore_inf_in_row_zero(backend, device):
    """Out-of-range ids are not clamped to a row: row 0 holds inf, their gradients inf and NaN, and still the
    output at them is the PE alone and the gradient finite, with none for row 0."""
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
    """A table of no rows: every id is refused with the check on, and gives the PE alone with it off."""
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


# -- the spec caches: a repeated argument is checked as the first ----------------------------------------

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
