"""CPU benchmark of the fused layer (issue 16): the native ``cpu`` backend against eager PyTorch and
torch.compile of the same eager function, at 1, 2, ... all cores, every ratio from one run.

    python bench/cpu_bench.py                       # writes bench/results/cpu-<cpu-slug>.json
    python bench/cpu_bench.py --rounds 7 --out x.json --threads 1,2

Case (the issue's): ids [8, 512] (4096 tokens), d_model 512, vocab 32000, fp32 table, embed scale
sqrt(d_model), positions 0..511 in each sequence.

Implementations:
  eager          posenc_fast.baselines.EagerSinusoidalEmbedding: nn.Embedding, fp32 sinusoid table
                 buffer, scale, add (inexact angles beyond 2^24 positions; not the same semantics)
  compile        torch.compile(eager, dynamic=False), compiled afresh for every thread count
  cpu            SinusoidalEmbedding(..., backend="cpu"), offset 0 (one PE row per distinct position)
  cpu-offsets    the same with per-sequence offsets (a tensor): every token's PE computed on its own,
                 the cost of an arbitrary position per token
  torch          SinusoidalEmbedding(..., backend="torch"): the float64 reference op, which ``auto``
                 ran on CPU before this backend (timed with fewer calls: it is slow)

Ops: ``forward`` under torch.no_grad(); ``step`` = forward + backward (out.backward(grad_out),
then the weight's .grad dropped).  Timing: wall clock (perf_counter); for each thread count, R
rounds, each timing every implementation in turn (median of N calls after warm-up calls), and the
row's time is the median over rounds.  The machine's load average is recorded before and after:
on a shared machine the ratios are what to read, the absolute times drift.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source checkout

from posenc_fast import SinusoidalEmbedding  # noqa: E402
from posenc_fast.backends import cpu_backend  # noqa: E402
from posenc_fast.baselines import EagerSinusoidalEmbedding  # noqa: E402

BATCH, SEQ_LEN, D_MODEL, VOCAB = 8, 512, 512, 32000
IMPLS = ("eager", "compile", "cpu", "cpu-offsets", "torch")
OPS = ("forward", "step")
# (op, implementation compared with, minimum speedup of "cpu"): the targets.
TARGETS = (("forward", "eager", 2.0), ("forward", "compile", 1.0), ("step", "eager", 1.5))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def load_average():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def compiler_version() -> str:
    from posenc_fast import _build

    cxx = _build.find_cxx()
    if cxx is None:
        return "none"
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else cxx


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


class Inputs:
    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=g)
        self.offsets = torch.zeros(BATCH, dtype=torch.int64)
        self.grad_out = torch.randn(BATCH, SEQ_LEN, D_MODEL, generator=g)
        self.table = torch.randn(VOCAB, D_MODEL, generator=g)


def make_impls(inputs: Inputs):
    """name -> (module, call(module) -> output); all share one table's values."""
    scale = math.sqrt(D_MODEL)
    eager = EagerSinusoidalEmbedding(VOCAB, D_MODEL, embed_scale=scale, max_len=SEQ_LEN)
    eager.embed.weight.data.copy_(inputs.table)
    compiled_module = EagerSinusoidalEmbedding(VOCAB, D_MODEL, embed_scale=scale, max_len=SEQ_LEN)
    compiled_module.embed.weight.data.copy_(inputs.table)
    compiled = torch.compile(compiled_module, dynamic=False)
    fused = SinusoidalEmbedding(VOCAB, D_MODEL, embed_scale=scale, backend="cpu")
    fused.weight.data.copy_(inputs.table)
    reference = SinusoidalEmbedding(VOCAB, D_MODEL, embed_scale=scale, backend="torch")
    reference.weight.data.copy_(inputs.table)
    ids, offsets = inputs.ids, inputs.offsets
    return {
        "eager": (eager, lambda: eager(ids)),
        "compile": (compiled_module, lambda: compiled(ids)),
        "cpu": (fused, lambda: fused(ids)),
        "cpu-offsets": (fused, lambda: fused(ids, offset=offsets)),
        "torch": (reference, lambda: reference(ids)),
    }


def op_fn(op: str, module, call, grad_out):
    if op == "forward":
        def forward():
            with torch.no_grad():
                call()
        return forward

    def step():
        call().backward(grad_out)
        for p in module.parameters():
            p.grad = None
    return step


