"""``patch_model(model)``: a Hugging Face transformers model computes its sinusoidal PE with posenc_fast, in
place, exactly and without reading its position tables.  User-facing behaviour: docs/presets.md, "Hugging Face
models: patch_model".

Each patched *position module* (``embed_positions``, ``position_embeddings``) gets, on that instance, a
``forward`` that computes its rows from the same arguments; the rest of the model stays its own code.  Each
family is a function that, given the module owning it (a *side*), returns a :class:`_PositionPatch`: the
module, its preset and its *kind*, the rule by which its arguments say which positions (``_KIND_ROLES``,
:func:`_positions`).  Since the patch restates that rule, :func:`_verify` first checks it against the
installed code, needing no table values (so ``meta`` models are patched); a module that fails is left
unpatched with a warning.  A table made trainable again is read by the module's own forward
(:func:`_forward_reading_the_table`), so it trains as unpatched.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
import sys
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import presets, reference
from .._dispatch import eager_call
from .._prepared import functional_embedding
from .._spec import PESpec
from .._validate import make_spec
from ..functional import apply_spec
from ..positions import make_positions

__all__ = ["patch_model", "supported_classes", "SUPPORTED_TRANSFORMERS"]

# The releases [first, end) tests/test_integrations_transformers.py passes on; outside them patch_model
# warns and leaves the model unpatched.
SUPPORTED_TRANSFORMERS = ((4, 57), (5, 25))

# Argument names of the position modules' forwards (across the supported releases), by what they say.
# A name not listed means the installed code is not what the patch knows: the module is left unpatched.
_ROLES = {
    "input_ids": "ids", "input": "ids", "inputs_embeds": "embeds", "input_embeds": "embeds", "input_ids_shape": "shape",
    "past_key_values_length": "past", "cache_length": "past", "position_ids": "positions",
    # FSMT's older releases: fairseq's incremental-decoding arguments, which its forward ignores
    "incremental_state": "ignored", "timestep": "ignored",
}
# The roles each kind's forward may take.
_KIND_ROLES = {
    "fairseq": {"ids", "embeds", "past", "positions"},
    "fsmt": {"ids", "past", "ignored"},  # fairseq's rule, except that the past length moves padding too
    "offset": {"ids", "shape", "past", "positions"},
    "offset_batched": {"embeds", "past", "positions"},
    "positions": {"positions", "past"},  # a past length, where taken, only sizes the model's table
}


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


def _callers_stacklevel(*, past_torch: bool = False) -> int:
    """``stacklevel`` naming the first caller outside this package; with ``past_torch``, outside torch too,
    so that a warning from a module's forward names the model code that called it."""
    packages = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    if past_torch:
        packages.append(os.path.dirname(os.path.abspath(torch.__file__)))
    prefixes = tuple(package + os.sep for package in packages)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(prefixes):
        frame, level = frame.f_back, level + 1
    return level


def _unsupported_transformers() -> Optional[str]:
    """Why the installed transformers is outside SUPPORTED_TRANSFORMERS, or None."""
    version = _installed_transformers_version()
    if version is None:
        return None  # a model built without transformers' package: the probes still check every module
    first, end = SUPPORTED_TRANSFORMERS
    if first <= _release(version) < end:
        return None
    return (f"transformers {version} is outside the releases posenc_fast.patch_model is tested on "
            f"(>= {first[0]}.{first[1]}, < {end[0]}.{end[1]}); the model is left unpatched "
            f"(same outputs, PE from its own tables).")


# ------------------------------------------------------------------------------------- the patched forward

@dataclasses.dataclass(frozen=True)
class _Argument:
    role: str
    index: int  # position in forward(self, ...), self excluded; -1 for keyword-only
    name: str
    default: object


