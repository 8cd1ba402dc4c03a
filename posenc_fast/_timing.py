"""Median wall time of a callable: CUDA events on GPU, perf_counter on CPU."""

from __future__ import annotations

import statistics
import time
from typing import List

import torch


def cuda_event_times(fn, device: torch.device, reps: int) -> List[float]:
    """Milliseconds of ``reps`` single calls, each between two events with the GPU idle before it:
    what one call costs from the host starting to issue it until its last kernel ends."""
    times = []
    torch.cuda.synchronize(device)
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def median_ms(fn, device: torch.device, *, warmup: int = 3, reps: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        times = cuda_event_times(fn, device, reps)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
