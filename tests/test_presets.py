"""posenc_fast.presets against each library's formula, re-derived here independently.

Each ``*_table`` below is written from the library code the preset names (not from
posenc_fast): with ``dtype=float64`` it is the exact math, with ``dtype=float32`` it is
the library's own fp32 table (the same operations in the same precision).  Marian and
XLM build their tables in float64 (numpy) and round to fp32, so their fp32 table is
correctly rounded; every other library forms the angle in fp32.
"""

import math
from typing import Callable, NamedTuple, Optional

import pytest
import torch
from torch import nn

import posenc_fast as pf
from posenc_fast import presets

from cases import assert_within, backend_targets, output_bound, targets

TARGETS = backend_targets()
# A preset reaches the weight gradient as its embed scale and padding row only, which test_functional's
# weight-gradient cases take through Triton's interpreter too.
GRADIENT_TARGETS = targets(slow_on_interpreter="every preset's gradient through the interpreter: 3 to 4 s each")
MAX_POSITION = 8192


def _cat_odd_zero(columns, n, dtype):
    return torch.cat(columns + [torch.zeros(n, 1, dtype=dtype)], dim=1)


def vaswani_table(pos, d, dtype):
    div_term = torch.exp(torch.arange(0, d, 2, dtype=dtype) * (-math.log(10000.0) / d))
    angle = pos.to(dtype)[:, None] * div_term
    pe = torch.zeros(len(pos), d, dtype=dtype)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe


def tensor2tensor_table(pos, d, dtype):
    num_timescales = d // 2
    increment = math.log(1.0e4 / 1.0) / max(num_timescales - 1, 1)
    inv_timescales = 1.0 * torch.exp(torch.arange(num_timescales, dtype=dtype) * -increment)
    scaled = pos.to(dtype)[:, None] * inv_timescales[None, :]
    signal = torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)
    return _cat_odd_zero([signal], len(pos), dtype) if d % 2 else signal


def fairseq_table(pos, d, dtype, padding_idx=1):
    half = d // 2
    step = math.log(10000.0) / max(half - 1, 1)
    rates = torch.exp(torch.arange(half, dtype=dtype) * -step)
    angle = pos.to(dtype)[:, None] * rates[None, :]
    emb = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)
    if d % 2:
        emb = _cat_odd_zero([emb], len(pos), dtype)
    emb[pos == padding_idx] = 0
    return emb


def whisper_table(pos, d, dtype):
    increment = math.log(10000.0) / (d // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(d // 2, dtype=dtype))
    scaled = pos.to(dtype)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


def _per_column_angles(pos, d):  # float64, as the numpy code does
    j = torch.arange(d, dtype=torch.float64)
    return pos.to(torch.float64)[:, None] / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / d)


def marian_table(pos, d, dtype):
    enc = _per_column_angles(pos, d)
    sentinel = d // 2 if d % 2 == 0 else d // 2 + 1
    out = torch.zeros(len(pos), d, dtype=torch.float64)
    out[:, :sentinel] = torch.sin(enc[:, 0::2])
    out[:, sentinel:] = torch.cos(enc[:, 1::2])
    return out.to(dtype)


def xlm_table(pos, d, dtype):
    enc = _per_column_angles(pos, d)
    out = torch.zeros(len(pos), d, dtype=torch.float64)
    out[:, 0::2] = torch.sin(enc[:, 0::2])
    out[:, 1::2] = torch.cos(enc[:, 1::2])
    return out.to(dtype)


def musicgen_table(pos, d, dtype):
    half = d // 2
    step = math.log(10000.0) / (half - 1)
    rates = torch.exp(torch.arange(half, dtype=dtype) * -step)
    angle = pos.to(dtype)[:, None] * rates[None, :]
    emb = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1)
    return _cat_odd_zero([emb], len(pos), dtype) if d % 2 else emb


def nemo_nlp_table(pos, d, dtype):
    return vaswani_table(pos, d, dtype) / math.sqrt(d)