def median_ms(fn, calls: int, warmup: int):
    """(median wall ms, median process CPU ms) of ``calls`` calls; CPU time sums the threads, and is
    what a call costs when other jobs share the machine (wall time then includes waiting for a core)."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(calls):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def measure(threads: int, rounds: int, calls: int, inputs: Inputs, impls_wanted, log):
    torch.set_num_threads(threads)
    torch._dynamo.reset()  # Inductor's CPU kernels take their thread count when compiled
    impls = make_impls(inputs)
    rows = []
    for op in OPS:
        fns = {name: op_fn(op, *impls[name], inputs.grad_out) for name in impls_wanted}
        per_round = {name: [] for name in fns}
        cpu_round = {name: [] for name in fns}
        for name, fn in fns.items():  # compile and warm up everything before the first timed round
            for _ in range(3):
                fn()
        for r in range(rounds):
            for name, fn in fns.items():
                slow = name == "torch"
                wall, cpu = median_ms(fn, max(3, calls // 10) if slow else calls, 1 if slow else 2)
                per_round[name].append(wall)
                cpu_round[name].append(cpu)
        for name, values in per_round.items():
            row = {"threads": threads, "op": op, "impl": name, "ms": statistics.median(values), "ms_min": min(values),
                   "ms_rounds": [round(v, 4) for v in values], "cpu_ms": statistics.median(cpu_round[name])}
            rows.append(row)
            print(f"threads {threads}  {op:<8} {name:<12} {row['ms']:9.3f} ms  cpu {row['cpu_ms']:8.3f} ms  (min {row['ms_min']:.3f}; "
                  f"rounds {', '.join(f'{v:.3f}' for v in values)})", file=log, flush=True)
    return rows


def ratios(rows):
    """Speedup of each implementation over each baseline, per (threads, op): baseline ms / impl ms (wall
    time; also in process CPU time and from each side's fastest round)."""
    out = []
    by_key = {(r["threads"], r["op"], r["impl"]): r for r in rows}
    for (threads, op, impl), row in by_key.items():
        if not impl.startswith("cpu"):
            continue
        for base in ("eager", "compile", "torch"):
            if (threads, op, base) in by_key:
                other = by_key[(threads, op, base)]
                out.append({"threads": threads, "op": op, "impl": impl, "vs": base,
                            "speedup": round(other["ms"] / row["ms"], 3),
                            "speedup_cpu_time": round(other["cpu_ms"] / row["cpu_ms"], 3),
                            "speedup_best_rounds": round(other["ms_min"] / row["ms_min"], 3)})
    return out


def targets(speedups, all_threads):
    out = []
    for op, base, minimum in TARGETS:
        for s in speedups:
            if s["op"] == op and s["vs"] == base and s["impl"] == "cpu":
                out.append({"op": op, "vs": base, "threads": s["threads"], "minimum": minimum,
                            "speedup": s["speedup"], "speedup_cpu_time": s["speedup_cpu_time"],
                            "met": s["speedup"] >= minimum,
                            "headline": s["threads"] == all_threads})
    return out


def accuracy(inputs: Inputs) -> dict:
    """The fused forward against the float64 reference op on this case (a sanity check; tests/ owns accuracy)."""
    impls = make_impls(inputs)
    with torch.no_grad():
        fused = impls["cpu"][1]()
        exact = SinusoidalEmbedding(VOCAB, D_MODEL, embed_scale=math.sqrt(D_MODEL), backend="torch",
                                    dtype=torch.float64)
        exact.weight.data.copy_(inputs.table.double())
        reference = exact(inputs.ids)
        eager = impls["eager"][1]()
    return {"cpu_max_abs_err_vs_float64": float((fused.double() - reference).abs().max()),
            "eager_max_abs_err_vs_float64": float((eager.double() - reference).abs().max())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1, 2, all cores)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30, help="timed calls per round (torch: a tenth)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--out", default=None, help="JSON path (default: bench/results/cpu-<cpu-slug>.json)")
    args = parser.parse_args(argv)

    problem = cpu_backend.build_on_demand()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    cores = os.cpu_count() or 1
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({1, min(2, cores), cores}))
    impls_wanted = [i.strip() for i in args.impls.split(",") if i.strip()]
    model = cpu_model()
    load_before = load_average()
    print(f"posenc_fast CPU benchmark on {model} ({cores} cores, kernels: {cpu_backend.extension().isa()}); "
          f"load average {load_before}", file=sys.stderr, flush=True)
    inputs = Inputs()
    rows = []
    for n in threads:
        rows += measure(n, args.rounds, args.calls, inputs, impls_wanted, sys.stderr)
    torch.set_num_threads(cores)
    speedups = ratios(rows)
    doc = {
        "benchmark": "posenc_fast CPU (bench/cpu_bench.py)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": model,
        "cores": cores,
        "kernel_isa": cpu_backend.extension().isa(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "compiler": compiler_version(),
        "commit": git_commit(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "case": {"ids_shape": [BATCH, SEQ_LEN], "d_model": D_MODEL, "vocab": VOCAB, "dtype": "float32",
                 "embed_scale": math.sqrt(D_MODEL), "positions": "0..511 per sequence"},
        "timing": {"clock": "perf_counter wall time (ms); cpu_ms: process CPU time, all threads", "rounds": args.rounds,
                   "calls_per_round": args.calls, "row_ms": "median over rounds of the per-round median",
                   "targets": "met/missed from the wall-time speedup"},
        "accuracy": accuracy(inputs),
        "rows": rows,
        "speedups": speedups,
        "targets": targets(speedups, max(threads)),
    }
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"cpu-{slug(model)}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"\nwrote {path}", file=sys.stderr)
    for t in doc["targets"]:
        print(f"  {t['op']:<8} cpu vs {t['vs']:<8} at {t['threads']} threads: {t['speedup']:.2f}x wall, "
              f"{t['speedup_cpu_time']:.2f}x CPU time (target >= {t['minimum']}x): {'met' if t['met'] else 'MISSED'}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