@dataclasses.dataclass(frozen=True)
class _State:
    """What a patched position module needs at call time (kept on it as ``_posenc_fast``; not a module)."""

    kind: str
    spec: PESpec  # for the two-row zero table of _position_forward
    width: int
    zero_position: Optional[int]  # the position whose row the model's table holds as zeros (padding_idx)
    arguments: Tuple[_Argument, ...]
    shift: int = 0  # "positions" kind: the module reads its table at the given positions + shift (XGLM: 2)
    table_name: str = ""  # the table's name in the patched model (state_dict key), for messages
    # False where the table is known not to be the sinusoid (a load broke it, or ignore_table_values=True):
    # a call that would read it raises instead.
    table_readable: bool = True


def _argument(state: _State, role: str, args, kwargs):
    for argument in state.arguments:
        if argument.role == role:
            if 0 <= argument.index < len(args):
                return args[argument.index]
            return kwargs.get(argument.name, argument.default)
    return None


def _table_of(module: nn.Module) -> Optional[torch.Tensor]:
    """The module's PE table (None for PegasusX, which has none)."""
    for name in ("weights", "weight"):
        table = getattr(module, name, None)
        if isinstance(table, torch.Tensor):
            return table
    return None


def _fairseq_positions(source: torch.Tensor, padding_idx: int, past, shift_padding: bool) -> torch.Tensor:
    if source.dtype not in (torch.int32, torch.int64):
        # FSMT's inputs_embeds path passes float "ids" (an embedding column with zeros set to padding_idx):
        # only which entries equal padding_idx matters.
        source = torch.where(source.ne(padding_idx), padding_idx + 1, padding_idx).to(torch.int64)
    return make_positions(source, padding_idx, past_length=past, shift_padding=shift_padding)


def _positions(state: _State, module: nn.Module, args, kwargs) -> torch.Tensor:
    """The integer positions the unpatched module would read its table at (same shape as its index)."""
    given = _argument(state, "positions", args, kwargs)
    ids = _argument(state, "ids", args, kwargs)
    past = _argument(state, "past", args, kwargs)
    if past is None:
        past = 0
    if state.kind == "positions":
        return given + state.shift if state.shift else given
    if state.kind in ("fairseq", "fsmt"):
        if given is not None:
            return given
        if ids is not None:
            return _fairseq_positions(ids, state.zero_position, past, shift_padding=state.kind == "fsmt")
        embeds = _argument(state, "embeds", args, kwargs)
        start = state.zero_position + 1
        steps = torch.arange(start, start + embeds.shape[1], dtype=torch.int64, device=embeds.device)
        return steps.unsqueeze(0).expand(embeds.shape[:2]) + past
    if state.kind == "offset_batched":  # positions of shape (length, 1) where given, as PegasusX's decoder passes
        if given is not None:
            return given.squeeze(-1)
        embeds = _argument(state, "embeds", args, kwargs)
        return torch.arange(embeds.shape[1], dtype=torch.int64, device=embeds.device) + past
    # "offset": past + t, t along the sequence (the last axis of ids; axis 1 of a (batch, length) shape)
    if given is not None:
        return given
    if ids is not None:
        length, device = ids.shape[-1], ids.device
    else:
        length, device = _argument(state, "shape", args, kwargs)[1], _table_of(module).device
    return torch.arange(length, dtype=torch.int64, device=device) + past


# Set on a patched position module once its table was called requiring grad: from then on the module reads
# its table, which training may have changed, even if it is frozen again.
_READS_TABLE = "_posenc_fast_reads_table"


def _forward_reading_the_table(self, state: _State, args, kwargs) -> torch.Tensor:
    """The module's own forward: its table requires grad (or did), so it is trained as unpatched."""
    if not getattr(self, _READS_TABLE, False):
        if not state.table_readable:
            raise RuntimeError(
                f"{state.table_name or type(self).__name__} requires grad, but posenc_fast.patch_model found it "
                "is not the sinusoid (or was given ignore_table_values=True), so its patched module computes the PE "
                "instead of reading it; reading it now would change the model's PE. Freeze it again "
                "(requires_grad_(False)) to train everything else with the exact PE, or load a model whose table "
                "is right and patch that.")
        setattr(self, _READS_TABLE, True)
        if not torch.compiler.is_compiling():  # (a warning inside a graph would break fullgraph=True)
            warnings.warn(
                f"posenc_fast: {state.table_name or type(self).__name__} requires grad, so its patched position "
                "module reads it, as the unpatched model does (same outputs, gradients and training), and keeps "
                "reading it from now on. patch_model had frozen it; leave it frozen to have the PE computed instead.",
                UserWarning, stacklevel=_callers_stacklevel(past_torch=True))
    return type(self).forward(self, *args, **kwargs)


