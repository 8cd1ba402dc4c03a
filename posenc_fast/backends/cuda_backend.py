"""CUDA C++ backend: the kernels of csrc/ through ``posenc_fast._C`` (docs/cuda_backend.md); finding or building
the extension: ``_extension``.  Tests without a GPU load the kernels compiled for the host instead
(``use_host_emulation``), so that backend="cuda" runs on CPU tensors there."""

from __future__ import annotations

from typing import Optional

import torch

from . import Dropout, KernelParams, PreparedLaunch, _extension, current_stream, current_stream_function, new_buffer
from ._extension import Extension, Lookup
from ._extension import constant_under_compile as _constant_under_compile
from ._extension import gradient_arguments, gradient_inputs, pointer

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT64_MATH = True  # precision="float64": the kernels' float64 variant (longer polynomials, one rounding)

# Sorted tokens per stage-1 work item of the weight gradient; tests set small values so that
# runs of equal ids cross many chunk boundaries.
GRAD_CHUNK = 32

_MISSING = "backend='cuda' needs the compiled CUDA extension posenc_fast._C"
_BUILD_HINT = (
    "Build it: reinstall posenc_fast where the CUDA toolkit is installed (`pip install .` compiles csrc/ when "
    "nvcc is on PATH or CUDA_HOME is set; POSENC_FAST_BUILD_CUDA=1 makes a missing nvcc an error), or run "
    "`python -m posenc_fast._build` to compile it into the per-user cache. Or use backend='triton' or 'auto'."
)


_lookup = Lookup("_C", "cached_extension", _MISSING, _BUILD_HINT, build="build_in_cache",
                 needs=("find_nvcc", "package_source_dir"),
                 failure="backend='cuda': the CUDA extension is not installed and building it on demand failed")
# True while a host-emulation build of the kernels is loaded (tests without a GPU, see
# use_host_emulation): the backend then runs on CPU tensors, and only on them.
_host_emulation = False


def extension():
    """The loaded ``posenc_fast._C`` module, or None (``extension_problem()`` says why)."""
    return _lookup().module


def extension_problem() -> Optional[str]:
    """Why the extension cannot be used, or None when it is loaded."""
    return _lookup().problem


_reason_for_state = (None, None)  # (the Extension it was worked out for, _unusable_reason's answer)


@_constant_under_compile
def _unusable_reason() -> Optional[str]:
    """Why the backend cannot run on CUDA tensors, or None.  Asked on every call (a decoding step), so
    the answer is kept for as long as the lookup's outcome is the same object."""
    global _reason_for_state
    state = _lookup()
    if _reason_for_state[0] is state:
        return _reason_for_state[1]
    reason = state.problem
    if reason is None:
        count, why = state.module.device_status()
        if count == 0 or not torch.cuda.is_available():
            reason = f"backend='cuda' needs an NVIDIA GPU, and none is usable here ({why or 'torch sees no CUDA device'})"
    _reason_for_state = (state, reason)
    return reason


_arch_reasons = {}  # (id of the extension module, device index) -> (that module, _arch_problem's answer)


