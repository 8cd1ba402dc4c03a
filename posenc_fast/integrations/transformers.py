"""``patch_model(model)``: a Hugging Face transformers model computes token embedding + sinusoidal PE
with posenc_fast's fused op, in place.

A *side* is the module that adds the PE (an encoder, a decoder, a text model, DistilBERT's
``Embeddings``).  Each family is one function that finds nothing on its own: given a side, it reads the
scale, padding row, position rule and table from the side's config and modules, checks that the model's
PE table is the preset's sinusoid, and returns a :class:`_SidePatch`.  ``_FAMILIES`` maps side classes to
these functions; a new family is one function and one row there.  Three ways a side is patched:

- token sides (M2M100/NLLB, NLLB-MoE, Marian, Pegasus, FSMT, Speech2Text decoder, XLM, MusicGen):
  the side's ``forward`` becomes a wrapper, bound to that instance, that computes the fused result and
  hands it to the model's own forward as ``inputs_embeds``; the model's position module then returns a
  0-d zero.  The model's ``inputs_embeds + positions`` remains as an add of that zero, and where the
  model multiplies ``inputs_embeds`` by ``embed_scale`` itself, the side's ``embed_scale`` is set to 1.0
  (the scale is in the fused op): one or two elementwise passes that ``torch.compile`` fuses away.
- sides with an embedding method of their own (Kosmos-2 ``forward_embedding``, DistilBERT
  ``Embeddings.forward``): that method is replaced, and nothing of the unfused sum remains.
- speech encoders (Whisper, Speech2Text): they add the PE to conv features in the middle of their
  forward, so the forward is replaced by the same steps with the fused add (``add_sinusoidal``).

Nothing is registered or replaced in the module tree: no Parameter, buffer or submodule is added, so
``state_dict``, ``save_pretrained``, weight tying and the optimizer's Parameters are unchanged, and the
token table is read from the side's own ``embed_tokens.weight`` at every call.  To undo, reload the model.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import presets, reference
from .._spec import PESpec
from .._validate import make_spec
from ..functional import apply_add_spec, apply_spec
from ..positions import make_positions

__all__ = ["patch_model", "supported_classes", "VERIFIED_TRANSFORMERS"]

# The transformers releases the patches were verified against: [first, end).  On 2026-11-25 the test
# file passed on 5.23.0 only: 4.57.6, 5.0.0 and 5.15.0 each failed some families (crashes and one
# different generation), 5.24.0 numbers cached steps wrong.  The families re-state
# steps of each model's forward, which transformers rewrites between releases (5.24 passes the KV
# cache as ``cache=``, and the patched decoders would number cached steps from 0).  Outside this range
# patch_model warns and leaves the model as it is: slower, never different numbers.  Raise ``end``
# only after tests/test_integrations_transformers.py passes on the new release (.ci/run tests both ends).
VERIFIED_TRANSFORMERS = ((5, 23), (5, 24))


def _release(version: str) -> Tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (2 - len(parts)))  # type: ignore[return-value]


def _installed_transformers_version() -> Optional[str]:
    try:
        import transformers
    except ImportError:
        return None
    return str(getattr(transformers, "__version__", "0"))


def _unverified_transformers() -> Optional[str]:
    """Why the installed transformers is outside VERIFIED_TRANSFORMERS, or None."""
    version = _installed_transformers_version()
    if version is None:
        return None  # a model built without transformers' package: nothing to compare against
    first, end = VERIFIED_TRANSFORMERS
    if first <= _release(version) < end:
        return None
    return (f"transformers {version} is outside the releases posenc_fast.patch_model was verified "
            f"against (>= {first[0]}.{first[1]}, < {end[0]}.{end[1]}); the model is left unpatched "
            f"(same outputs, unfused). Install a release in that range to use the fused layer.")


@dataclasses.dataclass(frozen=True)
class _State:
    """What a patched side needs at call time (kept on the side as ``_posenc_fast``; not a module)."""

    family: str
    lookup: Optional[PESpec]  # token table + PE (embed scale, padding row, zero PE at padding)
    add: PESpec  # PE added to a float tensor; its embed_scale is the scale of that tensor
    position_rule: str = "offset"
    padding_idx: Optional[int] = None
    embeds_offset: Optional[int] = 0  # user inputs_embeds: first position (plus the past); None: unsupported


@dataclasses.dataclass
class _SidePatch:
    side: nn.Module
    state: _State
    methods: Dict[str, Callable]
    zero_positions: Tuple[nn.Module, ...] = ()
    attributes: Dict[str, object] = dataclasses.field(default_factory=dict)

    def apply(self) -> None:
        self.side._posenc_fast = self.state
        for name, function in self.methods.items():
            # A partial of a module-level function and the instance: deepcopy binds it to the copy,
            # pickle (torch.save of the whole model) stores the function by name.
            setattr(self.side, name, functools.partial(function, self.side))
        for module in self.zero_positions:
            module.forward = functools.partial(_zero_positions, module)
        for name, value in self.attributes.items():
            setattr(self.side, name, value)


# ----------------------------------------------------------------------------------------------- helpers

def _spec_kwargs(preset: str, width: int) -> dict:
    return presets.get(preset).kwargs(width)


def _lookup_spec(preset: str, weight: torch.Tensor, embed_scale: float, padding_idx: Optional[int],
                 zero_pe_at_padding: bool) -> PESpec:
    kw = _spec_kwargs(preset, weight.shape[1])
    return make_spec(weight.shape[0], weight.shape[1], "add", None, 10000.0, kw["layout"], float(embed_scale), 1.0,
                     padding_idx, kw["frequencies"], zero_pe_at_padding, kw["precision"])


def _add_spec(preset: str, width: int, x_scale: float) -> PESpec:
    kw = _spec_kwargs(preset, width)
    return make_spec(1, width, "add", None, 10000.0, kw["layout"], float(x_scale), 1.0, None, kw["frequencies"],
                     False, kw["precision"])


def _check_table(where: str, table: torch.Tensor, preset: str, zero_row: Optional[int] = None) -> None:
    """Refuse to patch a side whose PE table is not the preset's sinusoid (trained, replaced, or another rule):
    the patch would change the model's outputs."""
    if table.is_meta:
        return
    rows, width = table.shape
    kw = _spec_kwargs(preset, width)
    expected = reference.sinusoidal_table(rows, width, layout=kw["layout"], frequencies=kw["frequencies"])
    if zero_row is not None:
        expected[zero_row] = 0.0
    difference = float((table.detach().to("cpu", torch.float64) - expected).abs().max()) if rows else 0.0
    # fp32 tables whose angle is formed in fp32 are off by up to ~4e-4 at a few thousand positions.
    tolerance = 1e-3 + 4 * torch.finfo(table.dtype).eps
    if not difference <= tolerance:
        raise ValueError(f"{where} is not the {preset!r} sinusoid (max difference {difference:.3g} > {tolerance:.3g}): "
                         "it was trained or replaced, and the fused PE would change the model; not patched")


