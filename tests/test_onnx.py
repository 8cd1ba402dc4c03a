"""ONNX export through torch.onnx.export(dynamo=True), run in ONNX Runtime, against eager and float64.

ONNX has no fused op: while the exporter traces, the public functions emit the layer's definition in
standard ops (``ops.standard_ops_forward``: a gather, the exact fixed-point phase as a wrapping int64
multiply, float64 sin/cos, one rounding).  Batch, length and past length stay dynamic, so every check
runs the exported model at other sizes and offsets than the example's.  The TorchScript-based
exporter traces: it takes calls with explicit positions (nothing is derived from the length) and
refuses the others with a message that points to ``dynamo=True``.
"""

import functools

import pytest
import torch
from torch.export import Dim

import posenc_fast as pf
from posenc_fast import reference

from cases import assert_within, output_bound
from tiny_models import tiny_marian_config

onnx = pytest.importorskip("onnx", reason="ONNX export tests need onnx (the [test] extra installs it)")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (the [test] extra)")
ort = pytest.importorskip("onnxruntime", reason="running the exported model needs onnxruntime (the [test] extra)")

VOCAB, WIDTH = 50, 24


class WithPast(torch.nn.Module):
    """``layer`` called as a decoder calls it: the past length is another input's length (a SymInt)."""

    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, ids, past):
        return self.call(ids, past.shape[1])


def _layers():
    """name -> (module to export, exact(ids_or_x, past) in float64, input maker)."""
    g = torch.Generator().manual_seed(5)
    module = pf.SinusoidalEmbedding(VOCAB, WIDTH, embed_scale=WIDTH ** 0.5, padding_idx=1).eval()
    concat = pf.SinusoidalEmbedding(VOCAB, WIDTH, mode="concat", d_pos=8, layout="split").eval()
    weight = torch.randn(VOCAB, WIDTH, generator=g)
    pe = pf.SinusoidalPositionalEncoding(WIDTH, x_scale=0.5, layout="split").eval()

    def ids(batch, length):
        return torch.randint(0, VOCAB, (batch, length))

    def x(batch, length):
        return torch.randn(batch, length, WIDTH)

    return {
        "module": (lambda i, p: module(i, offset=p),
                   lambda i, p: reference.sinusoidal_embedding(i, module.weight.detach().double(), offset=p,
                                                               embed_scale=WIDTH ** 0.5, padding_idx=1), ids),
        "module_concat": (lambda i, p: concat(i, offset=p),
                          lambda i, p: reference.sinusoidal_embedding(i, concat.weight.detach().double(), offset=p,
                                                                      mode="concat", d_pos=8, layout="split"), ids),
        "functional": (lambda i, p: pf.sinusoidal_embedding(i, weight, offset=p, layout="split", training=False),
                       lambda i, p: reference.sinusoidal_embedding(i, weight.double(), offset=p, layout="split"), ids),
        "add_sinusoidal": (lambda v, p: pf.add_sinusoidal(v, offset=p, x_scale=2.0),
                           lambda v, p: 2.0 * v.double() + reference.sinusoidal_table(
                               p + torch.arange(v.shape[1]), WIDTH), x),
        "pe_module": (lambda v, p: pe(v, offset=p),
                      lambda v, p: 0.5 * v.double() + reference.sinusoidal_table(
                          p + torch.arange(v.shape[1]), WIDTH, layout="split"), x),
    }


LAYERS = _layers()


def _export(call, example, past):
    batch, length = Dim("batch", max=64), Dim("length", max=1 << 16)
    program = torch.onnx.export(WithPast(call), (example, past), dynamo=True, verbose=False,
                                dynamic_shapes=({0: batch, 1: length}, {1: Dim("past", max=1 << 24)}))
    return ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _assert_correctly_rounded(got, exact, what):
    """Every element of ``got`` is ``exact`` (float64) rounded to nearest, as the reference rounds it: the
    graph computes in float64 as the reference does.  Within 2**-45 of a tie either neighbour is taken,
    as ONNX Runtime's sin and cos may differ from torch's in a float64 ulp."""
    nudged = [(exact * (1 + sign * 2.0**-45)).to(got.dtype) for sign in (-1, 1)]
    wrong = (got != nudged[0]) & (got != nudged[1])
    assert not bool(wrong.any()), f"{what}: {int(wrong.sum())} elements not correctly rounded, e.g. " \
        f"{got[wrong][:3].tolist()} for {exact[wrong][:3].tolist()}"


@pytest.mark.parametrize("name", list(LAYERS))
def test_onnx_export_runs_in_onnxruntime_at_other_sizes(name):
    call, exact, make = LAYERS[name]
    session = _export(call, make(2, 7), torch.zeros(1, 3))
    names = [i.name for i in session.get_inputs()]
    # Other batch sizes, lengths (a decoding step among them) and past lengths than the example's,
    # far positions included: the phase is exact in int64, so the angles stay right there too.
    for batch, length, past in [(3, 11, 0), (1, 1, 40), (4, 300, 5), (2, 5, 70000), (1, 3, (1 << 24) - 1)]:
        inputs = make(batch, length)
        feed = {names[0]: inputs.numpy()}
        if len(names) > 1:
            feed[names[1]] = torch.zeros(1, past).numpy()
        got = torch.from_numpy(session.run(None, feed)[0])
        with torch.no_grad():
            eager = call(inputs, past)
        torch.testing.assert_close(got, eager, atol=1e-5, rtol=0)
        expected = exact(inputs, past)
        assert_within(got, expected, output_bound(expected, torch.float32), f"{name} at {(batch, length, past)}")
        _assert_correctly_rounded(got, expected, f"{name} at {(batch, length, past)}")


