"""Presets: the sinusoid, scaling and position rule of the libraries users come from.

A preset is host-side data (a frequency recipe, a column layout, scales, a position rule, a precision);
the kernels stay library-agnostic.  Adding a library is one ``_register`` entry, naming the code it reproduces.
Frequencies come from the library's own formula in float64 and angles are exact (docs/design.md), so a preset
matches the library's float64 math and is more accurate than its fp32 table.  Marian and XLM build their tables
in float64 and round once, so their presets do too (``precision="float64"``: the same fp32 outputs but at
rounding midpoints within float64's error, docs/presets.md); ``precision="float32"`` is faster on GPUs with
little fp64 throughput, at fp32 rounding error.

    layer = SinusoidalEmbedding.from_preset("fairseq", vocab, 512, padding_idx=1)
    posenc_fast.presets.get("whisper").kwargs(384)     # for the functional API
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Callable, Dict, List, Optional, Tuple

# "offset": start + t.  "fairseq": make_positions (padding stays at padding_idx, with no PE).
# "fsmt": make_positions(..., shift_padding=True), where the past length moves padding too.
POSITION_RULES = ("offset", "fairseq", "fsmt")
PADDING_AWARE_RULES = ("fairseq", "fsmt")


def _half(pe_width: int) -> int:
    return pe_width // 2


def _vaswani(pe_width: int, base: float = 10000.0) -> Tuple[float, ...]:
    # exp(2i * -(ln base / D)): Annotated Transformer / PyTorch tutorial ``div_term``.
    return tuple(math.exp(2 * i * -(math.log(base) / pe_width)) for i in range(_half(pe_width)))


def _log_spaced_endpoints(pe_width: int, base: float = 10000.0) -> Tuple[float, ...]:
    # exp(-i * ln base / (h - 1)): fairseq get_embedding, Whisper sinusoids() (base: max_timescale), MusicGen;
    # tensor2tensor's get_timing_signal_1d, min_ts * exp(-i * ln(max_ts / min_ts) / (h - 1)), with min_ts 1.
    # (h - 1 is taken as at least 1, where the libraries divide by zero for D < 4.)
    half = _half(pe_width)
    step = math.log(base) / max(half - 1, 1)
    return tuple(math.exp(-i * step) for i in range(half))


def _per_column_pairs(pe_width: int, base: float = 10000.0) -> Tuple[float, ...]:
    # 1 / base^(2 * (j // 2) / D) for column j; the sin columns j = 2i give one rate per pair,
    # and an odd D has ceil(D / 2) of them: the last column is a sin (XLM, Marian).
    return tuple(1.0 / base ** (2 * i / pe_width) for i in range(pe_width - _half(pe_width)))


def _sqrt_width(d_model: int) -> float:
    return math.sqrt(d_model)


def _one(d_model: int) -> float:
    return 1.0


def _inverse_sqrt_width(d_model: int) -> float:
    return 1.0 / math.sqrt(d_model)


@dataclasses.dataclass(frozen=True)
class Preset:
    """One library's sinusoidal embedding convention."""

    name: str
    libraries: str
    source: str
    layout: str
    frequencies: Callable[[int, float], Tuple[float, ...]]  # PE width D, base -> rates (h, or h + 1: a sin tail)
    embed_scale: Callable[[int], float]  # d_model -> scale of the token embedding
    pe_scale: Callable[[int], float]  # d_model -> scale of the PE
    position_rule: str = "offset"  # one of POSITION_RULES
    odd_width: bool = True  # whether the library itself supports an odd width
    precision: str = "float32"  # "float64" where the library builds its table in float64
    notes: str = ""

    def kwargs(self, d_model: int, pe_width: Optional[int] = None, base: float = 10000.0) -> Dict:
        """Arguments of ``sinusoidal_embedding`` / ``SinusoidalEmbedding`` that realise this preset: scales for
        ``d_model``, a PE ``pe_width`` wide (default ``d_model``; concat mode: ``d_pos``), rates from ``base``
        (the libraries' 10000; tensor2tensor's and Whisper's max_timescale)."""
        pe_width = d_model if pe_width is None else pe_width
        if pe_width % 2 and not self.odd_width:
            raise ValueError(f"preset {self.name!r} needs an even PE width, as {self.libraries.split(',')[0]} "
                             f"does; got {pe_width}")
        frequencies = None  # for a base that is not a number > 0, which the layer then names
        if isinstance(base, (int, float)) and not isinstance(base, bool) and 0 < base < math.inf:
            try:
                frequencies = self.frequencies(pe_width, float(base))
            except OverflowError:
                raise ValueError(f"base={base!r}: preset {self.name!r}'s frequencies overflow float64") from None
        return dict(
            layout=self.layout,
            base=base,
            frequencies=frequencies,
            embed_scale=self.embed_scale(d_model),
            pe_scale=self.pe_scale(d_model),
            zero_pe_at_padding=self.position_rule in PADDING_AWARE_RULES,
            precision=self.precision,
        )