def _table_of(module: nn.Module) -> torch.Tensor:
    table = getattr(module, "weights", None)
    return table if isinstance(table, torch.Tensor) else module.weight


def _zero_positions(self, *args, **kwargs) -> torch.Tensor:
    """A patched side's position module: the fused op has added the PE already.  A 0-d zero, so the
    model's ``inputs_embeds + positions`` keeps the shape and dtype of ``inputs_embeds``."""
    table = _table_of(self)
    return torch.zeros((), dtype=table.dtype, device=table.device)


def _past_length(cache) -> int:
    return cache.get_seq_length() if cache is not None else 0


_SIGNATURES: Dict[type, inspect.Signature] = {}


def _bind(side: nn.Module, args, kwargs) -> inspect.BoundArguments:
    cls = type(side)
    signature = _SIGNATURES.get(cls)
    if signature is None:
        signature = _SIGNATURES[cls] = inspect.signature(cls.forward)
    return signature.bind(side, *args, **kwargs)


def _call_model_forward(side: nn.Module, bound: inspect.BoundArguments):
    """The class's own forward, every argument by keyword (its decorators fill some by keyword)."""
    kwargs = {}
    for name, value in list(bound.arguments.items())[1:]:
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update(value)
        else:
            kwargs[name] = value
    return type(side).forward(side, **kwargs)