class Library(NamedTuple):
    table: Callable  # (positions, d, dtype) -> the library's table
    scale_of: Callable[[int], float]  # d -> embed scale
    odd: Optional[int]  # an odd width the library allows, or None
    float64_table: bool  # the library builds its table in float64
    # Positions as fairseq's make_positions numbers them: padding_idx 1 (the tests' choice), real tokens from 2.
    fairseq_positions: bool = False


LIBRARY = {
    "vaswani": Library(vaswani_table, math.sqrt, None, False),
    "tensor2tensor": Library(tensor2tensor_table, math.sqrt, 9, False),
    "fairseq": Library(fairseq_table, math.sqrt, 9, False, fairseq_positions=True),
    # fairseq's table; FSMT's rule differs only when decoding
    "fsmt": Library(fairseq_table, math.sqrt, 9, False, fairseq_positions=True),
    "whisper": Library(whisper_table, lambda d: 1.0, None, False),
    "marian": Library(marian_table, math.sqrt, 7, True),
    "xlm": Library(xlm_table, lambda d: 1.0, 7, True),
    "musicgen": Library(musicgen_table, lambda d: 1.0, 9, False),
    "nemo_nlp": Library(nemo_nlp_table, lambda d: 1.0, None, False),
}


def _padding_idx(name):
    """padding_idx for a preset's layer: 1 where the library numbers positions after it, else None."""
    return 1 if LIBRARY[name].fairseq_positions else None


def test_registry_lists_every_library_preset():
    assert set(presets.names()) == set(LIBRARY)
    for name in presets.names():
        preset = presets.get(name)
        assert preset.libraries and preset.source
    with pytest.raises(ValueError, match="available: vaswani"):
        presets.get("gpt2")
    with pytest.raises(TypeError):
        presets.PRESETS["mine"] = presets.get("xlm")  # read-only registry


@pytest.mark.parametrize("name", [n for n, v in LIBRARY.items() if v.odd is None])
def test_even_only_libraries_reject_odd_width(name):
    with pytest.raises(ValueError, match="even PE width.*got 9"):
        pf.SinusoidalEmbedding.from_preset(name, 10, 9)


def _widths(name):
    odd = LIBRARY[name].odd
    return ([odd] if odd else []) + [8, 64, 512, 1024]


def _positions(name, seed):
    g = torch.Generator().manual_seed(seed)
    low = 2 if LIBRARY[name].fairseq_positions else 0  # fairseq: padding_idx 1, real tokens from 2
    sample = torch.randint(low, MAX_POSITION + 1, (40,), generator=g)
    return torch.cat([torch.tensor([low, low + 1, MAX_POSITION - 1, MAX_POSITION]), sample])


