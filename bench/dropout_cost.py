"""What the fused dropout costs, on a GPU: the layer with and without it, against eager and
torch.compile of embedding + PE + ``nn.Dropout``.

    python bench/dropout_cost.py [--out DIR] [--p 0.1]
    python bench/dropout_cost.py --smoke                    # a tiny CPU run of the script (not a timing)

The fused dropout moves no extra bytes (the mask is computed, never stored), so its forward
should stay at the no-dropout time unless Philox's integer work (about 10 instructions per
bf16 element, docs/design.md) outgrows the memory time.  Eager dropout writes and reads the
output again and keeps a mask for backward.  Prints a table and writes dropout_cost.json.
Timings: CUDA events around one call, median of 20 after warmup, inputs rotated so the
table is not served from L2.  Random inputs, never zeros.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from datetime import date

import torch
from torch import nn

import posenc_fast as pf
from posenc_fast import benchmark
from posenc_fast._timing import median_ms
from posenc_fast.baselines import EagerSinusoidalEmbedding

SHAPES = [  # batch, seq_len, d_model, vocab, mode
    (16, 8192, 1024, 32768, "add"),
    (16, 8192, 1024, 32768, "concat"),
    (16, 4096, 4096, 262144, "add"),
]


class EagerWithDropout(nn.Module):
    def __init__(self, eager: EagerSinusoidalEmbedding, p: float):
        super().__init__()
        self.eager, self.dropout = eager, nn.Dropout(p)

    def forward(self, ids):
        return self.dropout(self.eager(ids))


SMOKE_SHAPES = [(2, 16, 64, 100, "add"), (2, 16, 72, 100, "concat")]


def _runners(shape, p, device, dtype, backends=("triton", "cuda"), compile_eager=True):
    batch, seq_len, d_model, vocab, mode = shape
    d_pos = benchmark.D_POS if mode == "concat" else None
    token_width = d_model - d_pos if d_pos else d_model
    g = torch.Generator(device=device).manual_seed(0)
    weight = nn.Parameter(torch.randn(vocab, token_width, device=device, dtype=dtype, generator=g))
    ids = [torch.randint(0, vocab, (batch, seq_len), device=device, generator=g) for _ in range(3)]
    grads = [torch.randn(batch, seq_len, d_model, device=device, dtype=dtype, generator=g) for _ in range(3)]
    scale = math.sqrt(d_model)
    runners = {}
    for backend in backends:
        if benchmark.impl_unavailable(backend, device) is None:
            for rate in (0.0, p):
                runners[f"{backend} p={rate:g}"] = pf.SinusoidalEmbedding.from_pretrained(
                    weight, mode=mode, d_pos=d_pos, embed_scale=scale, dropout=rate, backend=backend)
    eager = EagerSinusoidalEmbedding(vocab, d_model, mode=mode, d_pos=d_pos, max_len=seq_len, embed_scale=scale,
                                     device=device, dtype=dtype)
    eager.embed.weight = weight
    runners[f"eager p={p:g}"] = EagerWithDropout(eager, p)
    if compile_eager:
        runners[f"compile p={p:g}"] = torch.compile(EagerWithDropout(eager, p), dynamic=False)
    return runners, weight, ids, grads


def measure(shape, p, device, dtype, smoke=False):
    if smoke:
        runners, weight, ids, grads = _runners(shape, p, device, dtype, backends=("torch",), compile_eager=False)
    else:
        runners, weight, ids, grads = _runners(shape, p, device, dtype)
    batch, seq_len, d_model, vocab, mode = shape
    case = benchmark.Case("dropout", "headline", batch, seq_len, d_model, vocab, dtype=dtype, mode=mode)
    rows = []
    for name, module in runners.items():
        turn = [0]

        def forward():
            turn[0] += 1
            with torch.no_grad():
                return module(ids[turn[0] % 3])

        def step():
            turn[0] += 1
            weight.grad = None
            module(ids[turn[0] % 3]).backward(grads[turn[0] % 3])

        for op, fn in (("forward", forward), ("step", step)):
            ms = median_ms(fn, device, warmup=5, reps=20)
            moved = benchmark.bytes_moved(op, case)  # the floor's bytes: dropout adds none
            rows.append({"shape": list(shape), "impl": name, "op": op, "median_ms": ms, "bytes": moved,
                         "GBps": moved / ms / 1e6})
            print(f"{str(shape):40s} {name:16s} {op:8s} {ms:8.3f} ms {moved / ms / 1e6:8.0f} GB/s", flush=True)
        if name.startswith("compile"):
            torch.compiler.reset()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="posenc_fast-bench-results",
                        help="folder for dropout_cost.json (default: ./%(default)s, which .gitignore covers)")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, torch backend: checks the script")
    args = parser.parse_args(argv)
    if not 0.0 <= args.p < 1.0:
        parser.error(f"--p {args.p}: a dropout probability in [0, 1)")
    if args.smoke:
        device, dtype, shapes = torch.device("cpu"), torch.float32, SMOKE_SHAPES
    elif torch.cuda.is_available():
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, SHAPES
    else:
        print("dropout_cost.py measures on a GPU; none here (--smoke runs it on the CPU)", file=sys.stderr)
        return 2
    copy = benchmark.copy_bandwidth_GBps(device)
    print(f"{benchmark.device_name(device)}: copy bandwidth {copy:.0f} GB/s; p = {args.p}; {dtype}")
    rows = []
    for shape in shapes:
        rows += measure(shape, args.p, device, dtype, smoke=args.smoke)
    doc = {"what": "dropout's cost in the forward and a training step (bench/dropout_cost.py)",
           "device": benchmark.device_name(device), "torch": torch.__version__, "date": date.today().isoformat(),
           "copy_GBps": copy, "p": args.p, "dtype": str(dtype).replace("torch.", ""), "rows": rows}
    benchmark.write_document(os.path.join(args.out, "dropout_cost.json"), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