def test_onnx_graph_has_no_custom_op():
    """Only standard ONNX operators: a runtime without posenc_fast runs the model."""
    call, _, make = LAYERS["module"]
    program = torch.onnx.export(WithPast(call), (make(2, 7), torch.zeros(1, 3)), dynamo=True, verbose=False)
    domains = {node.domain for node in program.model_proto.graph.node}
    assert domains <= {"", "ai.onnx"}, domains


def test_torchscript_exporter_points_to_dynamo(tmp_path):
    """Positions from the length: a trace would bake the length in, so the exporter is refused."""
    layer = pf.SinusoidalEmbedding(VOCAB, WIDTH).eval()
    with pytest.raises(Exception, match="explicit positions.*dynamo=True"):
        torch.onnx.export(layer, (torch.randint(0, VOCAB, (2, 5)),), str(tmp_path / "m.onnx"), dynamo=False)


class WithPositions(torch.nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, first, positions):
        return self.call(first, positions=positions)


@pytest.mark.parametrize("name", ["module", "add_sinusoidal"])
def test_torchscript_exporter_with_explicit_positions(name, tmp_path):
    """Explicit positions (what a patched Hugging Face position module passes, so optimum's exporter
    works): the TorchScript exporter's model runs in ONNX Runtime at other sizes and positions."""
    g = torch.Generator().manual_seed(9)
    if name == "module":
        layer = pf.SinusoidalEmbedding(VOCAB, WIDTH, embed_scale=WIDTH ** 0.5, padding_idx=1).eval()
        call = layer  # a submodule of the exported module: its table is the model's, not a constant
        make = lambda shape: torch.randint(0, VOCAB, shape, generator=g)  # noqa: E731
        exact = lambda ids, positions: reference.sinusoidal_embedding(  # noqa: E731
            ids, layer.weight.detach().double(), positions=positions, embed_scale=WIDTH ** 0.5, padding_idx=1)
    else:
        call = functools.partial(pf.add_sinusoidal, x_scale=2.0)
        make = lambda shape: torch.randn(*shape, WIDTH, generator=g)  # noqa: E731
        exact = lambda x, positions: 2.0 * x.double() + reference.sinusoidal_table(positions, WIDTH)  # noqa: E731
    path = str(tmp_path / "m.onnx")
    with torch.no_grad():
        torch.onnx.export(WithPositions(call), (make((2, 5)), torch.arange(5).expand(2, 5)), path, dynamo=False,
                          input_names=["first", "positions"], dynamic_axes={"first": {0: "batch", 1: "length"},
                                                                            "positions": {0: "batch", 1: "length"}})
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for shape in [(3, 11), (1, 1), (4, 300)]:
        first, positions = make(shape), torch.randint(0, 1 << 24, shape, generator=g)
        got = torch.from_numpy(session.run(None, {"first": first.numpy(), "positions": positions.numpy()})[0])
        expected = exact(first, positions)
        assert_within(got, expected, output_bound(expected, torch.float32), f"{name} at {shape}")


def test_dropout_in_training_mode_is_refused():
    layer = pf.SinusoidalEmbedding(VOCAB, WIDTH, dropout=0.1).train()
    with pytest.raises(Exception, match="eval mode"):
        torch.onnx.export(layer, (torch.randint(0, VOCAB, (2, 5)),), dynamo=True, verbose=False)


def test_patched_marian_exports_and_matches_the_unpatched_model():
    """A patched Marian (encoder + decoder logits) through torch.onnx.export(dynamo=True), run in ONNX
    Runtime at other batch sizes and lengths, with padding, against the unpatched model in eager."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face test needs transformers")
    import copy

    config = tiny_marian_config(transformers)
    torch.manual_seed(0)
    unpatched = transformers.MarianMTModel(config).eval()
    model = pf.patch_model(copy.deepcopy(unpatched))
    assert any(getattr(m, "_posenc_fast", None) is not None for m in model.modules()), "the model was not patched"

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, decoder_input_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                              use_cache=False).logits

    batch, source, target = Dim("batch", max=16), Dim("source", max=60), Dim("target", max=60)
    ids = torch.randint(3, 60, (2, 7))
    program = torch.onnx.export(Logits(model), (ids, torch.ones_like(ids), torch.randint(3, 60, (2, 5))),
                                dynamo=True, verbose=False,
                                dynamic_shapes=({0: batch, 1: source}, {0: batch, 1: source}, {0: batch, 1: target}))
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for b, s, t in [(3, 11, 4), (1, 20, 9), (2, 3, 1)]:
        source_ids = torch.randint(3, 60, (b, s))
        mask = torch.ones_like(source_ids)
        mask[0, :2] = 0  # left padding in the first sequence
        source_ids[0, :2] = 1
        decoder_ids = torch.randint(3, 60, (b, t))
        got = session.run(None, dict(zip(names, [source_ids.numpy(), mask.numpy(), decoder_ids.numpy()])))[0]
        with torch.no_grad():
            want = unpatched(input_ids=source_ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1e-5)