CASES = [(name, d) for name in LIBRARY for d in _widths(name)]


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("name,d", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_preset_forward_matches_library_formula(name, d, backend, device, seed):
    table, scale_of = LIBRARY[name].table, LIBRARY[name].scale_of
    pos = _positions(name, seed)
    padding_idx = _padding_idx(name)
    layer = pf.SinusoidalEmbedding.from_preset(name, 50, d, padding_idx=padding_idx, backend=backend).to(device)
    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(2, 50, (len(pos),), generator=g)
    out = layer(ids.to(device), positions=pos.to(device))
    exact = layer.weight.detach().double().cpu()[ids] * scale_of(d) + table(pos, d, torch.float64)
    # The float64 table above forms angles up to MAX_POSITION rad: it carries ~|angle| 2^-53 itself,
    # which matters against the half-ulp bound of precision="float64".
    reference_error = MAX_POSITION * 2.0**-50
    bound = output_bound(exact, torch.float32, layer.spec.precision) + reference_error
    assert_within(out, exact, bound, f"{name} d={d}")


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("name", list(LIBRARY))
def test_preset_at_least_as_accurate_as_the_library_table(name, backend, device, seed):
    """The library's fp32 table is the tolerance: ours must be at least as close to float64 math.

    Marian and XLM round a float64 table once (error <= half an fp32 ulp), which no fp32
    arithmetic can match: their presets compute in float64 (precision="float64") and so
    are correctly rounded too.  With precision="float32" they are held to the fp32 bar.
    """
    table, float64_table = LIBRARY[name].table, LIBRARY[name].float64_table
    pos = _positions(name, seed)
    d = 64
    layer = pf.SinusoidalEmbedding.from_preset(name, 4, d, padding_idx=_padding_idx(name),
                                               backend=backend).to(device)
    with torch.no_grad():
        layer.weight.zero_()
    ours = layer(torch.full((len(pos),), 2, device=device), positions=pos.to(device)).double().cpu()
    exact = table(pos, d, torch.float64)
    library = table(pos, d, torch.float32).double()
    ours_error = (ours - exact).abs().max().item()
    library_error = (library - exact).abs().max().item()
    assert ours_error <= library_error, f"ours {ours_error:.3g} vs library {library_error:.3g}"
    if float64_table:
        assert library_error <= 2.0**-25
        fast = pf.SinusoidalEmbedding.from_preset(name, 4, d, precision="float32", backend=backend).to(device)
        with torch.no_grad():
            fast.weight.zero_()
        fast_out = fast(torch.full((len(pos),), 2, device=device), positions=pos.to(device)).double().cpu()
        assert (fast_out - exact).abs().max().item() <= 1e-6


@pytest.mark.parametrize("backend,device", GRADIENT_TARGETS)
@pytest.mark.parametrize("name,d", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_preset_gradient(name, d, backend, device, seed):
    scale_of = LIBRARY[name].scale_of
    vocab = 9
    padding_idx = _padding_idx(name)
    layer = pf.SinusoidalEmbedding.from_preset(name, vocab, d, padding_idx=padding_idx, backend=backend).to(device)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 20), generator=g)
    grad_out = torch.randn(3, 20, d, generator=g)
    positions = torch.randint(0, MAX_POSITION + 1, (3, 20), generator=g)
    out = layer(ids.to(device), positions=positions.to(device))
    (grad,) = torch.autograd.grad(out, layer.weight, grad_out.to(device))
    exact = torch.zeros(vocab, d, dtype=torch.float64).index_add_(0, ids.reshape(-1), grad_out.reshape(-1, d).double())
    exact *= scale_of(d)
    magnitude = torch.zeros(vocab, d, dtype=torch.float64).index_add_(0, ids.reshape(-1),
                                                                        grad_out.reshape(-1, d).double().abs())
    if padding_idx is not None:
        exact[padding_idx] = 0
    assert_within(grad, exact, 1e-5 * magnitude * scale_of(d) + 1e-30, f"{name} gradient")


