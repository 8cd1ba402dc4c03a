"""The CPU layer timed as it runs inside a model, not only alone.

Case: V 32000, d 512, 8 x 512 tokens, fp32, embed scale sqrt(d), loss = out.sum().  Four ways to run it,
all timed round-robin in one process (each repetition runs every implementation once, in a rotating order,
so that a noisy second hits all of them alike):

- ``back_to_back``: one implementation's forward right after its own (its table rows stay in cache: the
  best case, what a micro-benchmark of the layer alone shows), the timed pairs interleaved across
  implementations like the rest;
- ``forward``: the forward inside the round-robin, after the other implementations ran (cold caches,
  other work's threads: what a layer inside a model meets);
- ``forward after a GEMM``: a 512 x 512 ``torch.mm`` right before each forward, as between layers
  (torch's intra-op threads are still busy or spinning when the layer starts); only the forward is
  timed, the GEMM's own time is measured apart in the same run;
- ``training step``: forward, ``out.sum().backward()``, gradient set to None (what
  ``optimizer.zero_grad()`` does), so every step allocates its V x d gradient, as in training.

Implementations: ``fused`` (posenc_fast, ``auto`` -> cpu), ``compile`` (torch.compile of the eager
module), ``eager`` (posenc_fast.baselines.EagerSinusoidalEmbedding).  For scale, the plain torch op in the
same run: the gather (``index_select``) and, for the step, a fresh V x d gradient filled by ``index_add_``.
The fused kernels can beat both (the step's gradient, for one, is allocated in huge pages).

    python bench/cpu_in_context.py [--repeats 30] [--json bench/results/cpu-in-context-<cpu>.json]
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time

import torch

import posenc_fast as pf
from posenc_fast.baselines import EagerSinusoidalEmbedding
from posenc_fast.benchmark.results import cpu_model, device_slug, write_document
from posenc_fast.cli import positive_int

V, D, BATCH, LENGTH = 32000, 512, 8, 512
# Back to back, per repetition and implementation: calls that restore its own cache state after the others
# ran, then the timed calls.
BACK_TO_BACK_WARMUP, BACK_TO_BACK_TIMED = 2, 3


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    scale = math.sqrt(D)
    ids = torch.randint(0, V, (BATCH, LENGTH))
    fused = pf.SinusoidalEmbedding(V, D, embed_scale=scale)
    eager = EagerSinusoidalEmbedding(V, D, embed_scale=scale, max_len=LENGTH)
    with torch.no_grad():
        eager.embed.weight.copy_(fused.weight)
    compiled = torch.compile(eager)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    flat = ids.reshape(-1)
    grad_rows = torch.randn(flat.numel(), D)

    modules = {"fused": fused, "compile": compiled, "eager": eager}
    weights = {"fused": fused.weight, "compile": eager.embed.weight, "eager": eager.embed.weight}

    def forward(name):
        with torch.no_grad():
            return modules[name](ids)

    def step(name):
        modules[name](ids).sum().backward()
        weights[name].grad = None

    def gather():
        return fused.weight.detach().index_select(0, flat)

    def fresh_gradient_scatter():
        return torch.zeros(V, D).index_add_(0, flat, grad_rows)

    # Warm up (compile, page in the tables, start torch's thread pool) and check agreement.
    for name in modules:
        for _ in range(3):
            forward(name)
            step(name)
    difference = float((forward("fused") - forward("eager")).abs().max())

    names = list(modules)
    samples = {f"{kind}/{name}": [] for kind in ("back_to_back", "forward", "after_gemm", "step") for name in names}
    samples.update({"back_to_back/gather": [], "forward/gather": [], "after_gemm/gather": [], "gemm": [],
                    "step/fresh_gradient_scatter": []})
    # Minor page faults per timed call: where the allocator hands a call fresh pages (an output or gradient
    # just returned to the OS), the first touch of each 4 KiB page costs more than the kernel.
    faults = {key: [] for key in samples}

    def record(key, fn):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        samples[key].append(_timed(fn))
        faults[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # Back to back: each implementation's forward right after its own, the repetitions interleaved like the
    # round-robin below (a block of one implementation's calls, then the next's, let a slow minute of this
    # shared VM land on one of them: 0.83-1.16x fused/compile between runs).
    alone = names + ["gather"]
    for repeat in range(args.repeats):
        for name in alone[repeat % len(alone):] + alone[:repeat % len(alone)]:
            run = gather if name == "gather" else (lambda: forward(name))
            for _ in range(BACK_TO_BACK_WARMUP):
                run()
            for _ in range(BACK_TO_BACK_TIMED):
                record(f"back_to_back/{name}", run)
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        record("gemm", lambda: torch.mm(a, b))
        for name in order:
            record(f"forward/{name}", lambda: forward(name))
            torch.mm(a, b)
            record(f"after_gemm/{name}", lambda: forward(name))
            record(f"step/{name}", lambda: step(name))
        record("forward/gather", gather)
        torch.mm(a, b)
        record("after_gemm/gather", gather)
        record("step/fresh_gradient_scatter", fresh_gradient_scatter)

    median = {key: statistics.median(values) for key, values in samples.items()}
    mean_faults = {key: statistics.fmean(values) for key, values in faults.items()}
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"V {V}, d {D}, {BATCH} x {LENGTH} tokens, fp32; {args.repeats} round-robin repeats; "
          f"fused vs eager max |diff| {difference:.2e}")
    print(f"{'ms (median)':<28}{'fused':>9}{'compile':>9}{'eager':>9}{'torch op':>9}   fused vs compile / eager")
    for kind, floor in (("back_to_back", "back_to_back/gather"), ("forward", "forward/gather"),
                        ("after_gemm", "after_gemm/gather"),
                        ("step", "step/fresh_gradient_scatter")):
        row = [median[f"{kind}/{name}"] for name in names]
        print(f"{kind:<28}" + "".join(f"{value:9.3f}" for value in row) + f"{median[floor]:9.3f}"
              f"   {row[1] / row[0]:.2f}x / {row[2] / row[0]:.2f}x")
    print(f"(the GEMM alone: {median['gemm']:.3f} ms; 'after_gemm' times the forward only)")
    print(f"{'minor page faults per call':<28}{'fused':>9}{'compile':>9}{'eager':>9}{'torch op':>9}")
    for kind, floor in (("back_to_back", "back_to_back/gather"), ("forward", "forward/gather"),
                        ("after_gemm", "after_gemm/gather"), ("step", "step/fresh_gradient_scatter")):
        row = [mean_faults[f"{kind}/{name}"] for name in names] + [mean_faults[floor]]
        print(f"{kind:<28}" + "".join(f"{value:9.0f}" for value in row))
    if args.json:
        document = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "case": {"vocab": V, "d": D, "batch": BATCH, "length": LENGTH, "dtype": "float32"},
                    "repeats": args.repeats, "date": time.strftime("%Y-%m-%d"),
                    "median_ms": median, "mean_minor_page_faults_per_call": mean_faults,
                    "fused_vs_eager_max_abs_diff": difference}
        path = args.json.replace("<cpu>", device_slug(cpu_model()))
        write_document(path, document)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