def _position_forward(self, *args, **kwargs) -> torch.Tensor:
    """A patched position module: the PE rows at the positions its arguments give, computed, not read; or,
    where its table requires grad (or did), its own forward, which reads the table."""
    state: _State = self._posenc_fast
    table = _table_of(self)
    if table is not None and (table.requires_grad or getattr(self, _READS_TABLE, False)):
        return _forward_reading_the_table(self, state, args, kwargs)
    positions = _positions(state, self, args, kwargs)
    dtype = table.dtype if table is not None else _argument(state, "embeds", args, kwargs).dtype
    # Row 0 of a zero table for every token, row 1 (the padding row: no PE) where the model's table has
    # its zero row; the kernel then writes the PE alone, in the table's dtype, on the positions' device.
    zero_table = torch.zeros((2, state.width), dtype=dtype, device=positions.device)
    if state.zero_position is None:
        rows = torch.zeros(positions.shape, dtype=torch.int64, device=positions.device)
    else:
        rows = positions.eq(state.zero_position).to(torch.int64)
    pe = None
    if eager_call(rows, zero_table):  # (a decoding step: the launch kept for the spec, as sinusoidal_embedding's)
        pe = functional_embedding(state.spec, "auto", 0.0, False, False, zero_table, rows, 0, positions.contiguous())
    if pe is None:
        # Under torch.export the rows are the float64 definition in standard ops, so an exported patched model
        # runs without posenc_fast.
        pe = apply_spec(rows, zero_table, state.spec, state.spec.turns_tensor(positions.device), positions, 0, "auto",
                        standard_ops_under_export=True)
    if state.kind == "offset_batched":  # PegasusX's decoder repeats the rows per sequence
        pe = pe.unsqueeze(0).expand(_argument(state, "embeds", args, kwargs).shape[0], -1, -1)
    return pe


# --------------------------------------------------------------------------------------- patch time

@dataclasses.dataclass
class _PositionPatch:
    side: nn.Module
    module: nn.Module  # the position module
    preset: str
    kind: str
    zero_position: Optional[int] = None
    shift: int = 0


class _Unverified(Exception):
    """The installed code of a position module is not what the patch knows (its message says how)."""


def _arguments(patch: _PositionPatch) -> Tuple[_Argument, ...]:
    signature = inspect.signature(type(patch.module).forward)
    allowed = _KIND_ROLES[patch.kind]
    arguments = []
    for index, parameter in enumerate(list(signature.parameters.values())[1:]):
        role = _ROLES.get(parameter.name)
        if patch.kind == "positions" and parameter.name == "input":
            role = "positions"
        if role is None or role not in allowed:
            raise _Unverified(f"its forward takes {parameter.name!r}, which the {patch.kind!r} rule does not know")
        keyword_only = parameter.kind is inspect.Parameter.KEYWORD_ONLY
        default = None if parameter.default is inspect.Parameter.empty else parameter.default
        arguments.append(_Argument(role, -1 if keyword_only else index, parameter.name, default))
    return tuple(arguments)


def _spec(patch: _PositionPatch, width: int) -> PESpec:
    kw = presets.get(patch.preset).kwargs(width)
    return make_spec(2, width, "add", None, 10000.0, kw["layout"], 1.0, 1.0, 1, kw["frequencies"], True,
                     kw["precision"])


_CPU = torch.device("cpu")


