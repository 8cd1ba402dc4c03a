"""How the benchmark times: triton.testing.do_bench (GPU throughput; it flushes the L2 before every run,
and our own warm-up calls keep compilation, autotuning and JIT out of the numbers), CUDA events one call
at a time (latency), perf_counter on CPU; the floor bandwidth (GPU: a copy; CPU: a gather + write) and a
step's peak memory."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from .._timing import cuda_event_times


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Timing:
    median_ms: float
    spread_pct: Optional[float]  # (p80 - p20) / median, in %; None for a zero median


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def time_op(fn: Callable, device: torch.device, *, latency: bool = False) -> Timing:
    """Median time of ``fn`` in ms after 3 untimed calls (compile, autotune, JIT), and the spread.  GPU:
    do_bench, or with ``latency`` one call per pair of CUDA events, the GPU idle before each (host overhead
    counts, as in a decoding loop without CUDA graphs).  CPU: perf_counter around each call, as many calls
    as fit in about 0.5 s (5 to 200)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        sync(device)
        if latency:
            times = cuda_event_times(fn, device, 200)
        else:
            from triton.testing import do_bench

            times = do_bench(fn, warmup=25, rep=200, return_mode="all")
            times = list(times) if isinstance(times, (list, tuple)) else [float(times)]
    else:
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-6)
        times = []
        for _ in range(int(min(200, max(5, 0.5 / one)))):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times = sorted(times)
    median = statistics.median(times)
    return Timing(median, 100.0 * (_quantile(times, 0.8) - _quantile(times, 0.2)) / median if median > 0 else None)


def copy_bandwidth_GBps(device: torch.device) -> float:
    """The bandwidth the floor is measured against (a results file's ``copy_GBps``).  GPU: a 1 GiB
    device-to-device copy of random data, counting bytes read plus bytes written.  CPU: the gather
    + write of gather_bandwidth_GBps (a plain copy streams, which a row gather cannot)."""
    if device.type != "cuda":
        return gather_bandwidth_GBps(device)
    src = torch.randn((1 << 30) // 4, device=device)  # random, never zeros
    dst = torch.empty_like(src)
    timing = time_op(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (timing.median_ms * 1e6)


def gather_bandwidth_GBps(device: torch.device) -> float:
    """torch.index_select of 32768 random rows of a [65536, 512] fp32 table (larger than any last-level
    cache) into an output buffer: ids + gathered rows + output bytes over the time.  The forward's memory
    traffic (bytes_moved) without its arithmetic: the floor on CPU."""
    rows, width, tokens = 65536, 512, 32768
    g = torch.Generator(device=device).manual_seed(0)
    table = torch.randn(rows, width, device=device, generator=g)  # random, never zeros
    ids = torch.randint(0, rows, (tokens,), device=device, generator=g)
    out = torch.empty(tokens, width, device=device)  # reused: a fresh one per call would time page faults
    timing = time_op(lambda: torch.index_select(table, 0, ids, out=out), device)
    return (ids.numel() * ids.element_size() + 2 * tokens * width * 4) / (timing.median_ms * 1e6)


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