def _lookup(state: _State, weight: torch.Tensor, ids: torch.Tensor, positions=None, offset=0) -> torch.Tensor:
    rule = state.position_rule if positions is None else "offset"
    return apply_spec(ids, weight, state.lookup, state.lookup.turns_tensor(weight.device), positions, offset, "auto",
                      position_rule=rule)


def _add(state: _State, x: torch.Tensor, positions=None, offset=0) -> torch.Tensor:
    return apply_add_spec(x, state.add, state.add.turns_tensor(x.device), positions, offset, None, "auto")


def _hf_module(side: nn.Module):
    """The modeling module of the side's class (its decorators and output classes)."""
    return sys.modules[type(side).__module__]


# ------------------------------------------------------------------------------------------- token sides

def _token_side_forward(self, *args, **kwargs):
    """Patched forward of a token side: the fused result goes in as ``inputs_embeds``."""
    state: _State = self._posenc_fast
    bound = _bind(self, args, kwargs)
    arguments = bound.arguments
    ids, embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    past = _past_length(arguments.get("past_key_values"))
    if embeds is None and ids is not None:
        arguments["inputs_embeds"] = _lookup(state, self.embed_tokens.weight, ids, offset=past)
        arguments["input_ids"] = None
    elif embeds is not None:
        if state.embeds_offset is None:
            raise ValueError(f"posenc_fast-patched {type(self).__name__} takes input_ids, not inputs_embeds "
                             "(the model's own inputs_embeds path cannot number positions either)")
        arguments["inputs_embeds"] = _add(state, embeds, offset=state.embeds_offset + past)
    return _call_model_forward(self, bound)


def _gradient_padding(embedding: nn.Module, position_padding: Optional[int]) -> Optional[int]:
    """The padding row of the table: the one the model's nn.Embedding gives no gradient.  The fused op has one
    padding row for both the gradient and (fairseq rules) the zero PE, so they must agree."""
    padding = getattr(embedding, "padding_idx", None)
    if position_padding is not None and padding != position_padding:
        raise ValueError(f"{type(embedding).__name__}.padding_idx={padding} differs from the position module's "
                         f"padding_idx={position_padding}; the fused layer has one padding row")
    return padding


def _token_side(side, family, preset, *, embed_scale, padding_idx, position_rule, positions_module,
                zero_row=None, model_scales_embeds=False, embeds_offset=0) -> _SidePatch:
    weight = side.embed_tokens.weight
    padding_idx = _gradient_padding(side.embed_tokens, padding_idx)
    _check_table(f"{type(side).__name__}.embed_positions", _table_of(positions_module), preset, zero_row)
    state = _State(
        family, _lookup_spec(preset, weight, embed_scale, padding_idx, position_rule != "offset"),
        _add_spec(preset, weight.shape[1], embed_scale if model_scales_embeds else 1.0),
        position_rule, padding_idx, embeds_offset,
    )
    attributes = {"embed_scale": 1.0} if model_scales_embeds else {}
    return _SidePatch(side, state, {"forward": _token_side_forward}, (positions_module,), attributes)


def _m2m100(side) -> _SidePatch:
    """M2M100 / NLLB (and NLLB-MoE): scale inside ``M2M100ScaledWordEmbedding``, fairseq positions from
    padding_idx + 1; user inputs_embeds are numbered from padding_idx + 1 without looking at padding."""
    pad = side.embed_positions.padding_idx
    return _token_side(side, "m2m_100", "fairseq", embed_scale=getattr(side.embed_tokens, "embed_scale", 1.0),
                       padding_idx=pad, position_rule="fairseq", positions_module=side.embed_positions,
                       zero_row=pad, embeds_offset=pad + 1)