def _exact_table(patch: _PositionPatch, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The exact table, on CPU (whatever the default device: a model may be patched under ``meta``)."""
    kw = presets.get(patch.preset).kwargs(width)
    positions = torch.arange(rows, dtype=torch.int64, device=_CPU)
    with _CPU:  # the reference makes its constants on the default device
        table = reference.sinusoidal_table(positions, width, layout=kw["layout"], frequencies=kw["frequencies"])
    if patch.zero_position is not None and patch.zero_position < rows:
        table[patch.zero_position] = 0.0
    return table.to(dtype)


def _probe_calls(patch: _PositionPatch, arguments: Tuple[_Argument, ...], width: int):
    """(args, kwargs) for every argument form the signature allows, with and without a past length: CPU
    tensors whatever the default device, drawn from their own generator, never the global one."""
    roles = {argument.role: argument for argument in arguments}
    pad = patch.zero_position if patch.zero_position is not None else 0
    ids = torch.tensor([[pad, pad, pad + 3, pad + 4, pad + 2], [pad + 5, pad + 1, pad + 2, pad, pad]], device=_CPU)
    generator = torch.Generator(device=_CPU).manual_seed(0)

    def embeds():
        return torch.randn(2, 5, width, generator=generator, device=_CPU)

    pasts = [0, 3] if "past" in roles else [0]
    forms = []
    if "ids" in roles:
        if type(patch.side).__name__ == "MusicgenDecoder":
            forms.append({"ids": ids.unsqueeze(1).expand(2, 2, 5)})  # (batch, codebooks, length)
        else:
            forms.append({"ids": ids})
        if patch.kind == "fsmt":
            forms.append({"ids": ids.to(torch.float32)})  # its inputs_embeds path passes floats
    if "embeds" in roles:
        forms.append({"ids": None, "embeds": embeds()} if "ids" in roles else {"embeds": embeds()})
    if "shape" in roles:
        forms.append({"shape": torch.Size([2, 5])})
    if "positions" in roles and patch.kind == "offset_batched":  # (length, 1), as PegasusX's decoder passes
        forms.append({"positions": torch.arange(5, device=_CPU).unsqueeze(1) + 2, "embeds": embeds()})
    elif "positions" in roles:
        forms.append({"positions": ids + 2})
        if "shape" in roles:
            forms[-1]["shape"] = torch.Size([2, 5])
        if "embeds" in roles:
            forms[-1]["embeds"] = embeds()
    for form in forms:
        for past in pasts:
            values = dict(form, past=past) if "past" in roles else form
            args, kwargs = [], {}
            for argument in arguments:
                if argument.role not in values:
                    continue
                if argument.index == len(args):
                    args.append(values[argument.role])
                else:
                    kwargs[argument.name] = values[argument.role]
            yield tuple(args), kwargs


def _verify(patch: _PositionPatch, state: _State) -> None:
    """Check the patched forward against the module's own on a CPU copy holding the exact table.  CPU is
    the default device meanwhile: the module's own code may make tensors there (``meta`` while a model is
    built under ``with torch.device("meta")``)."""
    with _CPU:
        probe = copy.copy(patch.module)  # shallow: the tables below are new tensors, the module is untouched
        probe.__dict__ = dict(patch.module.__dict__)
        probe._parameters, probe._buffers = dict(patch.module._parameters), dict(patch.module._buffers)
        table = _table_of(patch.module)
        if table is not None:
            exact = _exact_table(patch, max(table.shape[0], 64), state.width, torch.float32)
            name = "weights" if isinstance(getattr(patch.module, "weights", None), torch.Tensor) else "weight"
            if name in probe._buffers:
                probe._buffers[name] = exact
            elif name in probe._parameters:
                probe._parameters[name] = nn.Parameter(exact, requires_grad=False)
            else:
                probe.__dict__[name] = exact
            if hasattr(probe, "num_embeddings"):
                probe.num_embeddings = exact.shape[0]
        probe._posenc_fast = state
        probe.__dict__[_READS_TABLE] = False
        for args, kwargs in _probe_calls(patch, state.arguments, state.width):
            try:
                # On copies of the arguments: some releases' forwards shift their position_ids in place (XGLM 4.57)
                own_args, own_kwargs = copy.deepcopy((args, kwargs))
                with torch.no_grad():
                    expected = type(patch.module).forward(probe, *own_args, **own_kwargs)
            except Exception as error:  # the installed forward takes these arguments differently
                raise _Unverified(f"its own forward rejected a probe call ({type(error).__name__}: {error})") from None
            got = _position_forward(probe, *args, **kwargs)
            if got.shape != expected.shape or got.dtype != expected.dtype:
                raise _Unverified(f"the probe gave shape {list(expected.shape)} {expected.dtype} unpatched and "
                                  f"{list(got.shape)} {got.dtype} patched")
            difference = float((got.double() - expected.double()).abs().max()) if got.numel() else 0.0
            if not difference <= 1e-5:
                raise _Unverified(f"the probe's PE rows differ from its own by {difference:.3g}")


def _check_table(patch: _PositionPatch, ignore_table_values: bool) -> bool:
    """Whether the table may be read (by a call where it requires grad): it is the sinusoid, or it has no
    values yet (``meta``).  A trainable table that is not the sinusoid may have been fine-tuned: refuse.
    A frozen or buffer table that is not the sinusoid was broken by loading: warn and patch."""
    table = _table_of(patch.module)
    if table is None or table.is_meta:
        return True
    rows, width = table.shape
    expected = _exact_table(patch, rows, width, torch.float64)
    difference = float((table.detach().to(_CPU, torch.float64) - expected).abs().max()) if rows else 0.0
    # Loose enough for fp32 tables whose angles were formed in fp32, which drift at large positions.
    tolerance = 1e-3 + 4 * torch.finfo(table.dtype).eps
    if difference <= tolerance:
        return True
    if ignore_table_values:
        return False
    where = f"{type(patch.side).__name__}'s {type(patch.module).__name__}"
    if table.requires_grad:
        raise ValueError(
            f"{where} is not the {patch.preset!r} sinusoid (max difference {difference:.3g}) and is trainable: it "
            "may have been fine-tuned, and the exact PE would change the model; not patched. If loading broke it "
            "(meta or device_map loads, transformers #18259/#36844), patch_model(model, ignore_table_values=True) "
            "computes the exact sinusoid and never reads it.")
    warnings.warn(f"{where} held values that are not the {patch.preset!r} sinusoid (max difference "
                  f"{difference:.3g}; a meta or device_map load leaves it so): the patched model computes the exact "
                  "sinusoid and never reads that table.", RuntimeWarning, stacklevel=_callers_stacklevel())
    return False


def _bind_forward(module: nn.Module) -> None:
    """Give ``module`` the patched forward, bound to it.  A partial of a module-level function and the
    instance: deepcopy binds it to the copy, pickle (torch.save of the whole model) stores the function by
    name.  nn.DataParallel's replicas copy the module's ``__dict__``, forward included, so the module's
    ``_replicate_for_data_parallel`` binds it again to each replica (which holds its own device's table)."""
    forward = functools.partial(_position_forward, module)
    if getattr(module, "_hf_hook", None) is not None and hasattr(module, "_old_forward"):
        # accelerate's hook (device_map, offloading) wraps the forward and calls ``_old_forward`` after
        # moving the weights to the execution device: replace what it wraps, keep the hook.
        module._old_forward = forward
    else:
        module.forward = forward
    module._replicate_for_data_parallel = functools.partial(_replica, module)


def _replica(module: nn.Module) -> nn.Module:
    replica = type(module)._replicate_for_data_parallel(module)
    _bind_forward(replica)
    return replica


def _apply(patch: _PositionPatch, state: _State) -> bool:
    """Patch the module; whether its table was trainable and is now frozen."""
    module = patch.module
    module._posenc_fast = state
    setattr(module, _READS_TABLE, False)
    _bind_forward(module)
    table = _table_of(module)
    if isinstance(table, nn.Parameter) and table.requires_grad:
        table.requires_grad_(False)
        return True
    return False


# ------------------------------------------------------------------------------------------- families

def _fairseq(side, kind: str = "fairseq") -> _PositionPatch:
    """Sides whose ``embed_positions`` is a fairseq table: positions from the ids, padding has no PE (``kind``:
    the rule, fairseq's or FSMT's, which is also the preset's name)."""
    return _PositionPatch(side, side.embed_positions, kind, kind, side.embed_positions.padding_idx)


def _fsmt(side) -> _PositionPatch:
    """FSMT: a fairseq table read by FSMT's own rule (kind and preset ``"fsmt"``)."""
    return _fairseq(side, "fsmt")


def _embed_positions(preset: str, kind: str):
    """Sides whose ``embed_positions`` takes ``kind`` ("offset": the past length; "positions": position ids)."""
    return lambda side: _PositionPatch(side, side.embed_positions, preset, kind)


_marian = _embed_positions("marian", "offset")
_pegasus_x = _embed_positions("whisper", "offset_batched")


def _seamless_m4t(side) -> Optional[_PositionPatch]:
    """SeamlessM4T (v1, v2) text encoder and decoder; the text-to-unit encoder adds no PE of its own."""
    if getattr(side, "embed_positions", None) is None:
        return None
    return _fairseq(side)


def _xglm(side) -> _PositionPatch:
    """XGLM: position_ids (past included) + 2 index a fairseq table whose padding row is zero."""
    module = side.embed_positions
    return _PositionPatch(side, module, "fairseq", "positions", module.padding_idx, shift=module.offset)


def _xlm(side) -> _PositionPatch:
    if not side.config.sinusoidal_embeddings:
        raise ValueError(f"{type(side).__name__} has learned position embeddings (config.sinusoidal_embeddings=False)")
    return _PositionPatch(side, side.position_embeddings, "xlm", "positions")


def _distilbert(model) -> _PositionPatch:
    if not model.config.sinusoidal_pos_embds:
        raise ValueError(f"{type(model).__name__} has learned position embeddings (config.sinusoidal_pos_embds=False)")
    return _PositionPatch(model, model.embeddings.position_embeddings, "xlm", "positions")


# Side class -> family function, matched by name and module ("transformers.models.<family>."), so
# transformers is never imported here and every head (base, LM head, generation) is covered by its sides.
_FAMILIES: Dict[Tuple[str, str], Callable[[nn.Module], Optional[_PositionPatch]]] = {
    ("m2m_100", "M2M100Encoder"): _fairseq,
    ("m2m_100", "M2M100Decoder"): _fairseq,
    ("nllb_moe", "NllbMoeEncoder"): _fairseq,
    ("nllb_moe", "NllbMoeDecoder"): _fairseq,
    ("marian", "MarianEncoder"): _marian,
    ("marian", "MarianDecoder"): _marian,
    ("pegasus", "PegasusEncoder"): _marian,
    ("pegasus", "PegasusDecoder"): _marian,
    ("fsmt", "FSMTEncoder"): _fsmt,
    ("fsmt", "FSMTDecoder"): _fsmt,
    ("speech_to_text", "Speech2TextEncoder"): _fairseq,
    ("speech_to_text", "Speech2TextDecoder"): _fairseq,
    ("xlm", "XLMModel"): _xlm,
    ("distilbert", "DistilBertModel"): _distilbert,
    ("kosmos2", "Kosmos2TextTransformer"): _fairseq,
    ("musicgen", "MusicgenDecoder"): _embed_positions("musicgen", "offset"),
    ("xglm", "XGLMModel"): _xglm,
    ("pegasus_x", "PegasusXEncoder"): _pegasus_x,
    ("pegasus_x", "PegasusXDecoder"): _pegasus_x,
    ("seamless_m4t", "SeamlessM4TEncoder"): _seamless_m4t,
    ("seamless_m4t", "SeamlessM4TDecoder"): _seamless_m4t,
    ("seamless_m4t_v2", "SeamlessM4Tv2Encoder"): _seamless_m4t,
    ("seamless_m4t_v2", "SeamlessM4Tv2Decoder"): _seamless_m4t,
    ("whisper", "WhisperEncoder"): _embed_positions("whisper", "positions"),
}


def supported_classes() -> List[str]:
    """The side classes ``patch_model`` patches (any model that contains one is supported)."""
    return [name for _, name in _FAMILIES]


def _family_of(module: nn.Module):
    parts = type(module).__module__.split(".")
    if len(parts) < 3 or parts[0] != "transformers" or parts[1] != "models":
        return None
    return _FAMILIES.get((parts[2], type(module).__name__))


def patch_model(model: nn.Module, *, ignore_table_values: bool = False) -> nn.Module:
    """Make a transformers model compute its sinusoidal PE with posenc_fast, in place; returns ``model``.

    The position modules of every ``supported_classes()`` side, under any head, compute the exact PE rows instead
    of reading their tables.  ``TypeError`` for a model with none; ``ValueError`` for a trainable table that is not
    the sinusoid (``ignore_table_values=True`` patches anyway, for tables a load broke).  Outside
    ``SUPPORTED_TRANSFORMERS`` it warns and leaves the model unpatched; a module whose installed code is not what
    the patch knows, likewise that module.  Freezes trainable tables (made trainable again, they are read).
    Patching twice changes nothing; reloading undoes it.  docs/presets.md, "Hugging Face models: patch_model".
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_model takes a transformers model (an nn.Module), got {type(model).__name__}")
    unsupported = _unsupported_transformers()
    if unsupported is not None:
        warnings.warn(unsupported, RuntimeWarning, stacklevel=_callers_stacklevel())
        return model
    patches, found = [], False
    for module in model.modules():
        family = _family_of(module)
        if family is None:
            continue
        found = True
        patch = family(module)
        if patch is not None and getattr(patch.module, "_posenc_fast", None) is None:  # twice changes nothing
            patches.append(patch)
    if not found:
        raise TypeError(f"posenc_fast.patch_model does not support {type(model).__name__}: it contains none of "
                        f"the modules it patches ({', '.join(sorted(set(supported_classes())))})")
    readable = [_check_table(patch, ignore_table_values) for patch in patches]
    names = _table_names(model)
    prepared = []
    for patch, table_readable in zip(patches, readable):
        try:
            arguments = _arguments(patch)
            table = _table_of(patch.module)
            name = names.get(id(table), "") if table is not None else ""
            width = table.shape[-1] if table is not None else patch.module.embed_dim
            state = _State(patch.kind, _spec(patch, width), width, patch.zero_position, arguments, patch.shift, name,
                           table_readable)
            _verify(patch, state)
            prepared.append((patch, state))
        except _Unverified as why:
            warnings.warn(f"posenc_fast.patch_model left {type(patch.side).__name__}.{type(patch.module).__name__} "
                          f"unpatched: {why}. The model keeps its own PE there (same outputs).", RuntimeWarning,
                          stacklevel=_callers_stacklevel())
    frozen = [state.table_name for patch, state in prepared if _apply(patch, state)]
    if frozen:
        warnings.warn(f"posenc_fast.patch_model froze {', '.join(frozen)}: trainable sinusoidal position tables, "
                      "which the patched model computes instead of reading, so they no longer train. To train them "
                      "as the unpatched model does, make them trainable again after patching (requires_grad_(True)):"
                      " their patched modules then read them, as unpatched.", UserWarning,
                      stacklevel=_callers_stacklevel())
    return model


def _table_names(model: nn.Module) -> Dict[int, str]:
    """id(tensor) -> its first name among the model's Parameters and buffers."""
    names: Dict[int, str] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(
            remove_duplicate=False)):
        names.setdefault(id(tensor), name)
    return names
