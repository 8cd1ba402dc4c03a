"""Backend choice: the one place that maps ``backend=`` and a tensor's device/dtype to a backend module."""

from __future__ import annotations

import torch

from .backends import cpu_backend, cuda_backend, torch_backend, triton_backend

BACKENDS = {"torch": torch_backend, "triton": triton_backend, "cuda": cuda_backend, "cpu": cpu_backend}
# "auto" tries these in order for each device type: the native extension where it is built, then (on CUDA)
# Triton, then the torch reference.  Why the CUDA extension comes before Triton: docs/cuda_backend.md,
# "Choosing it".
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


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, float64_math: bool = False) -> str:
    """Name of the backend that will run, or a clear error why ``requested`` cannot."""
    if requested == "auto":
        for name in _AUTO_ORDER.get(device.type, _DEFAULT_AUTO):
            module = BACKENDS[name]
            usable = module.available(device) is None and dtype in module.SUPPORTED_DTYPES
            if usable and _float64_ok(module, float64_math):
                return name
        raise TypeError(f"no backend supports weight dtype {dtype} on {device}")
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
        raise TypeError(f"backend {requested!r} does not support weight dtype {dtype}; supported: {supported}")
    if not _float64_ok(module, float64_math):
        raise ValueError(f"backend {requested!r} does not implement precision='float64'; use backend='torch' or 'auto'")
    return requested
