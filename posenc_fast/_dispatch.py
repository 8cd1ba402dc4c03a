"""Backend choice: the one place that maps ``backend=`` and a tensor's device/dtype to a backend module."""

from __future__ import annotations

import torch

from .backends import torch_backend, triton_backend

BACKENDS = {"torch": torch_backend, "triton": triton_backend}
# "auto" tries these in order for each device type.
_AUTO_ORDER = {"cuda": ("triton", "torch")}
_DEFAULT_AUTO = ("torch",)


def get_backend(name: str):
    return BACKENDS[name]


def check_backend_name(requested) -> None:
    if requested == "auto" or (isinstance(requested, str) and requested in BACKENDS):
        return
    if requested == "cuda":
        raise ValueError("backend='cuda' (the CUDA C++ backend) is not part of this build yet; use 'triton' or 'torch'")
    raise ValueError(f"unknown backend {requested!r}; expected 'auto' or one of {tuple(BACKENDS)}")


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Name of the backend that will run, or a clear error why ``requested`` cannot."""
    if requested == "auto":
        for name in _AUTO_ORDER.get(device.type, _DEFAULT_AUTO):
            module = BACKENDS[name]
            if module.available(device) is None and dtype in module.SUPPORTED_DTYPES:
                return name
        raise TypeError(f"no backend supports weight dtype {dtype} on {device}")
    check_backend_name(requested)
    module = BACKENDS[requested]
    reason = module.available(device)
    if reason is not None:
        raise RuntimeError(reason)
    if dtype not in module.SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in module.SUPPORTED_DTYPES)
        raise TypeError(f"backend {requested!r} does not support weight dtype {dtype}; supported: {supported}")
    return requested
