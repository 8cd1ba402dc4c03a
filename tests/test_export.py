"""torch.export with dynamic shapes: batch, sequence length and a symbolic past length (offset).

Each entry point is exported in strict and non-strict mode with dynamic dims, the exported program
is run at other batch sizes, lengths and offsets than the example's, and compared with the eager
call (same kernels: equal) and with the float64 reference.  The past length is a SymInt taken from
another input's shape (``past.shape[1]``), as Hugging Face decoders pass it.

Each test builds its layer with a ``base`` no other test file uses, and runs it eagerly before
exporting (PESpec caches its frequency tensor per device).
"""

import pytest
import torch

import posenc_fast
from posenc_fast import SinusoidalEmbedding, SinusoidalPositionalEncoding, reference

from cases import BACKEND_TRAITS, cpu_extension_problem
from tiny_models import tiny_marian_config

export_module = pytest.importorskip("torch.export", reason="torch.export is not available in this PyTorch")
if not hasattr(export_module, "Dim") or not hasattr(export_module, "export"):
    pytest.skip("torch.export has no Dim/export in this PyTorch (dynamic shapes need torch >= 2.2)",
                allow_module_level=True)

Dim, export = export_module.Dim, export_module.export

EMBEDDING_OP = torch.ops.posenc_fast.sinusoidal_embedding.default
ADD_OP = torch.ops.posenc_fast.add_sinusoidal.default

VOCAB, D_MODEL = 97, 24
EXAMPLE = (2, 7, 5)  # (batch, sequence length, past length) of the example inputs
# (batch, sequence length, past length) to run the exported program at: a decoding step (length 1),
# no past, a past of one, and sizes other than the example's.
RUNS = [(3, 11, 40), (1, 1, 9), (4, 1, 300), (2, 5, 0), (5, 2, 1), (1, 33, 1000)]

STRICT = [pytest.param(True, id="strict"), pytest.param(False, id="nonstrict")]


def _backends():
    params = []
    for name in (name for name, traits in BACKEND_TRAITS.items() if traits.exported):
        problem = cpu_extension_problem() if name == "cpu" else None
        params.append(pytest.param(name, id=name, marks=pytest.mark.skipif(
            problem is not None, reason=f"CPU extension unavailable: {problem}")))
    return params


BACKENDS = _backends()
ENTRY_POINTS = ["module", "functional", "add_sinusoidal", "pe_module"]
BASES = {"module": 10007.0, "functional": 10009.0, "add_sinusoidal": 10037.0, "pe_module": 10039.0}