class LibraryStyleEmbedding(nn.Module):
    """Token embedding, scale, positional table, add: how each library builds its first layer."""

    def __init__(self, weight, name, padding_idx, max_len=64):
        super().__init__()
        table, scale_of = LIBRARY[name].table, LIBRARY[name].scale_of
        self.embed = nn.Embedding.from_pretrained(weight, freeze=False, padding_idx=padding_idx)
        self.scale = scale_of(weight.shape[1])
        self.fairseq = LIBRARY[name].fairseq_positions
        self.padding_idx = padding_idx
        self.register_buffer("table", table(torch.arange(max_len), weight.shape[1], torch.float32))

    def forward(self, ids):
        if self.fairseq:
            mask = ids.ne(self.padding_idx).long()
            positions = torch.cumsum(mask, dim=1) * mask + self.padding_idx
        else:
            positions = torch.arange(ids.shape[1]).expand(ids.shape)
        return self.embed(ids) * self.scale + self.table[positions]


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("name", list(LIBRARY))
def test_swap_into_a_library_style_encoder(name, backend, device):
    """Same weights, same encoder on top: outputs and gradients agree with the library's way."""
    torch.manual_seed(0)
    d, vocab = 16, 40
    padding_idx = 1 if name in ("fairseq", "fsmt", "marian") else None
    weight = torch.randn(vocab, d)
    if padding_idx is not None:
        weight[padding_idx] = 0
    encoder = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    ids = torch.randint(2, vocab, (2, 24))
    if padding_idx is not None:
        ids[0, :5] = padding_idx  # left padding
        ids[1, -3:] = padding_idx  # right padding
    library = LibraryStyleEmbedding(weight.clone(), name, padding_idx)
    ours = pf.SinusoidalEmbedding.from_pretrained(weight.clone().to(device), preset=name, padding_idx=padding_idx,
                                                  backend=backend)
    expected = encoder(library(ids))
    got = encoder(ours(ids.to(device)).cpu())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    expected_grad = torch.autograd.grad(expected.square().sum(), library.embed.weight)[0]
    got_grad = torch.autograd.grad(got.square().sum(), ours.weight)[0].cpu()
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend,device", TARGETS)
@pytest.mark.parametrize("name", ["fairseq", "marian", "musicgen"])
def test_incremental_decoding_matches_the_full_sequence(name, backend, device):
    """Decoding one token at a time with offset=past length gives the full sequence's rows."""
    torch.manual_seed(0)
    padding_idx = 1
    layer = pf.SinusoidalEmbedding.from_preset(name, 30, 12, padding_idx=padding_idx, backend=backend).to(device)
    ids = torch.randint(2, 30, (3, 9))
    ids[1, :4] = padding_idx  # left padding
    ids[2, :] = padding_idx  # an all-padding row
    full = layer(ids.to(device))
    if name == "fairseq":  # fairseq's past length counts only real tokens
        past_of = lambda t: (ids[:, :t] != padding_idx).sum(-1).to(device)  # noqa: E731
    else:
        past_of = lambda t: t  # noqa: E731
    steps = [layer(ids[:, t:t + 1].to(device), offset=past_of(t)) for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=0)
    if name == "fairseq":
        assert torch.count_nonzero(full[2]) == 0, "padding rows carry neither embedding nor PE"


def test_from_pretrained_shares_storage_and_freezes():
    weight = torch.randn(10, 8)
    layer = pf.SinusoidalEmbedding.from_pretrained(weight, freeze=True)
    assert layer.weight.data_ptr() == weight.data_ptr() and not layer.weight.requires_grad
    concat = pf.SinusoidalEmbedding.from_pretrained(weight, mode="concat", d_pos=4)
    assert concat.d_model == 12 and concat(torch.tensor([1, 2])).shape == (2, 12)
    assert "preset='whisper'" in repr(pf.SinusoidalEmbedding.from_pretrained(weight, preset="whisper"))


