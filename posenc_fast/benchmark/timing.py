"""How the benchmark times: triton.testing.do_bench (GPU throughput), CUDA events one call at a time
(latency), perf_counter on CPU; the copy bandwidth and a step's peak memory."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, List, Optional, Sequence

import torch

from .._timing import cuda_event_times, median_ms


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Timing:
    median_ms: float
    spread_pct: Optional[float]  # (p80 - p20) / median, in %; None where not measured (CPU)


def _do_bench_times(fn: Callable, warmup_ms: int = 25, rep_ms: int = 200) -> List[float]:
    from triton.testing import do_bench

    times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return list(times) if isinstance(times, (list, tuple)) else [float(times)]


def _latency_times(fn: Callable, device: torch.device, reps: int = 200) -> List[float]:
    """One call per pair of events, the GPU idle before each: host overhead counts (decode)."""
    return cuda_event_times(fn, device, reps)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def time_op(fn: Callable, device: torch.device, *, latency: bool = False, warmup_calls: int = 3,
            cpu_reps: int = 5) -> Timing:
    """Median time of ``fn`` in ms after ``warmup_calls`` untimed calls (compile, autotune, JIT).
    On CPU (smoke runs) one warm-up call and ``cpu_reps`` timed ones."""
    if device.type != "cuda":
        return Timing(median_ms(fn, device, warmup=1, reps=cpu_reps), None)
    for _ in range(warmup_calls):
        fn()
    sync(device)
    times = sorted(_latency_times(fn, device) if latency else _do_bench_times(fn))
    median = statistics.median(times)
    spread = 100.0 * (_quantile(times, 0.8) - _quantile(times, 0.2)) / median if median > 0 else None
    return Timing(median, spread)


def copy_bandwidth_GBps(device: torch.device, nbytes: Optional[int] = None) -> float:
    """A large device-to-device copy of random data, counting bytes read plus bytes written."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.randn(nbytes // 4, device=device)  # random, never zeros
    dst = torch.empty_like(src)
    timing = time_op(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (timing.median_ms * 1e6)


def step_peak_bytes(step: Callable, weight: torch.nn.Parameter, device: torch.device) -> Optional[int]:
    """Peak memory one step allocates on top of what was allocated before it (inputs, weight)."""
    if device.type != "cuda":
        return None
    weight.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)
