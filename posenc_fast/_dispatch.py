"""Dispatch, the one place that decides how a call runs and where: eager, through a Function, the op or the
standard-ops form (``route`` and the predicates it asks, which depend on torch alone), and on which backend
module (``resolve_backend``: ``backend=`` and a tensor's device and dtype)."""

from __future__ import annotations

import sys

import torch
import torch.autograd.forward_ad as _forward_ad

from ._spec import dispatch_mode_depth
from .backends import cpu_backend, cuda_backend, torch_backend, triton_backend


def jit_tracing() -> bool:
    """Inside ``torch.jit.trace`` (and TorchScript's ONNX exporter, which traces)."""
    return not torch.compiler.is_compiling() and torch._C._is_tracing()  # (Dynamo cannot trace _is_tracing)


def eager_call(ids, weight) -> bool:
    """Whether the call may run the op's implementation without torch.library (its dispatcher and autograd
    wrapper: most of a decoding step's host time): eager, on plain tensors, with nothing tracing,
    transforming or intercepting it.  A tensor kept from a finished torch.func transform is still a functorch
    wrapper, though its type is ``torch.Tensor``: such a call takes the op, whose dispatcher unwraps it; so
    does a legacy-vmap batched tensor.
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
    (``grad``'s or ``vmap``'s, including one kept from a finished transform: see ``eager_call``) nor a
    legacy-vmap batched tensor (``torch.autograd.functional``'s vectorized forward-mode tangents)."""
    return t is None or not (_functorch_wrapped(t) or _legacy_batched(t))


def in_onnx_export() -> bool:
    """``torch.onnx.is_in_onnx_export()``, also where torch.onnx.export captures the model with Dynamo
    (its strict strategy), which folds that function to False: there the flag it reads is read directly."""
    if torch.compiler.is_compiling():
        flags = sys.modules.get("torch.onnx._internal.exporter._flags")
        return bool(getattr(flags, "_is_onnx_exporting", False))
    return torch.onnx.is_in_onnx_export()


# How a call runs (``route``):
RUN = "run"            # eager, nothing to differentiate: the op's implementation, directly
FUNCTION = "function"  # eager with autograd, forward-mode AD or torch.func: ops.EmbeddingFunction
OP = "op"              # traced (torch.compile, torch.export) or intercepted (a dispatch mode): the op
STANDARD_OPS = "standard"  # captured for another runtime (torch.onnx.export, jit.trace): the definition in
                           # standard torch ops (ops.standard_ops_forward)


def route(ids, weight, standard_ops_under_export: bool = False) -> str:
    """How a call with these tensors runs now (``RUN``, ``FUNCTION``, ``OP`` or ``STANDARD_OPS``), or
    a clear error for a transform that cannot be right.  ``standard_ops_under_export``: torch.export gets
    the standard-ops form too (a program that runs without posenc_fast)."""
    if eager_call(ids, weight):
        return FUNCTION if torch.is_grad_enabled() and weight.requires_grad else RUN
    if in_onnx_export() or jit_tracing():  # ONNX and TorchScript have no fused op: the math in standard ops
        return STANDARD_OPS
    if standard_ops_under_export and torch.compiler.is_exporting():
        return STANDARD_OPS
    if torch.compiler.is_compiling():
        # Traced code (torch.compile, torch.export) gets the op, but for torch.func's transforms and forward-mode
        # AD, which its autograd formula does not serve (torch would drop a tangent silently).
        if not torch._C._are_functorch_transforms_active() and _forward_ad._current_level < 0:
            return OP
    elif dispatch_mode_depth():  # a dispatch mode sees only the dispatcher's ops
        return OP
    if torch._C._are_functorch_transforms_active():
        _check_function_transforms()
        return FUNCTION
    if _forward_ad._current_level >= 0:  # inside forward_ad.dual_level(): an input may carry a tangent
        return FUNCTION
    return OP  # tensor subclasses (a FakeTensor outside its mode, DTensor...): through the dispatcher


def _check_function_transforms() -> None:
    """torch.func's grad, vjp, jacrev, jvp, jacfwd, hessian and vmap (per-sample gradients) are
    supported (``ops.EmbeddingFunction``); refuse anything else clearly."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    supported = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp,
                 torch._C._functorch.TransformType.Vmap)
    for interpreter in retrieve_all_functorch_interpreters():
        kind = interpreter.key()
        if kind not in supported:
            raise RuntimeError(
                f"posenc_fast does not support the torch.func transform {kind.name}; supported are grad, vjp, "
                "jacrev, jvp, jacfwd, hessian and vmap")


BACKENDS = {"torch": torch_backend, "triton": triton_backend, "cuda": cuda_backend, "cpu": cpu_backend}
# What "auto" tries, in order, per device type (why cuda before triton: docs/cuda_backend.md, "Choosing it").
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}
_DEFAULT_AUTO = ("torch",)


def get_backend(name: str):
    return BACKENDS[name]


def check_backend_name(requested) -> None:
    if requested == "auto" or (isinstance(requested, str) and requested in BACKENDS):
        return
    raise ValueError(f"unknown backend {requested!r}; expected 'auto' or one of {tuple(BACKENDS)}")


def _float64_ok(module, float64_math: bool) -> bool:
    return not float64_math or getattr(module, "FLOAT64_MATH", False)


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, float64_math: bool = False,
                    tensor: str = "weight") -> str:
    """Name of the backend that will run, or a clear error why ``requested`` cannot (``tensor``: what the
    messages call the tensor of ``dtype``)."""
    if requested == "auto":
        for name in _AUTO_ORDER.get(device.type, _DEFAULT_AUTO):
            module = BACKENDS[name]
            usable = module.available(device) is None and dtype in module.SUPPORTED_DTYPES
            if usable and _float64_ok(module, float64_math):
                return name
        raise TypeError(f"no backend supports {tensor} dtype {dtype} on {device}")
    check_backend_name(requested)
    module = BACKENDS[requested]
    prepare = getattr(module, "prepare", None)  # a backend asked for by name may get ready first (cuda: build)
    if prepare is not None:
        prepare(device)
    reason = module.available(device)
    if reason is not None:
        raise RuntimeError(reason)
    if dtype not in module.SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in module.SUPPORTED_DTYPES)
        raise TypeError(f"backend {requested!r} does not support {tensor} dtype {dtype}; supported: {supported}")
    if not _float64_ok(module, float64_math):
        raise ValueError(f"backend {requested!r} does not implement precision='float64'; use backend='torch' or 'auto'")
    return requested
