"""Prepared launches: a module's repeated eager inference call, with what stays fixed between calls
worked out once.

A decoding step calls the layer with a few tokens, so its cost is host time: validation, backend
choice, argument packing and the binding's conversion of thirty-one arguments (bench/host_overhead.py
times it).  After a call that took the general path (``functional.apply_spec``) and could have taken
this one, ``SinusoidalEmbedding`` keeps a :class:`PreparedForward`: the resolved backend, its kernel
parameters and a ``PreparedLaunch`` (the backend's binding with those parameters bound).  The next
call runs it if it is the same kind of call on the same kind of table; anything else (another dtype,
shape or device of the table, another spec, backend, position rule, vocabulary range or dropout
probability (compared by identity: the value prepared for is the object the general path checked), a changed extension, a call that needs autograd, dropout, positions, a tensor offset or
cu_seqlens, or one under torch.compile, tracing, a functorch transform or a dispatch mode) takes the
general path, which validates everything and raises the errors.

What the prepared launch holds does not depend on the table's data: its pointer and row stride are
read on every call, so in-place updates, ``.data`` swaps and a new Parameter of the same shape need
no invalidation.  (A zero tensor, which has no memory, is refused by the binding itself.)  Backends without ``prepare_forward`` (torch, triton) always take the general path.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import backends as _backends
from ._dispatch import get_backend, resolve_backend
from .functional import _eager_call, _kernel_params
from .ops import check_ids_if_enabled

_STRIDED = torch.strided
_INT64_MIN, _INT64_END = -(2**63), 2**63


class PreparedForward:
    """One module's prepared launch and what it was prepared for (see the module docstring)."""

    __slots__ = ("spec", "backend", "position_rule", "dropout", "dtype", "shape", "device", "width", "launch",
                 "id_codes", "last_argument", "is_current", "keep_alive")

    def __init__(self, module, weight: torch.Tensor, launch: _backends.PreparedLaunch):
        self.spec, self.backend, self.position_rule = module.spec, module.backend, module.position_rule
        self.dropout = module.dropout
        self.dtype, self.shape, self.device = weight.dtype, weight.shape, weight.device
        self.width = module.spec.width
        self.launch, self.id_codes, self.last_argument = launch.launch, launch.id_codes, launch.last_argument
        self.is_current = launch.is_current
        self.keep_alive = launch.turns

    @staticmethod
    def build(module, weight: torch.Tensor) -> Optional["PreparedForward"]:
        """The prepared launch for ``module``'s next calls, or None when its backend has none.  Called
        after a general-path call with ``weight`` succeeded, so the module's settings are valid."""
        if module.position_rule != "offset" or module.vocab_range is not None:
            return None
        spec = module.spec
        name = resolve_backend(module.backend, weight.device, weight.dtype, float64_math=spec.precision == "float64")
        prepare = getattr(get_backend(name), "prepare_forward", None)
        if prepare is None:
            return None
        launch = prepare(weight, spec.turns_tensor(weight.device), _kernel_params(spec, spec.zero_pe_at_padding))
        return None if launch is None else PreparedForward(module, weight, launch)

    def prepared_for(self, module, weight) -> bool:
        """Whether ``module`` with table ``weight`` is still what this launch was prepared for."""
        return (module.spec is self.spec and module.backend == self.backend
                and module.position_rule == self.position_rule and module.vocab_range is None
                and module.dropout is self.dropout and weight.dtype is self.dtype and weight.shape == self.shape
                and weight.device == self.device and self.is_current())

    def run(self, module, weight, ids, offset) -> Optional[torch.Tensor]:
        """``module(ids, offset=offset)`` when this launch was prepared for that call; else None."""
        # The checks of prepared_for, inline (a decoding step pays each Python call), then the call's own.
        if (type(offset) is not int or type(ids) is not torch.Tensor or not _INT64_MIN <= offset < _INT64_END
                or module.spec is not self.spec or module.backend != self.backend
                or module.position_rule != self.position_rule or module.vocab_range is not None
                or module.dropout is not self.dropout or (module.training and self.dropout)
                or (weight.requires_grad and torch.is_grad_enabled())):
            return None
        id_code = self.id_codes.get(ids.dtype)
        if (id_code is None or weight.dtype is not self.dtype or weight.shape != self.shape
                or ids.layout is not _STRIDED or weight.layout is not _STRIDED or not ids.is_contiguous()
                or not weight.is_contiguous() or ids.is_neg() or weight.is_neg()
                or ids.device != self.device or weight.device != self.device
                or not _eager_call(ids, weight) or not self.is_current()):
            return None
        shape = ids.shape
        check_ids_if_enabled(ids, self.shape[0])
        # Same dtype and device as the table; new_empty with the sizes unpacked is the cheapest allocation
        # call (about 1 us against 2 for torch.empty with a shape tuple and keywords).
        out = weight.new_empty(*shape, self.width)
        if _backends.POISON_OUTPUTS:
            out.fill_(float("nan"))
        self.launch(ids.data_ptr(), id_code, weight.data_ptr(), self.shape[1], out.data_ptr(), offset,
                    shape[-1] if shape else 1, ids.numel(), self.last_argument())
        return out