def _marian(side) -> _SidePatch:
    """Marian / Pegasus: past + t; the decoders scale inputs_embeds themselves, the encoders only ids."""
    decoder = "Decoder" in type(side).__name__
    return _token_side(side, "marian", "marian", embed_scale=side.embed_scale, padding_idx=None,
                       position_rule="offset", positions_module=side.embed_positions, model_scales_embeds=decoder)


def _fsmt(side) -> _SidePatch:
    """FSMT: fairseq positions; when decoding, padding moves with the past length (the "fsmt" rule)."""
    pad = side.embed_positions.padding_idx
    decoder = "Decoder" in type(side).__name__
    return _token_side(side, "fsmt", "fsmt", embed_scale=side.embed_scale, padding_idx=pad,
                       position_rule="fsmt" if decoder else "fairseq", positions_module=side.embed_positions,
                       zero_row=pad, model_scales_embeds=True, embeds_offset=None)


def _speech2text_decoder(side) -> _SidePatch:
    pad = side.embed_positions.padding_idx
    return _token_side(side, "speech_to_text", "fairseq", embed_scale=side.embed_scale, padding_idx=pad,
                       position_rule="fairseq", positions_module=side.embed_positions, zero_row=pad,
                       embeds_offset=None)


# ----------------------------------------------------------------------------------------------- XLM

def _xlm_forward(self, *args, **kwargs):
    """XLM slices the cached part off input_ids itself and numbers from ``position_ids``: do the same."""
    state: _State = self._posenc_fast
    bound = _bind(self, args, kwargs)
    arguments = bound.arguments
    ids, embeds, positions = arguments.get("input_ids"), arguments.get("inputs_embeds"), arguments.get("position_ids")
    cache = arguments.get("cache")
    if embeds is None and ids is not None:
        seq_len = ids.shape[1]
        new = seq_len - _past_length(cache)
        ids = ids[:, -new:]  # as XLM slices (all of them when nothing is new)
        positions = positions[:, -new:] if positions is not None else None
        offset = seq_len - ids.shape[1] if positions is None else 0
        arguments["inputs_embeds"] = _lookup(state, self.embeddings.weight, ids, positions, offset)
    elif embeds is not None:
        arguments["inputs_embeds"] = _add(state, embeds, positions)
    return _call_model_forward(self, bound)


def _xlm(side) -> _SidePatch:
    if not side.config.sinusoidal_embeddings:
        raise ValueError(f"{type(side).__name__} has learned position embeddings (config.sinusoidal_embeddings=False)")
    width = side.embeddings.weight.shape[1]
    _check_table(f"{type(side).__name__}.position_embeddings", side.position_embeddings.weight, "xlm")
    padding = _gradient_padding(side.embeddings, None)
    state = _State("xlm", _lookup_spec("xlm", side.embeddings.weight, 1.0, padding, False),
                   _add_spec("xlm", width, 1.0))
    return _SidePatch(side, state, {"forward": _xlm_forward}, (side.position_embeddings,))


# ----------------------------------------------------------------------------------------- DistilBERT

def _distilbert_embeddings_forward(self, input_ids, inputs_embeds=None, position_ids=None):
    state: _State = self._posenc_fast
    if input_ids is not None:
        embeddings = _lookup(state, self.word_embeddings.weight, input_ids, position_ids)
    else:
        embeddings = _add(state, inputs_embeds, position_ids)
    return self.dropout(self.LayerNorm(embeddings))