@_constant_under_compile
def _arch_problem(device: torch.device) -> Optional[str]:
    """Why the loaded extension holds no code for the GPU at ``device`` (its CUDA_ARCHS against the GPU's
    compute capability), or None; once per GPU.  ``auto`` then takes Triton instead of failing at launch
    ("no kernel image")."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    module = _lookup().module
    key = (id(module), index)
    if key not in _arch_reasons:
        from .. import _build

        built_for = getattr(module, "CUDA_ARCHS", "unknown")
        try:
            archs = _build.parse_cuda_archs(built_for)
        except ValueError:  # a build that does not record its archs: the launch decides
            archs = None
        reason = None
        if archs is not None:
            capability = tuple(torch.cuda.get_device_capability(index))
            if not _build.archs_cover(archs, capability):
                reason = (f"backend='cuda': the CUDA extension was built for {built_for}, which holds no code for "
                          f"this GPU ({torch.cuda.get_device_name(index)}, compute capability "
                          f"{capability[0]}.{capability[1]}): rebuild it with POSENC_FAST_CUDA_ARCHS="
                          f"\"{capability[0]}{capability[1]}\" (pip install . again, or python -m posenc_fast._build), "
                          f"or use backend='triton' or 'auto'")
        _arch_reasons[key] = (module, reason)  # the module kept alive, so that its id stays its own
    return _arch_reasons[key][1]


def available(device: torch.device) -> Optional[str]:
    """None if this backend can run on ``device``, else the reason it cannot and how to fix it."""
    if _host_emulation:
        return None if device.type == "cpu" else "backend='cuda' is in host-emulation mode (a test setting)"
    if device.type != "cuda":
        # Name the backend that runs there: the native CPU kernels for CPU tensors, else the torch op.
        other = "'cpu' (or 'auto')" if device.type == "cpu" else "'torch' (or 'auto')"
        return (f"backend='cuda' runs on CUDA tensors, but these are on {device.type!r}: move them to a GPU "
                f"(.cuda()), or use backend={other} for {device.type} tensors")
    return _unusable_reason() or _arch_problem(device)


def prepare(device: torch.device) -> None:
    """Before ``available`` when backend='cuda' is asked for by name: the on-demand build (``Lookup.prepare``),
    where a GPU could run it (else ``available`` explains)."""
    _lookup.prepare(device, "cuda", torch.cuda.is_available)


def use_host_emulation(path: Optional[str]) -> None:
    """Tests only: load the host-emulation build at ``path`` (``_build.build_host_emulation``), so
    that backend='cuda' runs the kernels' own code on CPU tensors; ``None`` switches back."""
    global _host_emulation
    if path is None:
        _lookup.state, _host_emulation = None, False
        return
    module = _extension.load_file("posenc_fast_host_emulation._C", path)
    if not module.HOST_EMULATION:
        raise ValueError(f"{path} is not a host-emulation build")
    _lookup.state, _host_emulation = Extension(module, None), True


def _launch_weight_grad(module, sorted_ids, order, grad_out, grad_weight, partials, padding_idx, embed_scale,
                        dropout: Optional[Dropout], chunk, stream: int, device: int) -> None:
    """One call into ``_C.weight_grad`` with every argument in the binding's order (tests call this with 0 tokens
    on CPU tensors to check the signature without a GPU: nothing is launched then)."""
    module.weight_grad(*gradient_arguments(module, "cuda", sorted_ids, order, grad_out, grad_weight, padding_idx,
                                           embed_scale, dropout), pointer(partials), int(chunk), stream, device)


def _stream_and_device(t: torch.Tensor):
    device = t.device
    if device.type != "cuda":  # host emulation: no stream, no device
        return 0, 0
    return current_stream(device), device.index


def prepare_forward(dtype, num_rows: int, device, turns, params: KernelParams) -> Optional[PreparedLaunch]:
    """``_C.ForwardLaunch`` bound to a table's dtype, row count and device and to ``params``
    (``posenc_fast._prepared``); None when the extension is missing.  (Host emulation on or off replaces the
    lookup's state: ``use_host_emulation``.)"""
    return _extension.prepare_forward(_lookup, "cuda", dtype, num_rows, turns, params,
                                      current_stream_function(device), device.index or 0)


def forward(ids, weight, turns, positions, offsets, offset, seq_len, params: KernelParams,
            dropout: Optional[Dropout]):
    return _extension.forward(_lookup, "cuda", ids, weight, turns, positions, offsets, offset, seq_len, params, dropout,
                              *_stream_and_device(weight))


def backward(grad_out, ids, num_embeddings, token_width, embed_scale, padding_idx, weight_dtype,
             dropout: Optional[Dropout]):
    grad_weight = torch.zeros((num_embeddings, token_width), dtype=weight_dtype, device=grad_out.device)
    num_tokens = ids.numel()
    if num_tokens == 0 or num_embeddings == 0 or token_width == 0:
        return grad_weight
    module, grad_out, sorted_ids, order = gradient_inputs(_lookup, grad_out, ids, num_embeddings, weight_dtype)
    chunk = max(int(GRAD_CHUNK), 1)
    partials = new_buffer(((num_tokens + chunk - 1) // chunk, 2, token_width), torch.float32, grad_out.device)
    stream, device = _stream_and_device(grad_out)
    _launch_weight_grad(module, sorted_ids, order, grad_out, grad_weight, partials, padding_idx, embed_scale, dropout,
                        chunk, stream, device)
    return grad_weight
