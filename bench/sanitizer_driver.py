"""A small forward and weight-gradient workload of the GPU backends for compute-sanitizer
(bench/gpu_proof.sh): the shapes most likely to index out of bounds (odd widths, concat, partial token
and column blocks, padding, out-of-range ids with the id check off, offsets and explicit positions,
fused dropout, empty input), each compared with the torch backend.

    python bench/sanitizer_driver.py [cuda] [triton]        (default: both)

Exits 1 if any output or gradient differs from the torch backend's.
"""
import math
import sys

import torch

import posenc_fast
from posenc_fast import sinusoidal_embedding

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
backends = [b for b in sys.argv[1:] or ["cuda", "triton"]]
shapes = [  # vocab, d_model, (batch, seq), extra arguments
    (37, 33, (3, 17), {}),
    (1000, 256, (2, 129), {"mode": "concat", "d_pos": 64}),
    (5, 8, (1, 1), {}),
    (300, 1030, (4, 33), {"mode": "concat", "d_pos": 7, "layout": "split"}),
    (4097, 130, (2, 300), {"padding_idx": 0}),
    (64, 64, (0, 5), {}),
]
bad = 0
for backend, dtype in ((b, t) for b in backends for t in (torch.float32, torch.bfloat16, torch.float16)):
    bar = 1e-5 if dtype == torch.float32 else 1e-2
    for vocab, d_model, (batch, seq), extra in shapes:
        width = d_model - extra["d_pos"] if extra.get("mode") == "concat" else d_model
        kw = dict(extra, embed_scale=math.sqrt(d_model))
        w = torch.randn(vocab, width, device=dev, dtype=dtype, generator=g).requires_grad_()
        ids = torch.randint(0, vocab, (batch, seq), device=dev, generator=g)
        offsets = torch.randint(-2**20, 2**20, (batch,), device=dev, generator=g)
        positions = torch.randint(-2**30, 2**30, (batch, seq), device=dev, generator=g)
        # The last two add the fused dropout (its mask is Philox of a seed drawn on the device):
        # both backends draw the same seed after the same torch.manual_seed.
        for where in ({"offset": offsets}, {"positions": positions}, {"offset": offsets, "dropout_p": 0.1},
                      {"positions": positions, "dropout_p": 0.9}):
            torch.manual_seed(1)
            y = sinusoidal_embedding(ids, w, backend=backend, **where, **kw)
            gy = torch.randn(y.shape, device=dev, dtype=dtype, generator=g)
            gw = torch.autograd.grad(y, w, gy)[0] if y.numel() else torch.zeros_like(w)
            torch.manual_seed(1)
            y_ref = sinusoidal_embedding(ids, w, backend="torch", **where, **kw)
            gw_ref = torch.autograd.grad(y_ref, w, gy)[0] if y.numel() else torch.zeros_like(w)
            for name, a, b in (("output", y, y_ref), ("weight grad", gw, gw_ref)):
                err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                if not err <= bar:
                    bad += 1
                    print(f"MISMATCH {backend} {name} {dtype} vocab {vocab} d_model {d_model} {extra} {list(where)}: {err:.2e}")
        if ids.numel():
            with posenc_fast.id_check(False):  # out-of-range ids: zero token vector, no gradient, no stray access
                wild = ids.clone()
                wild.view(-1)[0] = vocab + 5
                wild.view(-1)[-1] = -3
                y = sinusoidal_embedding(wild, w, backend=backend, offset=offsets, **kw)
                torch.autograd.grad(y, w, torch.randn_like(y))
torch.cuda.synchronize()
print(f"sanitizer driver ({', '.join(backends)}): {'all agree with the torch backend' if not bad else f'{bad} MISMATCHES'}")
sys.exit(1 if bad else 0)
