"""What ``sparse=True`` saves where the vocabulary is wide: the weight gradient of one training step,
dense against sparse, fused against ``nn.Embedding``, on a wide table (V 262144, d 4096).

    python bench/sparse_gradient_cost.py [--out DIR] [--device cpu|cuda] [--tokens 4096,16384,65536]
        [--dtype float32|bfloat16]
    python bench/sparse_gradient_cost.py --smoke       # a tiny run of the script (not a timing)

Bytes first: a dense fp32 gradient is V * d * 4 = 4 GiB to allocate and zero (page faults on CPU) whatever
the batch; a sparse one is N * d * 4 for N tokens (one entry per token, as nn.Embedding's). Timed: the backward alone (a
fresh ``.grad`` each time, as after ``zero_grad(set_to_none=True)``), median of ``--reps`` after a warmup,
fused and nn.Embedding alternating rep by rep, random ids and tables (never zeros). With several token
counts the table shows whether the cost tracks the tokens (sparse: it should, from near zero; dense: on top
of the fixed allocate-and-zero, timed alone as the ``zero-fill`` row). Prints a table and writes
sparse_gradient_cost.json (device, versions, date) under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from datetime import date

import torch

import posenc_fast as pf
from posenc_fast._timing import median_ms
from posenc_fast.benchmark.results import device_name, write_document
from posenc_fast.cli import positive_int

WIDE = dict(vocab=262144, d_model=4096)
SMOKE = dict(vocab=1000, d_model=64)


def _timed_backwards(pairs, grad_out, device, reps):
    """Median ms of each backward in ``pairs`` ((make_output, leaf) each), timed alternately rep by rep, so that
    a shared machine's drift falls on every implementation alike."""
    steps = []
    for make_output, leaf in pairs:
        out = make_output()  # the forward once, outside the timed region: the backward alone is timed

        def step(out=out, leaf=leaf):
            leaf.grad = None
            out.backward(grad_out, retain_graph=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        step()  # warmup
        steps.append(step)
    times = [[] for _ in steps]
    for rep in range(reps):
        for k in (range(len(steps)) if rep % 2 else reversed(range(len(steps)))):
            times[k].append(median_ms(steps[k], device, warmup=0, reps=1))
    return [statistics.median(t) for t in times]


def _profile(module, ids, grad_out, device, title):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        module.weight.grad = None
        module(ids).backward(grad_out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"profile, {title}:\n{prof.key_averages().table(sort_by=sort_by, row_limit=12)}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="posenc_fast-bench-results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="4096", help="comma-separated token counts, each as batch 8 x tokens/8")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--reps", type=positive_int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler's top ops (host and device time) of one fused step per sparse "
                             "setting at the first token count: where a fixed cost goes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = SMOKE if args.smoke else WIDE
    vocab, width = shape["vocab"], shape["d_model"]
    g = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, width, generator=g).to(device, dtype)
    reps = 1 if args.smoke else args.reps
    rows = []
    zero_ms = median_ms(lambda: torch.zeros(vocab, width, device=device, dtype=dtype), device, warmup=1, reps=reps)
    rows.append(dict(impl="zero-fill", sparse=False, tokens=0, backward_ms=round(zero_ms, 3)))
    print(f"zero-fill of the dense [{vocab}, {width}] {args.dtype} gradient alone: {zero_ms:9.3f} ms", flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = torch.randint(0, vocab, (8, max(tokens // 8, 1)), generator=g).to(device)
        grad_out = torch.randn(*ids.shape, width, generator=g).to(device, dtype)
        distinct = int(torch.unique(ids).numel())
        for sparse in (False, True):
            fused = pf.SinusoidalEmbedding.from_pretrained(table, sparse=sparse, embed_scale=width ** 0.5)
            eager = torch.nn.Embedding.from_pretrained(table, freeze=False, sparse=sparse)
            timed = _timed_backwards([(lambda: fused(ids), fused.weight),
                                      (lambda: eager(ids) * width ** 0.5, eager.weight)], grad_out, device, reps)
            for impl, ms in zip(("fused", "nn.Embedding"), timed):
                rows.append(dict(impl=impl, sparse=sparse, tokens=ids.numel(), distinct_ids=distinct,
                                 backward_ms=round(ms, 3)))
                print(f"{ids.numel():8d} tokens  {impl:13s} sparse={sparse!s:5s}  backward {ms:9.3f} ms", flush=True)
            if args.profile and tokens == int(args.tokens.split(",")[0]):
                _profile(fused, ids, grad_out, device, f"fused, sparse={sparse}, {ids.numel()} tokens")
    report = dict(
        what="weight-gradient backward, dense vs sparse (bench/sparse_gradient_cost.py)",
        device=device_name(device),
        torch=torch.__version__, date=date.today().isoformat(), vocab=vocab, d_model=width, dtype=args.dtype,
        dense_gradient_bytes=vocab * width * dtype.itemsize, timed_region="the backward alone",
        sparse_format="one entry per token, uncoalesced (nn.Embedding's)", rows=rows)
    path = os.path.join(args.out, "sparse_gradient_cost.json")
    write_document(path, report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
