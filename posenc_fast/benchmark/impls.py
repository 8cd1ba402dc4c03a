"""The implementations the benchmark compares, built over one case's random inputs: eager PyTorch,
torch.compile of it, and the fused backends; the callables each op times, and the agreement bar."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Optional

import torch

from .._dispatch import BACKENDS
from ..baselines import EagerSinusoidalEmbedding
from ..module import SinusoidalEmbedding
from .cases import IMPLS, FUSED_IMPLS, ID_BYTES, Case


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 32 << 20
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20))


def rotation_sets(case: Case, device: torch.device) -> int:
    """Input sets to cycle through: enough that the data of the sets together is 4x the L2 (up to
    8 sets), so that repeated runs do not time the cache; one set when it is that large already."""
    per_set = case.tokens * (ID_BYTES + 2 * case.d_model * case.dtype.itemsize)  # ids, output, grad_out
    target = 4 * _l2_bytes(device)
    return 1 if per_set >= target else min(8, math.ceil(target / per_set))


class CaseInputs:
    """Random inputs of one case: the weight table (N(0, 1)), and ``sets`` of ids (uniform over the
    whole vocabulary) and output gradients (N(0, 1)) to rotate through.  Never zeros."""

    def __init__(self, case: Case, device: torch.device, sets: int, seed: int = 0, need_grads: bool = True):
        g = torch.Generator(device=device).manual_seed(seed)
        self.weight = torch.randn(case.vocab, case.token_width, dtype=case.dtype, device=device, generator=g)
        shape = (case.batch, case.seq_len)
        self.ids = [torch.randint(0, case.vocab, shape, device=device, generator=g) for _ in range(sets)]
        self.grads = ([torch.randn(shape + (case.d_model,), dtype=case.dtype, device=device, generator=g)
                       for _ in range(sets)] if need_grads else [])


@dataclasses.dataclass
class Runner:
    """One implementation built for one case: ``module(ids)`` and the parameter it trains."""

    module: Callable
    weight: torch.nn.Parameter


# The native backends: the one device type each is timed on, and why not on another.
_TIMED_ON = {
    "triton": ("cuda", "Triton kernels are timed on a GPU only (on CPU they run in Triton's interpreter)"),
    # (a host-emulation build, which tests load, runs on CPU: not a timing)
    "cuda": ("cuda", "the CUDA backend is timed on a GPU only"),
    "cpu": ("cpu", "the CPU backend is timed on CPU only (--device cpu)"),
}


def impl_unavailable(impl: str, device: torch.device) -> Optional[str]:
    """None if ``impl`` can be timed on ``device``, else why not."""
    if impl not in IMPLS:
        return f"unknown implementation {impl!r}; expected one of {IMPLS}"
    if impl not in _TIMED_ON:
        return None
    device_type, why_not = _TIMED_ON[impl]
    return why_not if device.type != device_type else BACKENDS[impl].available(device)


def build_runner(impl: str, case: Case, inputs: CaseInputs, device: torch.device) -> Runner:
    """The implementation ``impl`` over ``inputs.weight`` (shared, not copied)."""
    weight = torch.nn.Parameter(inputs.weight)
    if impl in FUSED_IMPLS:
        module = SinusoidalEmbedding.from_pretrained(weight, mode=case.mode, d_pos=case.d_pos,
                                                     embed_scale=case.embed_scale, backend=impl)
        return Runner(module, module.weight)
    eager = EagerSinusoidalEmbedding(case.vocab, case.d_model, mode=case.mode, d_pos=case.d_pos,
                                     max_len=case.seq_len, embed_scale=case.embed_scale, device=device,
                                     dtype=case.dtype)
    eager.embed.weight = weight
    if impl == "eager":
        return Runner(eager, weight)
    mode = "max-autotune-no-cudagraphs" if impl == "compile-max-autotune" else None
    return Runner(torch.compile(eager, mode=mode, dynamic=False), weight)


def forward_fn(runner: Runner, inputs: CaseInputs) -> Callable[[], torch.Tensor]:
    sets = itertools.cycle(inputs.ids)

    def forward():
        with torch.no_grad():
            return runner.module(next(sets))

    return forward


def backward_fn(runner: Runner, inputs: CaseInputs) -> Callable[[], torch.Tensor]:
    """The weight gradient of one retained forward graph per input set (the graphs live as long as
    the returned function)."""
    pairs = [(runner.module(ids), grad) for ids, grad in zip(inputs.ids, inputs.grads)]
    cycle = itertools.cycle(pairs)
    weight = runner.weight

    def backward():
        out, grad = next(cycle)
        return torch.autograd.grad(out, (weight,), grad, retain_graph=True)[0]

    return backward


def step_fn(runner: Runner, inputs: CaseInputs) -> Callable[[], None]:
    cycle = itertools.cycle(list(zip(inputs.ids, inputs.grads)))
    weight = runner.weight

    def step():
        ids, grad = next(cycle)
        weight.grad = None  # as optimizer.zero_grad() does: the gradient is assigned, not accumulated
        runner.module(ids).backward(grad)

    return step


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, over chunks of rows of 2**24 elements (no full-size float64
    temporaries)."""
    a, b = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    rows = max(1, (1 << 24) // max(a.shape[1], 1))
    num = den = 0.0
    for start in range(0, a.shape[0], rows):
        x, y = a[start:start + rows].double(), b[start:start + rows].double()
        num += float(((x - y) ** 2).sum())
        den += float((y ** 2).sum())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def agreement_bar(dtype: torch.dtype) -> float:
    """Largest ||impl - eager|| / ||eager|| accepted.  bf16: a few outputs differ by one rounding, and
    eager's gradient rounds grad * scale to bf16 before summing.  fp32: eager forms its angles in fp32,
    which drift at large positions, small against sqrt(d)-scaled token values."""
    return 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3
