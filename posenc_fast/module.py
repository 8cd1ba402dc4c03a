"""The fused layers as nn.Modules: ``SinusoidalEmbedding`` (a drop-in for nn.Embedding + PE) and
``SinusoidalPositionalEncoding`` (the PE added to an existing tensor)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import presets
from ._dispatch import check_backend_name, eager_call
from ._prepared import PreparedAddition, PreparedForward, run_addition, run_embedding
from ._validate import check_dropout_p, check_weight, make_spec
from .functional import apply_add_spec, apply_spec
from .presets import PADDING_AWARE_RULES, POSITION_RULES


class SinusoidalEmbedding(nn.Module):
    """Token embedding + fixed sinusoidal positional encoding in one kernel.

    ``forward(ids, positions=None, offset=0, cu_seqlens=None)`` returns rows of width ``d_model``.
    ``weight`` is ``[num_embeddings, d_model]`` for ``mode="add"`` and ``[num_embeddings, d_model - d_pos]``
    for ``mode="concat"``, initialised like ``nn.Embedding`` (N(0, 1), padding row zero).

    ``dropout``: the probability of the dropout after embedding + PE (as in the original Transformer),
    applied in training mode inside the same kernel (see :func:`posenc_fast.sinusoidal_embedding`);
    eval mode is exact.

    ``position_rule="fairseq"`` numbers positions as fairseq does (padding-aware, see
    ``posenc_fast.make_positions``; ``offset`` is then the past length); ``"fsmt"`` is HF FSMT's
    variant, where the past length also moves padding tokens (and gives them a PE).

    ``vocab_range=(start, end)`` makes a vocabulary-parallel shard (Megatron style): ``weight`` holds
    rows start..end-1 of the ``num_embeddings`` rows and ids stay global.  Ids of other shards give zero
    token vectors and no gradient, and only the shard with ``start == 0`` adds the PE, so the sum
    (all-reduce) of the shards' outputs is the unsharded layer's output.  With ``dropout`` this holds
    when every rank of the tensor-parallel group has the same torch RNG state, so that the shards draw
    the same seed and drop the same elements (Megatron's default generator, not inside its per-rank
    ``get_cuda_rng_tracker().fork()``).

    ``sparse=True``: the weight's gradient is the sparse tensor ``nn.Embedding(sparse=True)`` makes
    (see :func:`posenc_fast.sinusoidal_embedding`).

    Library conventions: :meth:`from_preset`; an existing token table: :meth:`from_pretrained`.
    """

    def __init__(
        self,
        num_embeddings: int,
        d_model: int,
        *,
        mode: str = "add",
        d_pos: Optional[int] = None,
        base: float = 10000.0,
        layout: str = "interleaved",
        embed_scale: float = 1.0,
        pe_scale: float = 1.0,
        padding_idx: Optional[int] = None,
        frequencies: Optional[Sequence[float]] = None,
        zero_pe_at_padding: bool = False,
        position_rule: str = "offset",
        precision: str = "float32",
        vocab_range: Optional[Tuple[int, int]] = None,
        dropout: float = 0.0,
        sparse: bool = False,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if sparse is not False and sparse is not True:
            raise TypeError(f"sparse must be a bool, got {sparse!r}")
        for name, value in (("num_embeddings", num_embeddings), ("d_model", d_model)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**63:
                raise ValueError(f"{name} must be an int in [1, 2**63), got {value!r}")
        if mode == "concat" and isinstance(d_pos, int) and not isinstance(d_pos, bool) and not 1 <= d_pos < d_model:
            raise ValueError(f"d_pos={d_pos} must satisfy 1 <= d_pos < d_model={d_model}")
        if position_rule not in POSITION_RULES:
            raise ValueError(f"unknown position_rule {position_rule!r}; expected one of {POSITION_RULES}")
        if position_rule in PADDING_AWARE_RULES and padding_idx is None:
            raise ValueError(f"position_rule={position_rule!r} needs a padding_idx (fairseq's default is 1)")
        token_width = d_model - d_pos if mode == "concat" and isinstance(d_pos, int) else d_model
        rows, vocab_range, padding_idx, pe_scale = self._shard(num_embeddings, vocab_range, padding_idx, pe_scale,
                                                               zero_pe_at_padding, position_rule)
        # Validates every fixed parameter once, here, and computes the frequencies.
        self.spec = make_spec(rows, token_width, mode, d_pos, base, layout, embed_scale, pe_scale, padding_idx,
                              frequencies, zero_pe_at_padding, precision)
        self.vocab_range = vocab_range  # (start, end), as given
        self.base = float(base)  # as given (frequencies, where given, replace its recipe), for the repr
        self.position_rule = position_rule
        self.dropout = check_dropout_p(dropout)
        self.sparse = sparse
        self.preset: Optional[str] = None  # set by from_preset, for the repr
        check_backend_name(backend)  # availability depends on where the tensors are: checked per call
        self.num_embeddings = num_embeddings
        self.d_model = d_model
        self.backend = backend
        self.weight = nn.Parameter(torch.empty((rows, token_width), device=device, dtype=dtype))
        # The frequencies are not a buffer but cached per device on the spec (``PESpec.turns_tensor``), so no
        # cast, to_empty() or FSDP deferred init can leave them wrong (docs/design.md, "torch integration").
        self.reset_parameters()
        self._prepare_turns()
        self._prepared = None  # in the instance from the start: a compiled module's guards see no change later

    # Class defaults for modules pickled by older versions: the last eager call's launch (_prepared), sparse, base.
    _prepared: Optional[PreparedForward] = None
    sparse: bool = False
    base: float = 10000.0

    def _prepare_turns(self) -> None:
        """Copy the frequencies to the weight's device now rather than in the first forward (which may
        be inside a CUDA graph capture, where a host-to-device copy is not allowed)."""
        weight = self.weight
        if isinstance(weight, torch.Tensor) and not weight.is_meta:
            self.spec.turns_tensor(weight.device)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), to_empty(): every move of the weight
        result = super()._apply(fn, recurse)
        self._prepared = None
        self._prepare_turns()
        return result

    @property
    def turns_fixed_point(self) -> torch.Tensor:
        """The fixed-point frequencies (``_spec``) on the weight's device (derived, not state)."""
        return self.spec.turns_tensor(self.weight.device)

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: refuse before TorchScript compiles (and half-registers) anything.
        raise TypeError(
            "SinusoidalEmbedding does not support TorchScript (torch.jit.script): its forward validates "
            "arguments in Python and calls a torch.library op. Use torch.compile, or torch.export for a "
            "graph to deploy; eager and compiled modules are fully supported.")

    @staticmethod
    def _shard(num_embeddings, vocab_range, padding_idx, pe_scale, zero_pe_at_padding, position_rule):
        """(rows held, (start, end) or None, local padding row, PE scale) for a shard, or for the whole table."""
        if vocab_range is None:
            return num_embeddings, None, padding_idx, pe_scale
        try:
            start, end = vocab_range
        except (TypeError, ValueError):
            raise ValueError(f"vocab_range must be a pair (start, end), got {vocab_range!r}") from None
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)):
            raise TypeError(f"vocab_range must be a pair of ints (start, end), got {vocab_range!r}")
        if not 0 <= start < end <= num_embeddings:
            raise ValueError(f"vocab_range={vocab_range!r} must satisfy 0 <= start < end <= "
                             f"num_embeddings={num_embeddings}")
        if zero_pe_at_padding or position_rule != "offset":
            raise ValueError("vocab_range cannot be combined with zero_pe_at_padding or the fairseq position rule")
        local_padding = None
        if padding_idx is not None and start <= padding_idx % num_embeddings < end:
            local_padding = padding_idx % num_embeddings - start
        return end - start, (start, end), local_padding, pe_scale if start == 0 else 0.0

    @property
    def padding_idx(self) -> Optional[int]:
        """The padding row of ``weight`` (local to the shard with ``vocab_range``)."""
        return self.spec.padding_idx

    @property
    def embedding_dim(self) -> int:
        """The output rows' width, ``d_model`` (``nn.Embedding``'s name for it, for code written for one)."""
        return self.d_model

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        nn.init.normal_(self.weight)
        if self.spec.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.spec.padding_idx].fill_(0)

    def forward(self, ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                offset: Union[int, torch.Tensor] = 0, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        # The weight from its registry, skipping nn.Module.__getattr__'s host time; read by item, so that a
        # registry that gathers on access (DeepSpeed ZeRO-3's) still does.  An unregistered weight (a
        # parametrization's property, the legacy weight_norm's plain attribute) is read as an attribute.
        parameters = self._parameters
        weight = parameters["weight"] if "weight" in parameters else self.weight
        spec, backend, dropout = self.spec, self.backend, self.dropout
        # A plain eager call runs its prepared launch; the rest takes the general path (docs/architecture.md).
        if (cu_seqlens is None and self.position_rule == "offset" and self.vocab_range is None
                and eager_call(ids, weight)):
            out = run_embedding(self, spec, backend, dropout, self.training, self.sparse, weight, ids, offset,
                                positions)
            if out is not None:
                return out
        shard = self.vocab_range  # the op takes (first global id held, global vocabulary size)
        return apply_spec(ids, weight, spec, spec.turns_tensor(weight.device), positions, offset, backend,
                          cu_seqlens=cu_seqlens, position_rule=self.position_rule,
                          vocab_range=shard and (shard[0], self.num_embeddings),
                          dropout_p=dropout, training=self.training, sparse=self.sparse)

    def __getstate__(self):
        # The prepared launch holds a binding object: not copied or pickled, prepared again on use.
        return {**super().__getstate__(), "_prepared": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        shard = self.vocab_range  # pickled before it read back as given, it held (start, vocabulary size)
        if shard is not None:
            self.vocab_range = (shard[0], shard[0] + self._parameters["weight"].shape[0])

    @classmethod
    def from_preset(cls, name: str, num_embeddings: int, d_model: int, padding_idx: Optional[int] = None,
                    **overrides) -> "SinusoidalEmbedding":
        """The layer as library ``name`` builds it (see ``posenc_fast.presets``); ``overrides`` win."""
        preset = presets.get(name)
        d_pos = overrides.get("d_pos")  # concat mode: the PE is d_pos wide (an invalid one: the constructor names it)
        pe_width = d_pos if overrides.get("mode") == "concat" and isinstance(d_pos, int) and d_pos > 0 else d_model
        kwargs = preset.kwargs(d_model, pe_width, overrides.get("base", 10000.0))
        kwargs["position_rule"] = preset.position_rule
        kwargs.update(overrides)
        module = cls(num_embeddings, d_model, padding_idx=padding_idx, **kwargs)
        module.preset = name
        return module

    @classmethod
    def from_pretrained(cls, weight: torch.Tensor, *, preset: Optional[str] = None, freeze: bool = False,
                        padding_idx: Optional[int] = None, num_embeddings: Optional[int] = None,
                        **kwargs) -> "SinusoidalEmbedding":
        """Wrap an existing token table, used, not copied (like ``nn.Embedding.from_pretrained``).

        ``weight`` is ``[num_embeddings, token_width]``; ``d_model`` is its width (plus ``d_pos`` in
        concat mode).  ``preset`` names a library convention; other keyword arguments as the constructor.
        A vocabulary-parallel shard (``vocab_range=(start, end)``) takes its ``end - start`` rows and
        ``num_embeddings``, the whole vocabulary's size.

        An ``nn.Parameter`` becomes the layer's ``weight`` itself, so a table tied to an output
        projection stays one Parameter: its gradient lands where the model's optimizer looks, and
        weight decay and clipping see it once.  ``freeze=True`` with a trainable Parameter therefore
        raises (it would freeze the Parameter for its other users too); to freeze the table in this
        layer only, pass ``weight.detach()``.  A plain tensor becomes a new Parameter over the same
        storage (``requires_grad=not freeze``), as in ``nn.Embedding.from_pretrained``, whose ``freeze``
        defaults to True: here False, so that a model's trainable Parameter passes as it is.  The table's
        dtype and device are ``weight``'s: ``dtype=``/``device=`` naming others raise.
        """
        check_weight(weight)  # a 2-D floating-point table
        if isinstance(weight, nn.Parameter) and freeze and weight.requires_grad:
            raise ValueError("freeze=True with a trainable nn.Parameter: the layer keeps the Parameter it is given, "
                             "so freezing would freeze it for its other users; call weight.requires_grad_(False) "
                             "yourself, or pass weight.detach()")
        dtype, device = kwargs.get("dtype"), kwargs.get("device")
        device = None if device is None else torch.device(device)
        other_device = device is not None and (device.type != weight.device.type or None not in (
            device.index, weight.device.index) and device.index != weight.device.index)
        if (dtype is not None and dtype != weight.dtype) or other_device:
            given = ", ".join(f"{n}={v}" for n, v in (("dtype", dtype), ("device", device)) if v is not None)
            raise ValueError(f"from_pretrained uses weight as it is ({weight.dtype} on {weight.device}); {given} does "
                             f"not apply: convert weight first (weight.to(...))")
        if kwargs.get("vocab_range") is not None and num_embeddings is None:
            raise ValueError("from_pretrained with vocab_range needs num_embeddings, the whole vocabulary's size "
                             "(the table holds the shard's rows only)")
        concat_width = kwargs.get("d_pos") or 0 if kwargs.get("mode") == "concat" else 0
        d_model = weight.shape[1] + concat_width
        num_embeddings = weight.shape[0] if num_embeddings is None else num_embeddings
        # Build on the meta device: no table is allocated or randomly initialised only to be replaced.
        kwargs["device"] = "meta"
        kwargs.setdefault("dtype", weight.dtype)
        if preset is not None:
            module = cls.from_preset(preset, num_embeddings, d_model, padding_idx=padding_idx, **kwargs)
        else:
            module = cls(num_embeddings, d_model, padding_idx=padding_idx, **kwargs)
        if module.weight.shape[0] != weight.shape[0]:
            raise ValueError(f"num_embeddings={num_embeddings} and vocab_range={kwargs.get('vocab_range')!r} make a "
                             f"table of {module.weight.shape[0]} rows, but weight has {weight.shape[0]}")
        module.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=not freeze)
        module._prepare_turns()
        return module

    def extra_repr(self) -> str:
        s = self.spec
        return _settings_repr(f"{self.num_embeddings}, {self.d_model}", (
            ("preset", self.preset, None), ("mode", s.mode, _SHOWN),
            ("d_pos", int(s.pe_width) if s.mode == "concat" else None, None), ("layout", s.layout, _SHOWN),
            ("base", self.base, 10000.0), ("embed_scale", s.embed_scale, 1.0), ("pe_scale", s.pe_scale, 1.0),
            ("padding_idx", s.padding_idx, None),
            ("zero_pe_at_padding", s.zero_pe_at_padding, False), ("precision", s.precision, "float32"),
            ("vocab_range", self.vocab_range, None),
            ("position_rule", self.position_rule, "offset"), ("dropout", self.dropout, 0.0),
            ("sparse", self.sparse, False), ("backend", self.backend, "auto")))


class SinusoidalPositionalEncoding(nn.Module):
    """The fixed sinusoidal PE added to an existing float tensor in one kernel:
    ``forward(x, positions=None, offset=0, cu_seqlens=None) = x_scale * x + pe_scale * PE(position)``.

    For inputs that are not token ids: a speech encoder's conv features (Whisper, Speech2Text),
    MusicGen's sum of codebook embeddings, token rows with image vectors substituted (Kosmos-2).
    ``x`` is ``[..., seq_len, d_model]``; positions follow the axis before the last as they follow
    the ids in :class:`SinusoidalEmbedding`.  No parameters; the gradient to ``x`` is
    ``x_scale * grad``.  Library conventions: :meth:`from_preset` (its embed scale becomes ``x_scale``).
    """

    def __init__(self, d_model: int, *, base: float = 10000.0, layout: str = "interleaved",
                 frequencies: Optional[Sequence[float]] = None, x_scale: float = 1.0, pe_scale: float = 1.0,
                 precision: str = "float32", backend: str = "auto", device=None):
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be an int >= 1, got {d_model!r}")
        self.spec = make_spec(1, d_model, "add", None, base, layout, x_scale, pe_scale, None, frequencies, False,
                              precision, scale_name="x_scale")
        check_backend_name(backend)
        self.d_model = d_model
        self.backend = backend
        self.preset: Optional[str] = None
        self.base = float(base)  # (as SinusoidalEmbedding's)
        # No buffer, as in SinusoidalEmbedding.  With no weight, the frequencies go to x's device on first use;
        # ``device`` copies them there now, outside any CUDA graph capture (see _prepare_turns).
        if device is not None and torch.device(device).type != "meta":
            self.spec.turns_tensor(torch.device(device))
        self._prepared = None  # (as SinusoidalEmbedding's)

    @classmethod
    def from_preset(cls, name: str, d_model: int, **overrides) -> "SinusoidalPositionalEncoding":
        """The PE of library ``name`` (``posenc_fast.presets``); its ``embed_scale`` is ``x_scale``.

        A padding-aware preset's position rule needs ids, which this layer does not see: its calls must
        pass ``positions`` (``posenc_fast.make_positions``).
        """
        if "embed_scale" in overrides:
            raise TypeError("SinusoidalPositionalEncoding scales x by x_scale=...; embed_scale is "
                            "SinusoidalEmbedding's name for it")
        preset = presets.get(name)
        kwargs = preset.kwargs(d_model, base=overrides.get("base", 10000.0))
        kwargs["x_scale"] = kwargs.pop("embed_scale")
        kwargs.pop("zero_pe_at_padding")
        kwargs.update(overrides)
        module = cls(d_model, **kwargs)
        module.preset, module.position_rule = name, preset.position_rule
        return module

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None,
                offset: Union[int, torch.Tensor] = 0, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        if positions is None and self.position_rule != "offset":
            raise ValueError(f"preset {self.preset!r} numbers positions around padding, which x does not show: pass "
                             "positions=posenc_fast.make_positions(mask, padding_idx), mask equal to padding_idx "
                             "at padded frames (cu_seqlens cannot number them)")
        spec, backend = self.spec, self.backend
        if cu_seqlens is None and eager_call(x, x):  # (see SinusoidalEmbedding.forward)
            out = run_addition(self, spec, backend, x, offset, positions)
            if out is not None:
                return out
        return apply_add_spec(x, spec, spec.turns_tensor(x.device), positions, offset, cu_seqlens, backend)

    _prepared: Optional[PreparedAddition] = None  # as SinusoidalEmbedding's (and base)
    base: float = 10000.0
    position_rule = "offset"  # a padding-aware preset's (from_preset): its calls must pass positions

    def __getstate__(self):
        return {**super().__getstate__(), "_prepared": None}

    def extra_repr(self) -> str:
        s = self.spec
        return _settings_repr(f"{self.d_model}", (
            ("preset", self.preset, None), ("layout", s.layout, _SHOWN), ("base", self.base, 10000.0),
            ("x_scale", s.embed_scale, 1.0), ("pe_scale", s.pe_scale, 1.0), ("precision", s.precision, "float32"),
            ("position_rule", self.position_rule, "offset"), ("backend", self.backend, "auto")))


_SHOWN = object()  # a default no value equals: the setting is always shown


def _settings_repr(leading: str, settings) -> str:
    """An ``extra_repr``: ``leading``, then each ``(name, value, default)`` whose value is not its default, a
    float as ``%g``, a string quoted."""
    shown = (f"{name}={value:g}" if isinstance(value, float) else f"{name}={value!r}" if isinstance(value, str)
             else f"{name}={value}" for name, value, default in settings if value != default)
    return ", ".join((leading, *shown))
