"""``python -m posenc_fast bench``: its arguments, the run it starts and what it prints, and
``--summarize`` of an existing results file."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, List, Optional

import torch

from ..cli import device_from_arg, output_folder, positive_int, print_usage_error, usage_error
from .cases import OPS, IMPLS, GPU_DEFAULT_IMPLS, CPU_DEFAULT_IMPLS, CASE_BY_NAME, HEADLINE, select_cases, for_device
from .results import MergeError, validate_document
from .report import target_report, format_table, plot_results
from .run import run_benchmark

# Relative to the current directory, not this repository's layout: bench/results/ holds the committed
# results, copied there by hand.
DEFAULT_OUT = "posenc_fast-bench-results"


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="time the fused layer against eager PyTorch and torch.compile (bench/README.md)",
        description="Time forward, backward and a training step of eager PyTorch, torch.compile and the "
                    "fused backends; print a table, write <out>/<device-slug>.json and a PNG plot.")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="folder for the JSON and the plot, created if needed (default: ./%(default)s)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="only the headline and decode cases (CPU: cpu-headline)")
    size.add_argument("--full", action="store_true",
                      help="every case, every op, compile-max-autotune on every case where it runs (by default on a "
                           "GPU; on CPU name it in --impls); longer than one 10-minute call")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated case names, groups or patterns (cases: {', '.join(CASE_BY_NAME)})")
    parser.add_argument("--impls", default=None,
                        help=f"comma-separated implementations among {', '.join(IMPLS)} "
                             f"(default: {','.join(GPU_DEFAULT_IMPLS)} on GPU, {','.join(CPU_DEFAULT_IMPLS)} on CPU)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: %(default)s)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU: torch.set_num_threads for the run (default: torch's, all cores); part of the device name")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="skip the remaining cases once this much time has passed (the JSON stays complete)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of an existing <out>/<device-slug>.json that this run does not re-measure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summarize", default=None, metavar="JSON",
                        help="print the targets of a results file and draw its PNG beside it; runs nothing")
    parser.set_defaults(func=run_command)


def _split(text: Optional[str]) -> List[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def summarize(path: str, log: Callable[[str], None] = print) -> int:
    """Print a results file's schema check and targets, and (re)draw its PNG (a run stopped by a
    time limit has its JSON but no plot)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as error:  # (json.JSONDecodeError is a ValueError)
        raise usage_error(f"--summarize {path}: {error}") from None
    problems = validate_document(doc)
    for p in problems:
        log(f"schema: {p}")
    if problems:
        return 1
    log(f"{path}: {doc['device']}, {doc['date']}, torch {doc['torch']}, triton {doc['triton']}, "
        f"CUDA {doc['cuda']}; copy {doc['copy_GBps']:.1f} GB/s; {len(doc['cases'])} measurements")
    on_cpu = doc["device"].startswith("CPU")
    headline = CASE_BY_NAME[HEADLINE["cpu" if on_cpu else "cuda"]]
    for line in target_report(doc["cases"], doc["copy_GBps"], headline, None if on_cpu else CASE_BY_NAME["decode"]):
        log(line)
    png = os.path.splitext(path)[0] + ".png"
    why_not = plot_results(doc["cases"], doc["copy_GBps"], png, title=f"posenc_fast on {doc['device']}")
    log(f"wrote {png}" if why_not is None else f"no plot: {why_not}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    if args.summarize:
        return summarize(args.summarize)
    device = device_from_arg(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        cases = select_cases(_split(args.cases), quick=args.quick, full=args.full, device_type=device.type)
    except ValueError as error:
        return print_usage_error(str(error))
    impls = _split(args.impls) or list(GPU_DEFAULT_IMPLS if device.type == "cuda" else CPU_DEFAULT_IMPLS)
    ops = _split(args.ops) or list(OPS)  # (an empty list, as an empty --cases or --impls: the default)
    if args.time_budget is not None and not args.time_budget > 0:
        raise usage_error(f"--time-budget {args.time_budget}: must be > 0 seconds")
    for name, values, allowed in (("implementation", impls, IMPLS), ("op", ops, OPS)):
        unknown = [v for v in values if v not in allowed]
        if unknown:
            return print_usage_error(f"unknown {name} {', '.join(unknown)}; expected among {', '.join(allowed)}")

    def log(line: str) -> None:
        print(line, flush=True)

    log(f"results go to {os.path.abspath(output_folder(args.out))}")

    try:
        report = run_benchmark(cases, impls, device, args.out, ops=ops, time_budget_s=args.time_budget,
                               explicit_impls=bool(args.impls), merge=args.merge, log=log, seed=args.seed)
    except MergeError as error:
        return print_usage_error(str(error))
    notes = list(report.notes)
    if not report.measurements:
        print("\n".join(notes), file=sys.stderr)
        print(f"error: nothing was measured; {os.path.abspath(report.json_path)} is left as it was", file=sys.stderr)
        return 1
    if any(m.impl == "torch" for m in report.measurements):
        notes.append("torch (the float64 reference backend) is a smoke-test row: printed, not written to the JSON")
    print()
    print(format_table(report.measurements, report.copy_GBps, device=report.document["device"], notes=notes))
    if not report.written:  # (torch rows only)
        print(f"\nno row for the JSON; {os.path.abspath(report.json_path)} is left as it was")
        return 1 if report.failures else 0
    print(f"\nwrote {os.path.abspath(report.json_path)}")
    png = os.path.splitext(report.json_path)[0] + ".png"
    why_not = plot_results(report.document["cases"], report.copy_GBps, png,
                           title=f"posenc_fast on {report.document['device']}")
    print(f"wrote {os.path.abspath(png)}" if why_not is None else f"no plot: {why_not}")
    if why_not is not None and os.path.exists(png):  # an earlier run's plot no longer shows this file
        os.remove(png)
    headline = for_device(CASE_BY_NAME[HEADLINE[device.type]], device)
    decode = for_device(CASE_BY_NAME["decode"], device) if device.type == "cuda" else None
    print()
    for line in target_report(report.document["cases"], report.copy_GBps, headline, decode, report.deterministic):
        print(line)
    return 1 if report.failures else 0
