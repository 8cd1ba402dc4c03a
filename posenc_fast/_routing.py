"""What kind of call is running: eager on plain tensors, or traced, transformed or intercepted.

The package's entry points (``module``, ``functional``) ask these predicates before choosing how to run a
call (a prepared launch serves eager calls only); they depend on torch alone, so every layer may ask.
"""

from __future__ import annotations

import sys

import torch
import torch.autograd.forward_ad as _forward_ad

from ._spec import dispatch_mode_depth


def jit_tracing() -> bool:
    """Inside ``torch.jit.trace`` (and TorchScript's ONNX exporter, which traces)."""
    return not torch.compiler.is_compiling() and torch._C._is_tracing()  # (Dynamo cannot trace _is_tracing)


def eager_call(ids, weight) -> bool:
    """Whether the call may run the op's implementation without torch.library: eager, on plain
    tensors, with nothing tracing (torch.compile, torch.export, jit.trace), transforming (torch.func,
    vmap, forward-mode AD) or intercepting (a dispatch mode) it.

    Such a call skips the dispatcher and the custom op's autograd wrapper (autograd goes through
    ``ops.EmbeddingFunction``), most of a decoding step's host time (bench/host_overhead.py); it runs
    the same implementation with the same checks.  A tensor kept from a finished torch.func transform
    is still a functorch wrapper, though its type is ``torch.Tensor``: such a call takes the op, whose
    dispatcher unwraps it; so does a legacy-vmap batched tensor.
    """
    return (type(ids) is _TENSOR and (type(weight) is _PARAMETER or type(weight) is _TENSOR)
            and not _is_compiling() and not _is_tracing() and not _functorch_transforms_active()
            and not dispatch_mode_depth() and _forward_ad._current_level < 0
            and not _functorch_wrapped(ids) and not _functorch_wrapped(weight)
            and not _legacy_batched(ids) and not _legacy_batched(weight))


# Module-level names for torch's predicates: every prepared launch calls eager_call, so each saves an
# attribute lookup.
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_is_compiling = torch.compiler.is_compiling
_is_tracing = torch._C._is_tracing
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
# torch.autograd.gradcheck's batched-gradient check runs the backward under the legacy vmap
# (torch._vmap_internals), whose batched tensors are neither functorch wrappers nor seen by the
# transform predicate.
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def plain(t) -> bool:
    """Whether ``t`` is None or a tensor whose memory a kernel can read: not a functorch wrapper
    (``grad``'s or ``vmap``'s, including one kept from a finished transform: see ``eager_call``)."""
    return t is None or not _functorch_wrapped(t)


def in_onnx_export() -> bool:
    """``torch.onnx.is_in_onnx_export()``, also where torch.onnx.export captures the model with Dynamo
    (its strict strategy), which folds that function to False: there the flag it reads is read directly."""
    if torch.compiler.is_compiling():
        flags = sys.modules.get("torch.onnx._internal.exporter._flags")
        return bool(getattr(flags, "_is_onnx_exporting", False))
    return torch.onnx.is_in_onnx_export()