def _distilbert(model) -> _SidePatch:
    """DistilBERT with ``sinusoidal_pos_embds``: its ``Embeddings`` module is the side."""
    if not model.config.sinusoidal_pos_embds:
        raise ValueError(f"{type(model).__name__} has learned position embeddings (config.sinusoidal_pos_embds=False)")
    side = model.embeddings
    _check_table("DistilBERT embeddings.position_embeddings", side.position_embeddings.weight, "xlm")
    weight = side.word_embeddings.weight
    padding = _gradient_padding(side.word_embeddings, None)
    state = _State("distilbert", _lookup_spec("xlm", weight, 1.0, padding, False),
                   _add_spec("xlm", weight.shape[1], 1.0))
    return _SidePatch(side, state, {"forward": _distilbert_embeddings_forward})


# ------------------------------------------------------------------------------------------- Kosmos-2

def _kosmos2_forward_embedding(self, input_ids, inputs_embeds=None, image_embeds=None, img_input_mask=None,
                               past_key_values_length=0, position_ids=None):
    """Kosmos-2's text embedding: fused lookup; with image vectors substituted into token rows, or with
    inputs_embeds, the lookup and substitution stay as they are and the scale + PE are one fused add."""
    state: _State = self._posenc_fast
    pad = state.padding_idx
    if inputs_embeds is None and image_embeds is None:
        hidden = _lookup(state, self.embed_tokens.weight, input_ids, position_ids,
                         past_key_values_length if position_ids is None else 0)
    else:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if image_embeds is not None:
            inputs_embeds[img_input_mask.to(dtype=torch.bool)] = image_embeds.to(
                inputs_embeds.device, inputs_embeds.dtype).view(-1, image_embeds.size(-1))
        if position_ids is None and input_ids is not None:
            positions = make_positions(input_ids, pad, past_key_values_length)
            hidden = _add(state, inputs_embeds, positions)
            # Padding rows get no PE (the model's table has a zero row there): the one unfused step.
            hidden = torch.where((input_ids == pad).unsqueeze(-1), inputs_embeds * state.add.embed_scale, hidden)
        elif position_ids is None:
            hidden = _add(state, inputs_embeds, offset=pad + 1 + past_key_values_length)
        else:
            hidden = _add(state, inputs_embeds, position_ids)
    return nn.functional.dropout(hidden, p=self.dropout, training=self.training)


def _kosmos2(side) -> _SidePatch:
    pad = _gradient_padding(side.embed_tokens, side.embed_positions.padding_idx)
    weight = side.embed_tokens.weight
    _check_table("Kosmos2TextTransformer.embed_positions", side.embed_positions.weights, "fairseq", pad)
    state = _State("kosmos-2", _lookup_spec("fairseq", weight, side.embed_scale, pad, True),
                   _add_spec("fairseq", weight.shape[1], side.embed_scale), "fairseq", pad)
    return _SidePatch(side, state, {"forward_embedding": _kosmos2_forward_embedding})


# ------------------------------------------------------------------------------------------- MusicGen

def _musicgen_forward(self, *args, **kwargs):
    """MusicGen sums K codebook tables (K ids per position): that sum stays unfused (K lookups and
    adds, as in the model), and the PE is added to it by the fused add; the embed scale is never applied
    (the model computes ``embed_scale`` but does not use it)."""
    state: _State = self._posenc_fast
    bound = _bind(self, args, kwargs)
    arguments = bound.arguments
    ids, embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    past = _past_length(arguments.get("past_key_values"))
    if embeds is None and ids is not None:
        codes = ids.reshape(-1, self.num_codebooks, ids.shape[-1])
        summed = sum(self.embed_tokens[k](codes[:, k]) for k in range(self.num_codebooks))
        arguments["inputs_embeds"] = _add(state, summed, offset=past)
        arguments["input_ids"] = None
    elif embeds is not None:
        # The model numbers user inputs_embeds as one position, ``past`` (it passes inputs_embeds[:, :, -1:]).
        positions = torch.full((1,), past, dtype=torch.int64, device=embeds.device)
        arguments["inputs_embeds"] = _add(state, embeds, positions)
    return _call_model_forward(self, bound)