@pytest.mark.parametrize("backend,device", TARGETS)
def test_overrides_of_base_and_d_pos_reach_the_preset_recipe(backend, device):
    """from_preset's overrides win: ``base`` is the libraries' max_timescale (tensor2tensor, Whisper), and a
    concat layer's PE is its d_pos columns from the library's formula at that width."""
    pos = torch.arange(0, 3000, 71)
    d = 12
    for name, max_timescale in (("tensor2tensor", 100.0), ("whisper", 3.0e5)):
        rates = torch.exp(-math.log(max_timescale) / (d // 2 - 1) * torch.arange(d // 2, dtype=torch.float64))
        exact = torch.cat([(pos.double()[:, None] * rates).sin(), (pos.double()[:, None] * rates).cos()], dim=1)
        layer = pf.SinusoidalEmbedding.from_preset(name, 1, d, base=max_timescale, backend=backend).to(device)
        with torch.no_grad():
            layer.weight.zero_()
        got = layer(torch.zeros(len(pos), dtype=torch.int64, device=device), positions=pos.to(device))
        assert_within(got, exact, output_bound(exact, torch.float32), f"{name}, base={max_timescale}")
        addition = pf.SinusoidalPositionalEncoding.from_preset(name, d, base=max_timescale, backend=backend)
        got = addition(torch.zeros(len(pos), d, device=device), positions=pos.to(device))
        assert_within(got, exact, output_bound(exact, torch.float32), f"{name} encoding, base={max_timescale}")
    concat = pf.SinusoidalEmbedding.from_preset("fairseq", 30, 8 + 6, padding_idx=1, mode="concat", d_pos=6,
                                                backend=backend).to(device)
    ids = torch.randint(2, 30, (1, 20))
    exact = fairseq_table(torch.arange(2, 22), 6, torch.float64)  # make_positions: from padding_idx + 1
    got = concat(ids.to(device))[0, :, 8:]
    assert_within(got, exact, output_bound(exact, torch.float32), "fairseq concat PE")


@pytest.mark.parametrize("backend,device", TARGETS)
def test_fsmt_rule_moves_padding_with_the_past_length(backend, device):
    """HF FSMT numbers a padding token decoded at past length p > 0 as padding_idx + p, with that
    position's PE (a finished row in generate()); at p = 0 it is the padding position, with no PE."""
    torch.manual_seed(0)
    pad, d = 1, 12
    fsmt = pf.SinusoidalEmbedding.from_preset("fsmt", 30, d, padding_idx=pad, backend=backend).to(device)
    fairseq = pf.SinusoidalEmbedding.from_preset("fairseq", 30, d, padding_idx=pad, backend=backend).to(device)
    with torch.no_grad():
        fsmt.weight.copy_(fairseq.weight)
    step = torch.tensor([[7], [pad]], device=device)
    table = fairseq_table(torch.arange(40), d, torch.float64, padding_idx=pad)
    for past in (0, 5):
        got = fsmt(step, offset=past)
        token = fsmt.weight.detach().double().cpu()[step.cpu()] * math.sqrt(d)
        expected = token + table[torch.tensor([[pad + 1 + past], [pad + past]])]
        assert_within(got, expected, output_bound(expected, torch.float32), f"fsmt step at past {past}")
        # fairseq keeps padding at padding_idx: no PE, whatever the past length
        assert torch.count_nonzero(fairseq(step, offset=past)[1]) == 0
    assert torch.count_nonzero(fsmt(step, offset=5)[1]) > 0
    with pytest.raises(ValueError, match="fsmt"):
        fsmt(step, offset=torch.tensor([5, 5], device=device))


def test_make_positions_shift_padding():
    ids = torch.tensor([[1, 1, 5, 6], [5, 6, 1, 1]])
    assert pf.make_positions(ids, 1, 3).tolist() == [[1, 1, 5, 6], [5, 6, 1, 1]]
    assert pf.make_positions(ids, 1, 3, shift_padding=True).tolist() == [[4, 4, 5, 6], [5, 6, 4, 4]]


def test_from_pretrained_keeps_the_parameter_it_is_given():
    """A model's Parameter (tied to its output projection) stays the one Parameter: the layer's gradient
    lands on it, and the model holds no second Parameter over the same storage."""
    model = nn.Module()
    model.embed = nn.Embedding(12, 8, padding_idx=1)
    model.head = nn.Linear(8, 12, bias=False)
    model.head.weight = model.embed.weight  # tied
    layer = pf.SinusoidalEmbedding.from_pretrained(model.embed.weight, preset="fairseq", padding_idx=1)
    model.fused = layer
    assert layer.weight is model.embed.weight
    assert len(list(model.parameters())) == 1
    ids = torch.tensor([[2, 3, 1]])
    model.head(layer(ids)).sum().backward()
    grad = model.embed.weight.grad
    expected_token_part = torch.zeros(12, 8).index_add_(0, ids[0, :2], torch.ones(2, 1) * model.head.weight.sum(0)
                                                         * math.sqrt(8))
    expected_head_part = (layer(ids).detach().sum(dim=(0, 1))).expand(12, 8)
    torch.testing.assert_close(grad, expected_token_part + expected_head_part)
    with pytest.raises(ValueError, match="freeze=True"):
        pf.SinusoidalEmbedding.from_pretrained(model.embed.weight, freeze=True)
