"""CPU backend: the C++ kernels of csrc/cpu/ through ``posenc_fast._cpu`` (docs/cpu_backend.md); finding or
building the extension: ``_extension``.  Without it, ``backend="auto"`` runs the torch backend."""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import Dropout, KernelParams, PreparedLaunch, _extension, new_buffer
from ._extension import Lookup
from ._extension import constant_under_compile as _constant_under_compile
from ._extension import gradient_arguments, gradient_inputs

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT64_MATH = True  # precision="float64": float64 arithmetic and polynomials, one rounding

_MISSING = "backend='cpu' needs the compiled extension posenc_fast._cpu"
_BUILD_HINT = (
    "Build it: reinstall posenc_fast where a C++ compiler is installed (`pip install .` compiles csrc/cpu/ "
    "when c++, g++ or clang++ is on PATH; POSENC_FAST_BUILD_CPU=1 makes a missing compiler an error), or call "
    "backend='cpu' once with a compiler present (it builds into the per-user cache). Or use backend='torch' or "
    "'auto'."
)


_forked_child = False  # this process is a forked child (_after_fork_in_child)


def _pool_in_a_forked_child(module) -> None:
    if _forked_child:
        module.set_threading("pool")


def _after_fork_in_child() -> None:
    """A forked child runs the kernels on the binding's own thread pool: a team of the parent's OpenMP runtime
    does not survive fork and would hang it.  The binding notices a fork after its own first kernel call; this
    covers an extension loaded, or first used, only in the child (the parent ran only torch's threaded ops)."""
    global _forked_child
    _forked_child = True
    state = _lookup.state
    if state is not None and state.module is not None:
        _pool_in_a_forked_child(state.module)


_lookup = Lookup("_cpu", "cached_cpu_extension", _MISSING, _BUILD_HINT, on_load=_pool_in_a_forked_child,
                 build="build_cpu_in_cache", needs=("find_cxx", "cpu_source_dir"),
                 failure="backend='cpu': the CPU extension is not installed and building it on demand failed")
if hasattr(os, "register_at_fork"):  # (not on Windows, which has no fork)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def extension():
    """The loaded ``posenc_fast._cpu`` module, or None (``extension_problem()`` says why)."""
    return _lookup().module


@_constant_under_compile  # torch.compile asks once while tracing, instead of tracing the lookup
def extension_problem() -> Optional[str]:
    """Why the extension cannot be used, or None when it is loaded."""
    return _lookup().problem


def build_on_demand() -> Optional[str]:
    """Build the extension into the per-user cache if it is missing and load it; None when it is loaded, else
    why not.  Used by ``prepare`` and by tests from a source checkout."""
    return _lookup.build_on_demand()


def prepare(device: torch.device) -> None:
    """Before ``available`` when backend='cpu' is asked for by name: the on-demand build (``Lookup.prepare``)."""
    _lookup.prepare(device, "cpu")


def available(device: torch.device) -> Optional[str]:
    """None if this backend can run on ``device``, else the reason it cannot and how to fix it."""
    if device.type != "cpu":
        others = "'cuda', 'triton'" if device.type == "cuda" else "'torch'"
        return (f"backend='cpu' runs on CPU tensors, but these are on {device.type!r}: use backend='auto' "
                f"(or {others}) for {device.type} tensors")
    return extension_problem()


def prepare_forward(dtype, num_rows: int, device, turns, params: KernelParams) -> Optional[PreparedLaunch]:
    """``_cpu.ForwardLaunch`` bound to a table's dtype and row count and to ``params``, with the binding's id
    scan (``posenc_fast._prepared``); None when the extension is missing."""
    return _extension.prepare_forward(_lookup, "cpu", dtype, num_rows, turns, params, torch.get_num_threads)


def forward(ids, weight, turns, positions, offsets, offset, seq_len, params: KernelParams,
            dropout: Optional[Dropout]):
    return _extension.forward(_lookup, "cpu", ids, weight, turns, positions, offsets, offset, seq_len, params, dropout,
                              torch.get_num_threads())


def backward(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype,
             dropout: Optional[Dropout]):
    num_tokens = ids.numel()
    if num_tokens == 0 or num_embeddings == 0 or token_width == 0:
        return torch.zeros((num_embeddings, token_width), dtype=weight_dtype, device=grad_out.device)
    # Not zero-filled here: the kernel writes every row, zeros in parallel (csrc/cpu/cpu_kernels.cpp).
    grad_weight = new_buffer((num_embeddings, token_width), weight_dtype, grad_out.device)
    module, grad_out, sorted_ids, order = gradient_inputs(_lookup, grad_out, ids, num_embeddings, weight_dtype)
    module.weight_grad(*gradient_arguments(module, "cpu", sorted_ids, order, grad_out, grad_weight, padding_idx,
                                           embed_scale, dropout), torch.get_num_threads())
    return grad_weight