def _musicgen(side) -> _SidePatch:
    width = side.embed_tokens[0].weight.shape[1]
    _check_table(f"{type(side).__name__}.embed_positions", side.embed_positions.weights, "musicgen")
    state = _State("musicgen", None, _add_spec("musicgen", width, 1.0))
    return _SidePatch(side, state, {"forward": _musicgen_forward}, (side.embed_positions,))


# ---------------------------------------------------------------------------------------- speech encoders

def _encoder_layers(self, hidden_states, attention_mask, kwargs):
    for encoder_layer in self.layers:
        # LayerDrop (https://huggingface.co/papers/1909.11556), as the model does it
        if self.training and self.layerdrop > 0.0 and torch.rand([]) < self.layerdrop:
            continue
        hidden_states = encoder_layer(hidden_states, attention_mask, **kwargs)
    return self.layer_norm(hidden_states)


def _whisper_encoder_forward(self, input_features, attention_mask=None, **kwargs):
    """WhisperEncoder.forward with the PE added to the conv features by the fused add."""
    expected = self.config.max_source_positions * self.conv1.stride[0] * self.conv2.stride[0]
    if input_features.shape[-1] != expected:
        raise ValueError(f"Whisper expects the mel input features to be of length {expected}, but found "
                         f"{input_features.shape[-1]}. Make sure to pad the input mel features to {expected}.")
    features = nn.functional.gelu(self.conv1(input_features))
    features = nn.functional.gelu(self.conv2(features)).permute(0, 2, 1)
    hidden_states = _add(self._posenc_fast, features)
    hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
    hidden_states = _encoder_layers(self, hidden_states, None, kwargs)
    return _hf_module(self).BaseModelOutput(last_hidden_state=hidden_states)


def _speech2text_encoder_forward(self, input_features, attention_mask=None, **kwargs):
    """Speech2TextEncoder.forward with scale + PE on the conv features in one fused add."""
    state: _State = self._posenc_fast
    features = self.conv(input_features)
    pad = state.padding_idx
    if attention_mask is not None:
        attention_mask = self._get_feature_vector_attention_mask(features.shape[1], attention_mask)
        padding_mask = attention_mask.ne(1).long()
    else:
        padding_mask = torch.zeros(features.shape[:2], dtype=torch.long, device=features.device)
    # The model numbers frames with fairseq's rule applied to the padding mask as if it were ids.
    hidden_states = _add(state, features, make_positions(padding_mask, pad))
    if attention_mask is not None or pad == 0:
        # Frames at the padding position get no PE (a zero row of the model's table): the unfused step.
        hidden_states = torch.where((padding_mask == pad).unsqueeze(-1), state.add.embed_scale * features,
                                    hidden_states)
    hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
    module = _hf_module(self)
    attention_mask = module.create_bidirectional_mask(config=self.config, inputs_embeds=hidden_states,
                                                      attention_mask=attention_mask)
    hidden_states = _encoder_layers(self, hidden_states, attention_mask, kwargs)
    return module.BaseModelOutput(last_hidden_state=hidden_states)


def _decorated(side, function):
    """``function`` with the decorators of the model's own forward (output capture, config defaults)."""
    module = _hf_module(side)
    for name in ("capture_outputs", "merge_with_config_defaults"):
        decorator = getattr(module, name, None)
        if decorator is not None:
            function = decorator(function)
    return function


def _whisper_encoder(side) -> _SidePatch:
    width = side.embed_positions.weight.shape[1]
    _check_table("WhisperEncoder.embed_positions", side.embed_positions.weight, "whisper")
    state = _State("whisper", None, _add_spec("whisper", width, 1.0))
    return _SidePatch(side, state, {"forward": _decorated(side, _whisper_encoder_forward)})


def _speech2text_encoder(side) -> _SidePatch:
    pad = side.embed_positions.padding_idx
    width = side.embed_positions.weights.shape[1]
    _check_table("Speech2TextEncoder.embed_positions", side.embed_positions.weights, "fairseq", pad)
    state = _State("speech_to_text", None, _add_spec("fairseq", width, side.embed_scale), padding_idx=pad)
    return _SidePatch(side, state, {"forward": _decorated(side, _speech2text_encoder_forward)})


