"""The layer's host-side parameters (:class:`PESpec`), computed once and shared by every backend.

A :class:`PESpec` is the complete, immutable description of *what* is computed (mode, widths,
layout, frequencies, scales, padding row).  Backends turn it into plain numbers and pointers;
none derives frequencies or layout rules on its own.  Frequencies are fixed-point turns
``R_i = round(w_i / 2pi * 2**64)`` (int64); ``p * R_i``, a wrapping multiply, is the exact fractional turn
(docs/design.md, "Numerics").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

MODES = ("add", "concat")
# Arithmetic of the PE and the sum before the one rounding to the output dtype.
PRECISIONS = ("float32", "float64")
# interleaved: [s0 c0 s1 c1 ...]; split: [s0 s1 ... | c0 c1 ...]; split_cos_first: [c0 c1 ... | s0 s1 ...]
LAYOUTS = ("interleaved", "split", "split_cos_first")

# Largest |embed_scale| and |pe_scale|: the kernels multiply in float32, where a larger scale is inf.
MAX_SCALE = 3.4028234663852886e38  # torch.finfo(torch.float32).max
# Widest output row (d_model): the Triton and CUDA launch grids cover a row with at most 65535 column blocks.
MAX_ROW_WIDTH = 1 << 22

# 2*pi * 10**60 as an integer: R_i in exact integer arithmetic (docs/design.md, "Numerics").
_TWO_PI_E60 = 6283185307179586476925286766559005768394338798750211641949889
_E60 = 10**60
_TWO_POW_64 = 1 << 64


def host_cache(fn):
    """lru_cache for host-side parameter functions, bypassed while torch.compile traces
    (Dynamo would trace through the cache anyway, and warns when it does)."""
    cached = functools.lru_cache(maxsize=512)(fn)

    @functools.wraps(fn)
    def wrapper(*args):
        if torch.compiler.is_compiling():
            return fn(*args)
        return cached(*args)

    return wrapper


@host_cache
def default_frequencies(pe_width: int, base: float = 10000.0, count: Optional[int] = None) -> Tuple[float, ...]:
    """Vaswani et al. frequencies ``w_i = base ** (-2 i / D)`` for ``i < count`` (default D // 2), in float64."""
    count = pe_width // 2 if count is None else count
    return tuple(float(base) ** (-2.0 * i / pe_width) for i in range(count))


@host_cache
def turns_fixed_point(frequencies: Tuple[float, ...]) -> Tuple[int, ...]:
    """``round(w_i / (2 pi) * 2**64)`` as a two's-complement int64, per frequency (each float64 ``w_i`` an exact
    rational).  Negative and large (> 2*pi) frequencies wrap correctly: only the turn modulo 1 matters."""
    out = []
    for w in frequencies:
        numerator, denominator = float(w).as_integer_ratio()
        # round(w * 2**64 / (2*pi)) with integers only: floor((2a + b) / 2b).
        a = numerator * _TWO_POW_64 * _E60
        b = denominator * _TWO_PI_E60
        fixed = ((2 * a + b) // (2 * b)) % _TWO_POW_64
        out.append(fixed - _TWO_POW_64 if fixed >= 1 << 63 else fixed)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class PEColumns:
    """Where each pair's sin and cos land in the PE (width D, h = D // 2 pairs).

    interleaved: sin of pair i at column 2i, cos at 2i + 1.
    blocks: sin of pair i at ``sin_base + i`` for i < num_sin, cos at ``cos_base + i`` for i < num_cos.
    An odd D has one column beyond the h pairs (the "tail"): it is the sin of a frequency
    ``w_h`` when the spec has h + 1 frequencies, else zero.  In block layouts the tail
    is slot h of whichever block has h + 1 slots; a cos slot h is always zero.
    """

    interleaved: bool
    sin_base: int = 0
    num_sin: int = 0
    cos_base: int = 0
    num_cos: int = 0

    @staticmethod
    def of(layout: str, pe_width: int, tail_is_sin: bool) -> "PEColumns":
        half, odd = pe_width // 2, pe_width % 2
        if layout == "interleaved":
            return PEColumns(True, 0, pe_width - half, 1, half)
        if layout == "split":  # zero tail after the cos block; a sin tail extends the sin block
            num_sin = half + (odd if tail_is_sin else 0)
            return PEColumns(False, 0, num_sin, num_sin, pe_width - num_sin)
        if layout == "split_cos_first":  # the tail, sin or zero, ends the sin block
            return PEColumns(False, half, pe_width - half, 0, half)
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")

    def sin_columns(self, pe_width: int) -> range:
        """Column of the sin of pair i, for every pair slot i (the tail included)."""
        return range(0, pe_width, 2) if self.interleaved else range(self.sin_base, self.sin_base + self.num_sin)

    def cos_columns(self, pe_width: int) -> range:
        """Column of the cos of pair i, for i < h (a cos-block tail slot is a zero column)."""
        half = pe_width // 2
        if self.interleaved:
            return range(1, 2 * half, 2)
        return range(self.cos_base, self.cos_base + min(self.num_cos, half))

    def as_list(self) -> List[int]:
        """The form the op takes: [interleaved, sin_base, num_sin, cos_base, num_cos]."""
        return [int(self.interleaved), self.sin_base, self.num_sin, self.cos_base, self.num_cos]

    @staticmethod
    def from_list(columns: Sequence[int]) -> "PEColumns":
        """Inverse of :meth:`as_list`; cached, since the op rebuilds it on every call."""
        key = tuple(columns)
        found = _COLUMNS_FROM_LIST.get(key)
        if found is None:
            interleaved, sin_base, num_sin, cos_base, num_cos = key
            found = _COLUMNS_FROM_LIST[key] = PEColumns(bool(interleaved), sin_base, num_sin, cos_base, num_cos)
        return found


_COLUMNS_FROM_LIST = {}  # as_list() tuple -> PEColumns (a handful of layouts per process)


class KernelParams(NamedTuple):
    """The plain numbers a kernel needs (``PESpec.kernel_params``; the op builds them from its flat arguments)."""

    concat: bool
    token_width: int
    pe_width: int
    columns: PEColumns
    embed_scale: float
    pe_scale: float
    pe_zero_id: int  # tokens with this id get no PE (fairseq padding); -1: none
    float64_math: bool = False  # PE and sum in float64, one rounding (backends declare FLOAT64_MATH)

    @property
    def width(self) -> int:
        return self.token_width + self.pe_width if self.concat else self.token_width

    @property
    def num_pairs(self) -> int:
        return self.pe_width // 2


@dataclasses.dataclass(frozen=True)
class PESpec:
    """Everything about the layer that is fixed before seeing a batch.

    ``token_width`` is the width of the embedding table; ``pe_width`` (D) the
    width of the sinusoid; ``width`` the output width.
    """

    mode: str
    token_width: int
    pe_width: int
    layout: str
    frequencies: Tuple[float, ...]
    embed_scale: float = 1.0
    pe_scale: float = 1.0
    padding_idx: Optional[int] = None  # normalised to [0, num_embeddings) or None
    zero_pe_at_padding: bool = False  # tokens equal to padding_idx get no PE (fairseq)
    precision: str = "float32"  # "float64": correctly rounded fp32 outputs (slower on consumer GPUs)
    # Derived from the fields above, not compared or pickled (_kernel_params: without, with the PE zeroed at padding).
    turns_fixed_point: Tuple[int, ...] = dataclasses.field(init=False, compare=False, repr=False)
    columns: PEColumns = dataclasses.field(init=False, compare=False, repr=False)
    _kernel_params: Tuple[KernelParams, KernelParams] = dataclasses.field(init=False, compare=False, repr=False)
    _turns_by_device: dict = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self):
        # Plain attributes rather than functools.cached_property, whose lock torch.compile cannot trace.
        object.__setattr__(self, "turns_fixed_point", turns_fixed_point(tuple(self.frequencies)))
        tail_is_sin = len(self.frequencies) > self.pe_width // 2
        columns = PEColumns.of(self.layout, self.pe_width, tail_is_sin)
        object.__setattr__(self, "columns", columns)
        params = KernelParams(self.mode == "concat", self.token_width, self.pe_width, columns, self.embed_scale,
                              self.pe_scale, -1, self.precision == "float64")
        zero_id = -1 if self.padding_idx is None else self.padding_idx
        object.__setattr__(self, "_kernel_params", (params, params._replace(pe_zero_id=zero_id)))
        object.__setattr__(self, "_turns_by_device", {})

    def __getstate__(self):
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.init}

    def __setstate__(self, state):
        for name, value in state.items():
            if name in self.__dataclass_fields__ and self.__dataclass_fields__[name].init:
                object.__setattr__(self, name, value)
        self.__post_init__()

    def kernel_params(self, zero_pe_at_padding: bool) -> KernelParams:
        """The kernels' parameters; ``zero_pe_at_padding``: the padding row's tokens get no PE (the call's
        choice: the fsmt position rule gives them one once the past length is not 0)."""
        return self._kernel_params[zero_pe_at_padding]

    @property
    def width(self) -> int:
        return self.token_width + self.pe_width if self.mode == "concat" else self.token_width

    def turns_tensor(self, device) -> torch.Tensor:
        """The int64 ``R_i`` on ``device``, cached: one host-to-device copy per (spec, device).  The cache is
        process-wide, so it holds plain tensors only (docs/design.md, "No state left behind")."""
        cached = self._turns_by_device.get(device)  # a torch.device already (weight.device): no conversion
        if cached is None:
            device = torch.device(device)
            cached = self._turns_by_device.get(device)
        if torch.compiler.is_compiling():
            return cached if cached is not None else self._new_turns(device)
        if dispatch_mode_depth():
            return self._new_turns(device)
        if cached is None:
            with torch._C._DisableFuncTorch(), torch.inference_mode(False), _outside_jit_trace():
                cached = self._turns_by_device[device] = self._new_turns(device)
        return cached

    def _new_turns(self, device) -> torch.Tensor:
        return torch.tensor(self.turns_fixed_point, dtype=torch.int64, device=device).reshape(-1)


@contextlib.contextmanager
def _outside_jit_trace():
    """Suspends a jit.trace in progress: what is made here is not recorded (a plain tensor)."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


# How many TorchDispatchModes are active (a FakeTensorMode, make_fx's proxy mode, FlopCounterMode...).
dispatch_mode_depth = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


_FLOAT64_MAX = 1.7976931348623157e308


def is_finite_number(value) -> bool:
    """A real, finite int or float (not a bool).  One comparison instead of ``math.isfinite``: under
    ``torch.compile(dynamic=True)`` a float may be symbolic, and only comparisons trace (NaN fails it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymInt, torch.SymFloat)):
        return False
    return abs(value) <= _FLOAT64_MAX  # (Python compares a huge int with a float exactly)