class _ModuleWithPast(torch.nn.Module):
    """``layer(ids, offset=past.shape[1])``: the past length as a SymInt of another input."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, ids, past):
        return self.layer(ids, offset=past.shape[1])


class _FunctionalWithPast(torch.nn.Module):
    def __init__(self, weight, backend):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.backend = backend

    def forward(self, ids, past):
        return posenc_fast.sinusoidal_embedding(ids, self.weight, offset=past.shape[1], base=BASES["functional"],
                                                backend=self.backend)


class _AddWithPast(torch.nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.backend = backend

    def forward(self, x, past):
        return posenc_fast.add_sinusoidal(x, offset=past.shape[1], base=BASES["add_sinusoidal"], backend=self.backend)


def _build(entry, backend):
    """(the model to export, make_inputs(batch, length, past, generator), float64 reference(inputs))."""
    base = BASES[entry]
    if entry in ("module", "functional"):
        if entry == "module":
            layer = SinusoidalEmbedding(VOCAB, D_MODEL, base=base, backend=backend).eval()
            model, weight = _ModuleWithPast(layer), layer.weight
        else:
            weight = torch.randn(VOCAB, D_MODEL)
            model = _FunctionalWithPast(weight, backend)
            weight = model.weight

        def inputs(b, s, p, gen):
            return torch.randint(0, VOCAB, (b, s), generator=gen), torch.zeros(b, p)

        def expected(ids, past):
            return reference.sinusoidal_embedding(ids, weight.detach().double(), offset=past.shape[1], base=base)
    else:
        model = _AddWithPast(backend) if entry == "add_sinusoidal" else _ModuleWithPast(
            SinusoidalPositionalEncoding(D_MODEL, base=base, backend=backend))

        def inputs(b, s, p, gen):
            return torch.randn(b, s, D_MODEL, generator=gen), torch.zeros(b, p)

        def expected(x, past):
            # Row n of x plays table row n: the reference embedding of ids 0..N-1 over x.
            b, s, d = x.shape
            ids = torch.arange(b * s).reshape(b, s)
            return reference.sinusoidal_embedding(ids, x.reshape(b * s, d).double(), offset=past.shape[1], base=base)
    return model.eval(), inputs, expected


def _dynamic_shapes():
    # The past length unbounded: an offset of int64 range is the graph's, not a guard on the past (strict too).
    batch, length, past = Dim("batch", min=1, max=64), Dim("length", min=1, max=2048), Dim("past", min=0)
    return ({0: batch, 1: length}, {0: batch, 1: past})


def _op_nodes(ep):
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target in (EMBEDDING_OP, ADD_OP)]


def _check_graph(ep, op, symbolic=("offset", "seq_len")):
    """The graph calls the fused op once (not a decomposition) with symbolic offset and seq_len."""
    nodes = _op_nodes(ep)
    assert [n.target for n in nodes] == [op], ep.graph
    schema = op._schema
    args = dict(zip((a.name for a in schema.arguments), nodes[0].args))
    for name in symbolic:
        assert isinstance(args[name], torch.fx.Node), f"{name}={args[name]!r} was specialised:\n{ep.graph}"
        # ... a free symbol of the program, whose range constraint is the dim's (not one value).
        value = args[name].meta["val"]
        assert isinstance(value, torch.SymInt) and value.node.expr in ep.range_constraints, (value, ep.range_constraints)
        bounds = ep.range_constraints[value.node.expr]
        assert bounds.lower != bounds.upper, bounds
    # No sin/cos of the PE outside the op: it is fused, not decomposed.
    decomposed = [n for n in ep.graph.nodes if n.op == "call_function" and "sin" in str(n.target)
                  and n.target not in (EMBEDDING_OP, ADD_OP)]
    assert not decomposed, ep.graph
    # The output's shape stays symbolic in batch and length, and the range constraints name the dims.
    out_shape = nodes[0].meta["val"].shape
    assert isinstance(out_shape[0], torch.SymInt), out_shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("strict", STRICT)
def test_export_dynamic_batch_length_and_past(strict, entry, backend, seed):
    gen = torch.Generator().manual_seed(seed)
    model, make_inputs, expected = _build(entry, backend)
    example = make_inputs(*EXAMPLE, gen)
    with torch.no_grad():
        model(*example)  # eager first (see the module docstring)
        ep = export(model, example, dynamic_shapes=_dynamic_shapes(), strict=strict)
    _check_graph(ep, EMBEDDING_OP if entry in ("module", "functional") else ADD_OP)
    exported = ep.module()
    for b, s, p in RUNS:
        args = make_inputs(b, s, p, gen)
        with torch.no_grad():
            got = exported(*args)
            want = model(*args)
        assert got.shape == want.shape == (b, s, D_MODEL)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got.double(), expected(*args), rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strict", STRICT)
def test_export_module_dynamic_length_without_offset(strict, backend, seed):
    """The call users make: ``export(SinusoidalEmbedding(...), (ids,), dynamic_shapes=({1: Dim(...)},))``,
    which specialised the length (``Constraints violated``) before validation kept it symbolic."""
    gen = torch.Generator().manual_seed(seed)
    layer = SinusoidalEmbedding(VOCAB, D_MODEL, base=10061.0, backend=backend).eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
    with torch.no_grad():
        layer(ids)
        ep = export(layer, (ids,), dynamic_shapes=({1: Dim("s", max=256)},), strict=strict)
    _check_graph(ep, EMBEDDING_OP, symbolic=("seq_len",))
    assert len(ep.range_constraints) == 1, ep.range_constraints  # the length, unspecialised
    exported = ep.module()
    for s in (1, 3, 200):
        ids = torch.randint(0, VOCAB, (2, s), generator=gen)
        with torch.no_grad():
            got, want = exported(ids), layer(ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got.double(), reference.sinusoidal_embedding(
            ids, layer.weight.detach().double(), base=10061.0), rtol=1e-6, atol=2e-6)


def test_export_module_triton_interpreter(seed):
    """One small case through Triton (its interpreter on CPU, natively on a GPU)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    layer = SinusoidalEmbedding(VOCAB, 8, base=10067.0, backend="triton", device=device).eval()
    model = _ModuleWithPast(layer)
    example = (torch.randint(0, VOCAB, (2, 3), generator=gen).to(device), torch.zeros(2, 4, device=device))
    with torch.no_grad():
        model(*example)
        ep = export(model, example, dynamic_shapes=_dynamic_shapes(), strict=False)
    _check_graph(ep, EMBEDDING_OP)
    args = (torch.randint(0, VOCAB, (3, 5), generator=gen).to(device), torch.zeros(3, 17, device=device))
    with torch.no_grad():
        got, want = ep.module()(*args), model(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("strict", STRICT)
def test_export_fairseq_rule_symbolic_past(strict, seed):
    """The padding-aware fairseq rule with a symbolic past length (positions built in the graph)."""
    gen = torch.Generator().manual_seed(seed)
    layer = SinusoidalEmbedding(VOCAB, D_MODEL, padding_idx=1, position_rule="fairseq", base=10069.0,
                                backend="torch").eval()
    model = _ModuleWithPast(layer)

    def inputs(b, s, p):
        ids = torch.randint(0, VOCAB, (b, s), generator=gen)
        ids[0, : s // 2] = 1  # left padding
        return ids, torch.zeros(b, p)

    with torch.no_grad():
        model(*inputs(*EXAMPLE))
        ep = export(model, inputs(*EXAMPLE), dynamic_shapes=_dynamic_shapes(), strict=strict)
    nodes = _op_nodes(ep)
    assert [n.target for n in nodes] == [EMBEDDING_OP], ep.graph
    for b, s, p in RUNS:
        args = inputs(b, s, p)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(*args), model(*args), rtol=0, atol=0)


def test_export_fsmt_rule_symbolic_past_is_refused():
    """fsmt gives padding a PE only for a nonzero past length: a branch export cannot keep symbolic
    (it would assume the example's branch at past length 0 too), so non-strict export refuses it."""
    layer = SinusoidalEmbedding(VOCAB, D_MODEL, padding_idx=1, position_rule="fsmt", zero_pe_at_padding=True,
                                base=10079.0, backend="torch").eval()
    model = _ModuleWithPast(layer)
    example = (torch.randint(2, VOCAB, (2, 7)), torch.zeros(2, 5))
    with torch.no_grad():
        model(*example)
        with pytest.raises(ValueError, match="fsmt.*symbolic past length"):
            export(model, example, dynamic_shapes=_dynamic_shapes(), strict=False)


def test_patched_marian_exports_with_transformers_static_cache_modules():
    """transformers' own export path for seq2seq models (integrations.executorch: an encoder exported
    with a dynamic length, a decoder step with a static cache and a cache_position input, strict
    export): a patched Marian's exported decoder gives the unpatched one's logits at every cached step,
    and both match the eager model run on the whole prefix."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face test needs transformers")
    executorch = pytest.importorskip("transformers.integrations.executorch",
                                     reason="this transformers has no export integration")
    import copy

    config = tiny_marian_config(transformers)
    torch.manual_seed(0)
    unpatched = transformers.MarianMTModel(config).eval()
    patched = posenc_fast.patch_model(copy.deepcopy(unpatched))
    prompt = torch.randint(3, 60, (1, 9))
    tokens = torch.randint(3, 60, (8,))
    steps = {}
    for name, model in (("unpatched", unpatched), ("patched", patched)):
        exported = executorch.Seq2SeqLMExportableModule(model, max_hidden_seq_length=64, max_cache_length=32).export()
        with torch.no_grad():
            encoded = exported.exported_encoder.module()(prompt)
            decoder = exported.exported_decoder.module()
            steps[name] = torch.stack([decoder(tokens[i].view(1, 1), encoded, torch.tensor([i]))[0, -1]
                                       for i in range(len(tokens))])
    torch.testing.assert_close(steps["patched"], steps["unpatched"], atol=2e-5, rtol=0)
    with torch.no_grad():
        eager = unpatched(input_ids=prompt, decoder_input_ids=tokens.view(1, -1)).logits[0]
    torch.testing.assert_close(steps["patched"], eager, atol=2e-5, rtol=0)


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_patched_model_exports_without_posenc_fast_ops(strict):
    """A patched model's position modules emit the float64 definition in standard ops under torch.export,
    strict or not: the program calls no posenc_fast op (it runs wherever the exported model is taken:
    ExecuTorch, ONNX, another process without posenc_fast), and matches the eager patched model at other
    sizes."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face test needs transformers")

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, decoder_input_ids):
            return self.inner(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits

    torch.manual_seed(0)
    model = Logits(posenc_fast.patch_model(transformers.MarianMTModel(tiny_marian_config(transformers)).eval()))
    batch, source, target = Dim("batch", max=16), Dim("source", max=60), Dim("target", max=60)
    program = export(model, (torch.randint(3, 60, (2, 7)), torch.randint(3, 60, (2, 5))), strict=strict,
                     dynamic_shapes=({0: batch, 1: source}, {0: batch, 1: target}))
    # The op nodes' targets, not every node's name: a lifted constant is named after the module path.
    called = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("posenc_fast" in name for name in called) and "aten.sin.default" in called, sorted(called)
    for shape in [(3, 11, 4), (1, 20, 9)]:
        ids, decoder_ids = torch.randint(3, 60, shape[:2]), torch.randint(3, 60, (shape[0], shape[2]))
        with torch.no_grad():
            torch.testing.assert_close(program.module()(ids, decoder_ids), model(ids, decoder_ids), atol=2e-5, rtol=0)


@pytest.mark.parametrize("strict", STRICT)
def test_export_packed_sequences_keep_their_count_symbolic(strict):
    """cu_seqlens with a dynamic number of sequences: the program runs any packing of any length."""
    layer = SinusoidalEmbedding(VOCAB, D_MODEL, base=10091.0, backend="torch").eval()

    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, ids, cu_seqlens):
            return self.layer(ids, cu_seqlens=cu_seqlens)

    example = (torch.randint(0, VOCAB, (12,)), torch.tensor([0, 5, 12]))
    with torch.no_grad():
        ep = export(Packed(), example, dynamic_shapes=({0: Dim("total")}, {0: Dim("sequences", min=2)}),
                    strict=strict)
    for cu in ([0, 20], [0, 1, 1, 7, 20], [0, 3, 9, 12, 16, 20]):
        ids, cu = torch.randint(0, VOCAB, (20,)), torch.tensor(cu)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(ids, cu), layer(ids, cu_seqlens=cu), rtol=0, atol=0)
