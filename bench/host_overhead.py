"""Host (Python) time per call of the layer with the kernel stubbed out, on any machine.

    python bench/host_overhead.py

Decoding calls the layer with a handful of tokens, so the host path, not the GPU, sets its
speed.  This isolates that path: the torch backend's forward is replaced by a stub that returns
a preallocated tensor, so what is timed is validation, dispatch and the op's own Python.
"""

import time

import torch

import posenc_fast as pf
from posenc_fast import baselines, functional
from posenc_fast.backends import torch_backend


def per_call_us(fn, calls=3000, warmup=200):
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    layer = pf.SinusoidalEmbedding(32768, 64)
    ids = torch.randint(0, 32768, (64, 1))
    stub = torch.empty(64, 64)
    torch_backend.forward = lambda *args, **kwargs: stub
    direct = functional._eager_inference
    with torch.no_grad():
        for label, eager_path in (("through torch.library", False), ("direct (eager inference)", True)):
            functional._eager_inference = (lambda *a: eager_path) if not eager_path else direct
            on = per_call_us(lambda: layer(ids, offset=17))
            with pf.id_check(False):
                off = per_call_us(lambda: layer(ids, offset=17))
            print(f"{label:28s} id check on {on:6.1f} us   off {off:6.1f} us")
        functional._eager_inference = direct
        eager = baselines.EagerSinusoidalEmbedding(32768, 64, max_len=8)
        print(f"{'eager module, whole forward':28s} {per_call_us(lambda: eager(ids)):6.1f} us (CPU, compute included)")


if __name__ == "__main__":
    main()