# ------------------------------------------------------------------------------------------- registry

# Side class name -> family function.  Matched by name and module ("transformers.models.<family>."), so
# transformers is never imported here and every head (base, LM head, generation) is covered by its sides.
_FAMILIES: Dict[Tuple[str, str], Callable[[nn.Module], _SidePatch]] = {
    ("m2m_100", "M2M100Encoder"): _m2m100,
    ("m2m_100", "M2M100Decoder"): _m2m100,
    ("nllb_moe", "NllbMoeEncoder"): _m2m100,
    ("nllb_moe", "NllbMoeDecoder"): _m2m100,
    ("marian", "MarianEncoder"): _marian,
    ("marian", "MarianDecoder"): _marian,
    ("pegasus", "PegasusEncoder"): _marian,
    ("pegasus", "PegasusDecoder"): _marian,
    ("fsmt", "FSMTEncoder"): _fsmt,
    ("fsmt", "FSMTDecoder"): _fsmt,
    ("speech_to_text", "Speech2TextEncoder"): _speech2text_encoder,
    ("speech_to_text", "Speech2TextDecoder"): _speech2text_decoder,
    ("xlm", "XLMModel"): _xlm,
    ("distilbert", "DistilBertModel"): _distilbert,
    ("kosmos2", "Kosmos2TextTransformer"): _kosmos2,
    ("musicgen", "MusicgenDecoder"): _musicgen,
    ("whisper", "WhisperEncoder"): _whisper_encoder,
}


def supported_classes() -> List[str]:
    """The side classes ``patch_model`` patches (any model that contains one is supported)."""
    return [name for _, name in _FAMILIES]


def _family_of(module: nn.Module):
    parts = type(module).__module__.split(".")
    if len(parts) < 3 or parts[0] != "transformers" or parts[1] != "models":
        return None
    return _FAMILIES.get((parts[2], type(module).__name__))


def patch_model(model: nn.Module) -> nn.Module:
    """Make a transformers model add its sinusoidal PE with posenc_fast's fused op, in place; returns ``model``.

    Covers M2M100/NLLB, NLLB-MoE, Marian, Pegasus, FSMT, Speech2Text, XLM and DistilBERT (sinusoidal
    position embeddings), Kosmos-2, MusicGen and Whisper (encoder; its decoder's PE is learned), with
    every head: each encoder/decoder in the model that adds a sinusoidal PE is patched.  Scale, padding
    row and position rule come from the model's config and modules.  Every side is checked first (its
    PE table must be the sinusoid), so an unsupported model raises ``TypeError`` naming its class, a
    side that cannot be patched raises ``ValueError``, and in both cases nothing is changed.  A side
    patched already is left as it is.  Parameters, buffers, tying and ``state_dict`` are untouched; see
    the module docstring for what changes, and README "Use it in a Hugging Face model".

    FSMT, XLM and DistilBERT keep their sinusoidal table as a trainable Parameter; once patched it is
    not read, so it gets no gradient (``.grad`` stays None, optimizers skip it) and the PE stays the
    exact sinusoid.  MusicGen's sum of its K codebook lookups stays unfused (the PE add is fused).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_model takes a transformers model (an nn.Module), got {type(model).__name__}")
    unverified = _unverified_transformers()
    if unverified is not None:
        warnings.warn(unverified, RuntimeWarning, stacklevel=2)
        return model
    patches, found = [], False
    for module in model.modules():
        family = _family_of(module)
        if family is None:
            continue
        found = True
        patch = family(module)
        if getattr(patch.side, "_posenc_fast", None) is None:  # patching twice changes nothing
            patches.append(patch)
    if not found:
        raise TypeError(f"posenc_fast.patch_model does not support {type(model).__name__}: it contains none of "
                        f"the modules it patches ({', '.join(sorted(set(supported_classes())))})")
    for patch in patches:
        patch.apply()
    return model