_REGISTRY: Dict[str, Preset] = {}


def _register(preset: Preset) -> None:
    assert preset.position_rule in POSITION_RULES
    _REGISTRY[preset.name] = preset


_register(Preset(
    "vaswani", "Annotated Transformer, PyTorch transformer tutorial, ESPnet, NeMo ASR, OpenNMT (default)",
    "Annotated Transformer PositionalEncoding; ESPnet PositionalEncoding (x * xscale + pe)",
    "interleaved", _vaswani, _sqrt_width, _one, odd_width=False,
))
_register(Preset(
    "tensor2tensor", "tensor2tensor, OpenNMT SinusoidalConcat",
    "tensor2tensor common_attention.get_timing_signal_1d (min_timescale 1, max_timescale 1e4)",
    "split", _log_spaced_endpoints, _sqrt_width, _one,
    notes="odd width: a zero last column (the library pads with one)",
))
_register(Preset(
    "fairseq", "fairseq, HF M2M100/NLLB, NLLB-MoE, Speech2Text, Kosmos-2",
    "fairseq SinusoidalPositionalEmbedding.get_embedding + utils.make_positions",
    "split", _log_spaced_endpoints, _sqrt_width, _one, position_rule="fairseq",
    notes="first real token at padding_idx + 1, counting only non-padding tokens; padding gets no PE; "
          "offset= is the past length when decoding; odd width: a zero last column; embed_scale=sqrt(d_model) "
          "is scale_embedding=True (pass embed_scale=1.0 for a model without it, e.g. M2M100 configs with "
          "scale_embedding=False)",
))
_register(Preset(
    "fsmt", "HF FSMT (fairseq WMT19 ports)",
    "transformers FSMT SinusoidalPositionalEmbedding.forward: make_positions(input) + past_key_values_length",
    "split", _log_spaced_endpoints, _sqrt_width, _one, position_rule="fsmt",
    notes="as fairseq, except that when decoding with a cache (past length > 0) a padding token gets "
          "position padding_idx + past and its PE (a finished row in generate()), where HF's fairseq ports "
          "keep it at padding_idx with no PE",
))
_register(Preset(
    "whisper", "OpenAI Whisper, HF Whisper (encoder)",
    "whisper.model.sinusoids(length, channels, max_timescale=10000)",
    "split", _log_spaced_endpoints, _one, _one, odd_width=False,
))
_register(Preset(
    "marian", "HF Marian, Pegasus",
    "MarianSinusoidalPositionalEmbedding / PegasusSinusoidalPositionalEmbedding._init_weight",
    "split", _per_column_pairs, _sqrt_width, _one, precision="float64",
    notes="ceil(D/2) sin columns then floor(D/2) cos; embed_scale=sqrt(d_model) is config.scale_embedding=True "
          "(the opus-mt checkpoints); pass embed_scale=1.0 for models without it; offset= is the past length",
))
_register(Preset(
    "xlm", "HF XLM, DistilBERT (sinusoidal_pos_embds=True)",
    "create_sinusoidal_embeddings(n_pos, dim, out)",
    "interleaved", _per_column_pairs, _one, _one, precision="float64",
    notes="odd width: the last column is a sin",
))
_register(Preset(
    "musicgen", "HF MusicGen (decoder)",
    "MusicgenSinusoidalPositionalEmbedding.get_embedding: cat([cos, sin])",
    "split_cos_first", _log_spaced_endpoints, _one, _one,
    notes="embed_scale=1 always: MusicgenDecoder computes embed_scale from config.scale_embedding but never "
          "applies it; the token vector is the sum of the codebook tables; offset= is the past length",
))
_register(Preset(
    "nemo_nlp", "NVIDIA NeMo NLP TransformerEmbedding",
    "nemo.collections.nlp.modules.common.transformer FixedPositionalEncoding (pe / sqrt(hidden))",
    "interleaved", _vaswani, _one, _inverse_sqrt_width, odd_width=False,
))

PRESETS = types.MappingProxyType(_REGISTRY)


def names() -> List[str]:
    return list(_REGISTRY)


def get(name: str) -> Preset:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(_REGISTRY)}") from None
