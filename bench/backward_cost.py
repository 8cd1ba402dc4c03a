"""Where the dense weight-gradient backward's time goes, and what the chunk length of its two kernels costs:
the headline case (d 1024, V 32768) at 65536 and 524288 tokens on each GPU backend (``cuda``, ``triton``) at
several ``GRAD_CHUNK`` values, beside the two steps around the kernels timed alone (the ids' sort, the
gradient's zero fill) and the byte floor.

    python bench/backward_cost.py [--out DIR] [--tokens 65536,524288] [--dtypes bfloat16,float32]
        [--chunks 32,64,128,256,512] [--reps 20]
    TRITON_INTERPRET=1 python bench/backward_cost.py --smoke   # a tiny run of the script on CPU (not a timing)

Bytes first (docs/performance.md, "The byte model"): the floor is N*T*e (grad_out) + 8N (ids) + V*T*e (the
gradient, written once).  Beyond it, the backward moves:
- the zero fill of the [V, T] gradient before the kernels write its touched rows (V*T*e, timed alone);
- the sort of the ids (int32 keys and an int64 permutation, several radix passes; timed alone, with the key
  ops before it);
- the kernels' own: the order and the sorted ids (12N), and the fp32 partial rows of the runs of equal ids
  that cross a chunk boundary, written by the first kernel and read by the second (counted here exactly from
  the sorted ids: ``partial_rows``); a longer chunk crosses fewer boundaries but gives fewer programs.
Each row's ``kernel_bytes`` is that prediction for the kernels (grad_out, order and ids, the touched rows, the
partials); ``kernels_ms`` is the backward less the sort and the zero fill timed alone (each sample is one
call on an idle GPU, so it holds the host's time to issue the launches too: at small token counts that is a
share of it).  Timed: the backward alone (``backend.backward``: sort, zero fill and both kernels), CUDA
events, the settings alternated rep by rep, random ids and gradients.  Each setting's gradient is checked
against the float64 sum first.  Prints a table and writes backward_cost.json (device, versions, date) under
``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from datetime import date

import torch

from posenc_fast import _dispatch
from posenc_fast._timing import median_ms
from posenc_fast.backends import sort_ids_for_gradient
from posenc_fast.benchmark.results import device_name, write_document
from posenc_fast.benchmark.timing import copy_bandwidth_GBps
from posenc_fast.cli import positive_int

HEADLINE = dict(width=1024, vocab=32768)
SMOKE = dict(tokens="300", width=48, vocab=40)
ID_BYTES = 8


def partial_rows(sorted_ids: torch.Tensor, chunk: int) -> int:
    """The fp32 partial rows the first kernel writes: per chunk, one for a first run that began in an earlier
    chunk and one for a last run that goes on into the next (one if both are the same run)."""
    n = sorted_ids.numel()
    starts = torch.arange(0, n, chunk, device=sorted_ids.device)
    ends = torch.clamp(starts + chunk, max=n) - 1
    crossed_start = (starts > 0) & (sorted_ids[(starts - 1).clamp(min=0)] == sorted_ids[starts])
    crossed_end = (ends + 1 < n) & (sorted_ids[(ends + 1).clamp(max=n - 1)] == sorted_ids[ends])
    one_run = sorted_ids[starts] == sorted_ids[ends]
    rows = crossed_start.sum() + crossed_end.sum() - (crossed_start & crossed_end & one_run).sum()
    return int(rows)


def _check(gradient, ids, grad_out, vocab, scale):
    exact = torch.zeros(vocab, grad_out.shape[1], dtype=torch.float64, device=grad_out.device)
    exact.index_add_(0, ids, grad_out.double() * scale)
    error = (gradient.double() - exact).abs().max().item()
    bound = 1e-2 if gradient.dtype != torch.float32 else 1e-4
    if not error <= bound * max(exact.abs().max().item(), 1.0):
        raise SystemExit(f"gradient off by {error:.3g} against the float64 sum")


def _time_case(report, device, n, width, vocab, dtype, backends, chunks, copy_GBps, reps):
    """One token count and dtype: the sort and zero fill alone, then every (backend, chunk) alternately."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, vocab, (n,), generator=g).to(device)
    grad_out = torch.randn(n, width, generator=g).to(device, dtype)
    sorted_ids, _ = sort_ids_for_gradient(ids, vocab)
    touched = int(torch.unique(ids).numel())
    scale, e = width ** 0.5, dtype.itemsize
    floor_bytes = n * width * e + ID_BYTES * n + vocab * width * e
    sort_ms = median_ms(lambda: sort_ids_for_gradient(ids, vocab), device, warmup=1, reps=reps)
    zero_ms = median_ms(lambda: torch.zeros(vocab, width, dtype=dtype, device=device), device, warmup=1, reps=reps)
    settings = [(name, chunk) for name in backends for chunk in chunks]

    def backward(name, chunk):
        module = _dispatch.BACKENDS[name]
        kept, module.GRAD_CHUNK = module.GRAD_CHUNK, chunk
        try:
            return module.backward(grad_out, ids, vocab, width, scale, -1, dtype, None)
        finally:
            module.GRAD_CHUNK = kept

    for setting in settings:  # compiled (Triton: a kernel per chunk length) and checked first
        _check(backward(*setting), ids, grad_out, vocab, scale)
    times = {setting: [] for setting in settings}
    for rep in range(reps):
        for setting in (settings if rep % 2 else settings[::-1]):
            times[setting].append(median_ms(lambda: backward(*setting), device, warmup=0, reps=1))
    floor_ms = floor_bytes / (copy_GBps * 1e6)
    print(f"\n{n} tokens ({touched} rows touched), {dtype}: floor {floor_bytes / 1e9:.3f} GB = {floor_ms:.3f} ms; "
          f"sort alone {sort_ms:.3f} ms, zero fill alone {zero_ms:.3f} ms")
    print(f"{'backend':8s} {'chunk':>6s} {'partial rows':>12s} {'kernel GB':>10s} {'backward ms':>12s} "
          f"{'% floor':>8s} {'kernels ms':>11s} {'kernels % copy':>15s}")
    for (name, chunk), samples in times.items():
        ms = statistics.median(samples)
        rows = partial_rows(sorted_ids, chunk)
        kernel_bytes = n * width * e + 12 * n + touched * width * e + 2 * rows * width * 4
        kernels_ms = ms - sort_ms - zero_ms
        kernels_pct = 100 * kernel_bytes / (copy_GBps * 1e6 * kernels_ms) if kernels_ms > 0 else float("nan")
        report["results"].append(dict(
            tokens=n, touched_rows=touched, dtype=str(dtype).removeprefix("torch."), backend=name, chunk=chunk,
            partial_rows=rows, floor_bytes=floor_bytes, kernel_bytes=kernel_bytes, backward_ms=round(ms, 4),
            sort_ms=round(sort_ms, 4), zero_fill_ms=round(zero_ms, 4), kernels_ms=round(kernels_ms, 4)))
        print(f"{name:8s} {chunk:6d} {rows:12d} {kernel_bytes / 1e9:10.3f} {ms:12.3f} "
              f"{100 * floor_ms / ms:7.1f}% {kernels_ms:11.3f} {kernels_pct:14.1f}%", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="posenc_fast-bench-results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="65536,524288")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--chunks", default="32,64,128,256,512")
    parser.add_argument("--reps", type=positive_int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one rep (the Triton interpreter on CPU)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke and not torch.cuda.is_available() else args.device)
    shape = SMOKE if args.smoke else dict(HEADLINE, tokens=args.tokens)
    width, vocab = shape["width"], shape["vocab"]
    reps = 1 if args.smoke else args.reps
    backends = [name for name in ("cuda", "triton") if _dispatch.BACKENDS[name].available(device) is None]
    if not backends:
        raise SystemExit(f"neither the cuda nor the triton backend runs on {device}")
    copy_GBps = copy_bandwidth_GBps(device)
    report = dict(what="dense weight-gradient backward by part and chunk length (bench/backward_cost.py)",
                  device=device_name(device), torch=torch.__version__, date=date.today().isoformat(),
                  width=width, vocab=vocab, copy_GBps=round(copy_GBps, 1), timed_region="backend.backward alone",
                  results=[])
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"{report['device']}: width {width}, V {vocab}; copy {copy_GBps:.0f} GB/s", flush=True)
    for n in (int(t) for t in shape["tokens"].split(",")):
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            _time_case(report, device, n, width, vocab, dtype, backends, [int(c) for c in args.chunks.split(",")],
                       copy_GBps, reps)
    path = os.path.join(args.out, "backward_cost.json")
    write_document(path, report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
