"""Write docs/performance.md from the results files in bench/results/*.json.

    python bench/performance_doc.py              # (re)write docs/performance.md
    python bench/performance_doc.py --check      # exit 1 if docs/performance.md is not what this writes
    python bench/performance_doc.py --results DIR --out FILE

Every figure in the document comes from a results file; the prose around them (the method, the byte
model, what the gaps are and why) is text of this script.  Same files in, same Markdown out: files are
read in name order, nothing depends on the clock or the machine, and numbers are formatted with fixed
rules.  Standard library only (no torch, no posenc_fast import).

A results file is recognised by its keys (the kinds below); one of a kind it does not know is listed
with its name, device, versions and date, and its figures are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
OUT = os.path.join(ROOT, "docs", "performance.md")

IMPL_ORDER = ("eager", "compile", "compile-max-autotune", "triton", "cuda", "cpu")
FUSED = ("triton", "cuda", "cpu")
OP_ORDER = ("forward", "backward", "step")
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# The benchmark's case names (posenc_fast/benchmark/cases.py), by (tokens, d_model, vocab); a results row has
# no name, only its sizes.
CASE_NAMES = {(524288, 1024, 32768): "headline", (64, 4096, 262144): "decode", (65536, 4096, 262144): "wide",
              (4096, 512, 32000): "cpu-headline", (16384, 1024, 32000): "cpu-long"}
HEADLINE = (524288, 1024, 32768)


# ---- formatting: fixed rules, so that the same numbers always print the same ---------------------

def ms(value: Optional[float]) -> str:
    """A time in ms with three significant figures (four below 1 ms: 0.6813 -> 0.681)."""
    if value is None:
        return ""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    if value >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2g}"


def pct(value: float) -> str:
    return f"{value:.0f}%" if value >= 1 else f"{value:.1f}%"


def pct1(value: float) -> str:
    return f"{value:.1f}%"


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def span(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    low, high = min(values), max(values)
    return fmt(low) if fmt(low) == fmt(high) else f"{fmt(low)}-{fmt(high)}"


# ---- the results files: kinds, device, versions, date ----------------------------------------------

def kind_of(doc) -> str:
    if not isinstance(doc, dict):
        return "unknown"
    if "cases" in doc and "copy_GBps" in doc:
        return "benchmark"
    if "benchmarks" in doc and "machine_info" in doc:
        return "pytest-benchmark"
    if doc.get("what") == "bench/cuda_forward_ab.py":
        return "cuda-forward-ab"
    if "us_per_call" in doc:
        return "host-overhead"
    if str(doc.get("what", "")).startswith("weight-gradient backward"):
        return "sparse-gradient"
    if str(doc.get("what", "")).endswith("(bench/backward_cost.py)"):
        return "backward-cost"
    if str(doc.get("what", "")).endswith("(bench/dropout_cost.py)"):
        return "dropout-cost"
    if "cpu_model" in doc and "speedups" in doc:
        return "cpu-bench"
    if "median_ms" in doc and isinstance(doc.get("median_ms"), dict) and "cpu" in doc:
        return "cpu-in-context"
    if "module_bytes" in doc:
        return "build-size"
    if "variants" in doc and "gpus" in doc:
        return "sass"
    return "unknown"


KIND_ORDER = ("benchmark", "pytest-benchmark", "cpu-bench", "cuda-forward-ab", "host-overhead", "backward-cost",
              "dropout-cost", "sparse-gradient", "cpu-in-context", "build-size", "sass", "unknown")

WHAT = {
    "benchmark": "`python -m posenc_fast bench`",
    "pytest-benchmark": "`pytest bench/ --benchmark-only`",
    "cuda-forward-ab": "`bench/cuda_forward_ab.py`",
    "host-overhead": "`bench/host_overhead.py`",
    "backward-cost": "`bench/backward_cost.py`",
    "dropout-cost": "`bench/dropout_cost.py`",
    "sparse-gradient": "`bench/sparse_gradient_cost.py`",
    "cpu-bench": "the former `bench/cpu_bench.py`",
    "cpu-in-context": "`bench/cpu_in_context.py`",
    "build-size": "size of the built `posenc_fast._C`",
    "sass": "`bench/sass_report.py` (a model, not a measurement)",
    "unknown": "(a kind this script does not know)",
}


def device_of(kind: str, doc) -> str:
    if not isinstance(doc, dict):
        return "not recorded"
    if kind == "pytest-benchmark":
        for bench in doc.get("benchmarks", []):
            device = (bench.get("extra_info") or {}).get("device")
            if device:
                return device
        return "not recorded"
    if kind == "cpu-bench":
        return f"CPU {doc['cpu_model']}, {doc.get('cores', '?')} cores"
    if kind == "cpu-in-context":
        return f"CPU {doc['cpu']}, {doc.get('threads', '?')} threads"
    if kind == "host-overhead" and "threads" in doc and "host" not in doc:
        return f"CPU {doc['device']}, {doc['threads']} threads"
    if kind == "build-size":
        return "The build (no device)"
    if kind == "sass":
        return "The offline SASS model (no device)"
    return str(doc.get("device", "not recorded"))


def versions_of(kind: str, doc) -> str:
    if not isinstance(doc, dict):
        return "not recorded"
    parts = []
    for key, label in (("torch", "torch"), ("triton", "Triton"), ("cuda", "CUDA"), ("nvcc", "nvcc"),
                       ("python", "Python"), ("compiler", "compiler")):
        if doc.get(key):
            parts.append(f"{label} {doc[key]}")
    if kind == "pytest-benchmark":
        info = doc.get("machine_info", {})
        if info.get("python_version"):
            parts.append(f"Python {info['python_version']}")
        commit = doc.get("commit_info", {}).get("id")
        if commit:
            parts.append(f"commit {commit[:7]}")
    if kind == "build-size" and doc.get("archs"):
        parts.append(f"archs {doc['archs']}")
    if kind == "sass":
        parts.append(f"sm_{doc.get('arch')}")
    return ", ".join(parts) if parts else "not recorded"


def date_of(kind: str, doc) -> str:
    if not isinstance(doc, dict):
        return "not recorded"
    date = doc.get("date") or doc.get("datetime")
    return str(date)[:10] if date else "not recorded"


class Results:
    """The results files of a folder, in name order, each with its kind and identity."""

    def __init__(self, folder: str):
        self.folder = folder
        self.files: List[Tuple[str, str, dict]] = []  # (file name, kind, document)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    doc = json.load(f)
                self.files.append((name, kind_of(doc), doc))

    def of_kind(self, kind: str) -> List[Tuple[str, dict]]:
        return [(name, doc) for name, k, doc in self.files if k == kind]

    def devices(self) -> List[str]:
        """Devices that have results, GPUs first, then CPUs, then the rest, each group by name."""
        names = {device_of(kind, doc) for _, kind, doc in self.files}
        return sorted(names, key=lambda d: (0 if d.startswith("NVIDIA") else 1 if d.startswith("CPU") else 2, d))

    def for_device(self, device: str) -> List[Tuple[str, str, dict]]:
        """The device's files: the benchmark's first, then the other tools' (KIND_ORDER), each kind by name."""
        files = [(name, kind, doc) for name, kind, doc in self.files if device_of(kind, doc) == device]
        return sorted(files, key=lambda f: (KIND_ORDER.index(f[1]), f[0]))

    def png_beside(self, name: str) -> Optional[str]:
        png = name[:-len(".json")] + ".png"
        return png if os.path.exists(os.path.join(self.folder, png)) else None


# ---- the benchmark's own results (python -m posenc_fast bench) -------------------------------------

def config_of(row) -> Tuple:
    return (row["dtype"], row["mode"], row["tokens"], row["d_model"], row["vocab"])


def label(config: Tuple) -> str:
    dtype, mode, tokens, d_model, vocab = config
    name = CASE_NAMES.get((tokens, d_model, vocab))
    if name is None and d_model == 1024 and vocab == 32768:
        name = "sweep"
    sizes = f"{tokens} x {d_model}, V {vocab}"
    suffix = ", ".join(s for s in (DTYPE_SHORT.get(dtype, dtype), mode) if s not in ("bf16", "add"))
    base = f"{name} ({sizes})" if name else sizes
    return f"{base}, {suffix}" if suffix else base


def floor_ms(row, copy_GBps: float) -> float:
    """The byte floor: the bytes the op must move over the copy bandwidth of the same run."""
    return row["bytes"] / (copy_GBps * 1e6)


def pct_copy(row, copy_GBps: float) -> float:
    return 100.0 * floor_ms(row, copy_GBps) / row["median_ms"]


def benchmark_rows(doc) -> Dict[Tuple, Dict[str, Dict[str, dict]]]:
    """config -> op -> impl -> row, configs in the order of the file."""
    grouped: Dict[Tuple, Dict[str, Dict[str, dict]]] = {}
    for row in doc["cases"]:
        grouped.setdefault(config_of(row), {}).setdefault(row["op"], {})[row["impl"]] = row
    return grouped


def impls_in(doc) -> List[str]:
    present = {row["impl"] for row in doc["cases"]}
    return [impl for impl in IMPL_ORDER if impl in present] + sorted(present - set(IMPL_ORDER))


def render_benchmark(name: str, doc, results: Results) -> List[str]:
    copy = doc["copy_GBps"]
    impls = impls_in(doc)
    bandwidth = "gather + write bandwidth (torch.index_select)" if doc["device"].startswith("CPU") else "copy bandwidth"
    lines = [f"{bandwidth.capitalize()} {copy:.0f} GB/s in the same run. Median ms per call; a fused implementation's "
             f"cell also gives its floor as a share of its time (its % of {bandwidth}).", ""]
    rows = []
    for config, ops in benchmark_rows(doc).items():
        for op in OP_ORDER:
            if op not in ops:
                continue
            by_impl = ops[op]
            any_row = next(iter(by_impl.values()))
            cells = [label(config), op, f"{any_row['bytes'] / 1e9:.3f}", ms(floor_ms(any_row, copy))]
            for impl in impls:
                row = by_impl.get(impl)
                if row is None:
                    cells.append("")
                elif impl in FUSED:
                    cells.append(f"{ms(row['median_ms'])} ({pct(pct_copy(row, copy))})")
                else:
                    cells.append(ms(row["median_ms"]))
            rows.append(cells)
    lines += table(["case", "op", "GB moved", "floor"] + impls, rows)
    peaks = []
    for config, ops in benchmark_rows(doc).items():
        step = ops.get("step", {})
        if any(row.get("peak_mem_bytes") for row in step.values()):
            peaks.append([label(config)] + [f"{step[i]['peak_mem_bytes'] / 2**20:.0f}"
                                            if i in step and step[i].get("peak_mem_bytes") else "" for i in impls])
    if peaks:
        lines += ["", "Peak memory a training step allocates (MiB, beyond its inputs and the table):", ""]
        lines += table(["case"] + impls, peaks)
    png = results.png_beside(name)
    if png:
        lines += ["", f"Time against tokens, with the byte floor dashed: `bench/results/{png}`."]
    return lines


# ---- the other tools' files -----------------------------------------------------------------------

def render_pytest_benchmark(name: str, doc, results: Results) -> List[str]:
    groups: Dict[str, Dict[str, float]] = {}
    impls: List[str] = []
    for bench in doc["benchmarks"]:
        impl = (bench.get("extra_info") or {}).get("impl", bench["name"])
        groups.setdefault(bench.get("group") or bench["name"], {})[impl] = bench["stats"]["median"] * 1e3
        if impl not in impls:
            impls.append(impl)
    impls = [i for i in IMPL_ORDER if i in impls] + [i for i in impls if i not in IMPL_ORDER]
    lines = ["The quick list through pytest-benchmark (host clock, a synchronisation per call), median ms:", ""]
    lines += table(["case, op"] + impls, ([group] + [ms(values.get(i)) for i in impls]
                                          for group, values in groups.items()))
    return lines


def render_cuda_forward_ab(name: str, doc, results: Results) -> List[str]:
    lines = ["The installed CUDA forward against a build with other `-D` defines, one worker process per build "
             f"taking turns on the GPU, outputs compared bit for bit (copy bandwidth {doc['copy_GBps']:.0f} GB/s):", ""]
    lines += table(["case", "variant", "median ms", "% of copy", "vs installed"],
                   ([r["case"], r["variant"], ms(r["median_ms"]), pct1(r["copy_pct"]), ratio(r["vs_installed"])]
                    for r in doc["rows"]))
    if doc.get("commit"):
        lines += ["", f"The file's note on the builds: {doc['commit']}."]
    ncu = doc.get("ncu") or {}
    wanted = ("Duration", "DRAM Throughput", "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy")
    if ncu:
        rows = []
        for variant, metric_lines in ncu.items():
            values = {}
            for line in metric_lines:
                for metric in wanted:
                    if line.startswith(metric):
                        values[metric] = _ncu_value(line.split()[len(metric.split()):])
            rows.append([variant] + [values.get(metric, "") for metric in wanted])
        lines += ["", "Nsight Compute on the headline forward kernel:", ""]
        lines += table(["build"] + list(wanted), rows)
    return lines


def _ncu_value(words: List[str]) -> str:
    """An Nsight Compute line's unit and value as one cell: ['us', '658.82'] -> '658.82 us'."""
    if len(words) != 2:
        return " ".join(words)
    unit, value = words
    return f"{value}%" if unit == "%" else f"{value} {unit}" if unit in ("us", "ms", "ns") else value


def _us(value) -> str:
    return f"{value:.1f}"


def host_rows(doc) -> Tuple[List[List[str]], List[List[str]]]:
    """(rows of us_per_call, rows of entry_points_us_per_call) as table cells."""
    flat = []
    for key, value in doc["us_per_call"].items():
        if isinstance(value, dict):
            flat.append([key, _us(value["inference"]), _us(value["training"])])
        else:
            flat.append([key, _us(value), ""])
    entry = []
    for route, points in (doc.get("entry_points_us_per_call") or {}).items():
        for point, value in points.items():
            entry.append([route, point, _us(value["inference"]), _us(value["training"])])
    return flat, entry


def render_host_overhead(name: str, doc, results: Results) -> List[str]:
    case = doc.get("case", {})
    lines = [f"Host time per call of the decode case ({case.get('tokens')} tokens, d_model "
             f"{case.get('d_model')}, vocabulary {case.get('vocab')}), us; clock: {doc.get('clock')}."]
    if doc.get("host"):
        lines[0] += f" Host CPU: {doc['host']}."
    flat, entry = host_rows(doc)
    if all(not row[2] for row in flat):
        lines += [""] + table(["call", "us"], (row[:2] for row in flat))
    else:
        lines += [""] + table(["call", "inference", "training"], flat)
    if entry:
        lines += ["", "Every backend and entry point (\"training\": grad enabled and a trainable table, only the "
                  "forward call timed):", ""]
        lines += table(["backend or route", "entry point", "inference", "training"], entry)
    for key in ("entry_points_timed", "note"):
        value = doc.get(key)
        if isinstance(value, dict):
            value = "; ".join(f"{k}: {v}" for k, v in value.items())
        if value:
            lines += ["", f"The file's note: {value}"]
    return lines


def sparse_table(doc) -> Tuple[Optional[float], List[List[str]]]:
    zero_fill = None
    by_tokens: Dict[int, Dict[Tuple[str, bool], float]] = {}
    for row in doc["rows"]:
        if row["impl"] == "zero-fill":
            zero_fill = row["backward_ms"]
            continue
        by_tokens.setdefault(row["tokens"], {})[(row["impl"], row["sparse"])] = row["backward_ms"]
    columns = (("fused", False), ("nn.Embedding", False), ("fused", True), ("nn.Embedding", True))
    rows = [[str(tokens)] + [ms(values.get(c)) for c in columns] for tokens, values in by_tokens.items()]
    return zero_fill, rows


def render_sparse_gradient(name: str, doc, results: Results) -> List[str]:
    zero_fill, rows = sparse_table(doc)
    lines = [f"The weight-gradient backward of the wide table (V {doc['vocab']}, d_model {doc['d_model']}, "
             f"{doc['dtype']}; the dense gradient is {doc['dense_gradient_bytes'] / 2**30:.0f} GiB), ms; timed: "
             f"{doc['timed_region']}.", ""]
    lines += table(["tokens", "fused dense", "nn.Embedding dense", "fused sparse", "nn.Embedding sparse"], rows)
    if zero_fill is not None:
        lines += ["", f"Zero-filling the dense gradient alone: {ms(zero_fill)} ms."]
    return lines


def render_backward_cost(name: str, doc, results: Results) -> List[str]:
    copy = doc["copy_GBps"]
    lines = [f"The dense weight-gradient backward (d_model {doc['width']}, V {doc['vocab']}) by chunk length "
             f"(`GRAD_CHUNK`), ms; timed: {doc['timed_region']}. Kernel GB: the bytes the byte model predicts for "
             "the two kernels (grad_out, order and ids, the touched rows, the fp32 partials of the runs that cross "
             "a chunk); kernels: the backward less the sort and the zero fill timed alone. Copy: "
             f"{copy:.0f} GB/s.", ""]
    groups: Dict[Tuple, List[dict]] = {}
    for row in doc["results"]:
        groups.setdefault((row["tokens"], row["dtype"]), []).append(row)
    for (tokens, dtype), rows in groups.items():
        first = rows[0]
        lines += [f"{tokens} tokens ({first['touched_rows']} rows touched), {dtype}: floor {first['floor_bytes'] / 1e9:.3f} "
                  f"GB; the sort alone {ms(first['sort_ms'])} ms, the zero fill alone {ms(first['zero_fill_ms'])} ms.",
                  ""]
        lines += table(["backend", "chunk", "partial rows", "kernel GB", "backward", "floor / measured", "kernels",
                        "kernels' GB/s, % of copy"],
                       [[row["backend"], str(row["chunk"]), str(row["partial_rows"]), f"{row['kernel_bytes'] / 1e9:.3f}",
                         ms(row["backward_ms"]), pct(100 * row["floor_bytes"] / (copy * 1e6) / row["backward_ms"]),
                         ms(row["kernels_ms"]), pct(100 * row["kernel_bytes"] / (copy * 1e6) / row["kernels_ms"])
                         if row["kernels_ms"] > 0 else "-"] for row in rows])
        lines.append("")
    return lines[:-1]


def render_dropout_cost(name: str, doc, results: Results) -> List[str]:
    copy = doc["copy_GBps"]
    lines = [f"Dropout (p = {doc['p']:g}) fused into the layer against the layer without it and against eager's and "
             f"torch.compile's `nn.Dropout` after the layer, {doc['dtype']}, median ms; the floor is the layer's bytes "
             f"(dropout moves none), against {copy:.0f} GB/s copy bandwidth.", ""]
    lines += table(["batch, seq_len, d_model, vocab, mode", "implementation", "op", "ms", "% of copy"],
                   [[", ".join(str(v) for v in row["shape"]), row["impl"], row["op"], ms(row["median_ms"]),
                     pct(100 * row["GBps"] / copy)] for row in doc["rows"]])
    return lines


def render_cpu_bench(name: str, doc, results: Results) -> List[str]:
    timing = doc.get("timing", {})
    lines = [f"Tokens {doc['case'].get('ids_shape')}, d_model {doc['case'].get('d_model')}, vocabulary "
             f"{doc['case'].get('vocab')}, {doc['case'].get('dtype')}, positions {doc['case'].get('positions')}; "
             f"kernel variant {doc.get('kernel_isa')}; {timing.get('rounds')} rounds of {timing.get('calls_per_round')} "
             f"calls, the median of the round medians (wall time, ms). Load average before and after: "
             f"{', '.join(f'{x:.2f}' for x in doc.get('load_average_before', []))} and "
             f"{', '.join(f'{x:.2f}' for x in doc.get('load_average_after', []))}.", ""]
    ms_of = {(r["threads"], r["op"], r["impl"]): r["ms"] for r in doc["rows"]}
    speedup = {(s["threads"], s["op"], s["impl"], s["vs"]): s["speedup"] for s in doc["speedups"]}
    rows = []
    for threads in sorted({r["threads"] for r in doc["rows"]}):
        for op in OP_ORDER:
            if (threads, op, "cpu") not in ms_of:
                continue
            # (tests/test_readme.py reads these rows: the same cells, the same formats.)
            rows.append([str(threads), op] + [f"{ms_of[(threads, op, impl)]:.3g} ms" for impl in ("eager", "compile", "cpu")]
                        + [f"{speedup[(threads, op, 'cpu', vs)]:.2f}x" for vs in ("eager", "compile")])
    lines += table(["threads", "op", "eager", "compile", "cpu", "cpu vs eager", "cpu vs compile"], rows)
    offsets = [(t, op) for (t, op, impl) in ms_of if impl == "cpu-offsets"]
    if offsets:
        lines += ["", "With one offset per sequence (`cpu-offsets`: every token's sinusoid computed, none shared): "
                  + "; ".join(f"{t} thread{'s' if t > 1 else ''} {op} {ms(ms_of[(t, op, 'cpu-offsets')])} ms"
                              for t, op in sorted(offsets)) + "."]
    return lines


CONTEXT_LABELS = {"back_to_back": "forward, back to back (warm)", "forward": "forward, round-robin",
                  "after_gemm": "forward right after a GEMM", "step": "training step (fresh V x d gradient)"}


def render_cpu_in_context(name: str, doc, results: Results) -> List[str]:
    case = doc.get("case", {})
    settings: Dict[str, Dict[str, float]] = {}
    for key, value in doc["median_ms"].items():
        setting, _, impl = key.partition("/")
        if impl:
            settings.setdefault(setting, {})[impl] = value
    impls = ["fused", "compile", "eager"]
    rows = []
    for setting, values in settings.items():
        floor_key = next((k for k in values if k not in impls), None)
        cells = [CONTEXT_LABELS.get(setting, setting)] + [ms(values.get(i)) for i in impls]
        cells.append(f"{ms(values[floor_key])} ({floor_key.replace('_', ' ')})" if floor_key else "")
        if "fused" in values and "compile" in values and "eager" in values:
            cells += [ratio(values["compile"] / values["fused"]), ratio(values["eager"] / values["fused"])]
        rows.append(cells)
    lines = [f"The layer inside a model's run ({case.get('batch')} x {case.get('length')} tokens, "
             f"d {case.get('d')}, V {case.get('vocab')}, {case.get('dtype')}), medians of {doc.get('repeats')} "
             "repeats in one process, implementations in rotating order; for scale, the plain torch op timed in the "
             "same run (`index_select`; `index_add_` into a fresh gradient), which the fused kernels can beat (ms):",
             ""]
    lines += table(["setting", "fused (cpu)", "compile", "eager", "plain torch op", "compile / fused", "eager / fused"],
                   rows)
    return lines


def render_build_size(name: str, doc, results: Results) -> List[str]:
    return [f"{doc.get('what')}; {doc.get('machine')}; nvcc {doc.get('nvcc')}, archs {doc.get('archs')}: "
            f"{doc['module_bytes'] / 1e6:.1f} MB, of which the `.nv_fatbin` section is "
            f"{doc['nv_fatbin_section_bytes'] / 1e6:.1f} MB; zip-compressed as a wheel stores it, "
            f"{doc['module_zip_deflated_bytes'] / 1e6:.1f} MB."]


def render_sass(name: str, doc, results: Results) -> List[str]:
    rows = []
    for v in doc["variants"]:
        if v.get("kernel") != "forward" or v.get("math") != "float32":
            continue
        predicted = ", ".join(f"{gpu} {pct(g['predicted_pct_of_copy'])}" for gpu, g in sorted(v.get("gpus", {}).items()))
        rows.append([v["name"], f"{v['warp_instructions_per_token']:.0f}", str(v["registers"]),
                     str(v.get("spill_instructions", 0)), "yes" if v.get("all_stores_128bit") else "no", predicted])
    lines = [f"Every kernel compiled for sm_{doc['arch']} and its SASS read; the forwards with fp32 "
             f"math at the headline shape (d_model {doc['d_model']}, concat: {doc['d_pos_concat']} PE columns):", ""]
    lines += table(["variant", "warp-instructions per token", "registers", "spill instructions",
                    "all stores 128-bit", "predicted % of copy"], rows)
    return lines


RENDER = {"benchmark": render_benchmark, "pytest-benchmark": render_pytest_benchmark, "cuda-forward-ab": render_cuda_forward_ab,
          "host-overhead": render_host_overhead, "sparse-gradient": render_sparse_gradient,
          "backward-cost": render_backward_cost, "dropout-cost": render_dropout_cost,
          "cpu-bench": render_cpu_bench, "cpu-in-context": render_cpu_in_context, "build-size": render_build_size,
          "sass": render_sass}


# ---- predicted against measured, and the gaps: figures computed from the files ---------------------

def predicted_against_measured(results: Results) -> List[str]:
    lines = []
    rows = []
    for name, doc in results.of_kind("benchmark"):
        copy = doc["copy_GBps"]
        for config, ops in benchmark_rows(doc).items():
            if config[2:] != HEADLINE:
                continue
            for op in OP_ORDER:
                for impl in FUSED:
                    row = ops.get(op, {}).get(impl)
                    if row is not None:
                        rows.append([doc["device"], label(config), op, impl, ms(floor_ms(row, copy)),
                                     ms(row["median_ms"]), pct1(pct_copy(row, copy))])
    if rows:
        lines += ["The byte floor (the model's bytes over the copy bandwidth measured in the same run) against the "
                  "fused implementations' measured time, on the headline shape:", ""]
        lines += table(["device", "case", "op", "impl", "floor ms", "measured ms", "floor / measured"], rows)
    sass_rows = []
    for sass_name, sass in results.of_kind("sass"):
        for name, doc in results.of_kind("benchmark"):
            copy = doc["copy_GBps"]
            measured = {(r["impl"], DTYPE_SHORT.get(r["dtype"], r["dtype"]), r["mode"], r["op"]): r
                        for r in doc["cases"] if (r["tokens"], r["d_model"]) == (sass["tokens"], sass["d_model"])}
            for v in sass["variants"]:
                if v.get("kernel") != "forward" or v.get("math") != "float32" or v.get("layout") != "interleaved":
                    continue
                row = measured.get((v["backend"], v["dtype"], v["mode"], "forward"))
                for gpu, g in sorted(v.get("gpus", {}).items()):
                    if row is None or gpu not in doc["device"].replace(" ", ""):
                        continue
                    sass_rows.append([f"{v['name']} ({sass_name})", doc["device"], ms(g["predicted_ms"]),
                                      pct(g["predicted_pct_of_copy"]), ms(row["median_ms"]),
                                      pct(pct_copy(row, copy))])
    if sass_rows:
        lines += ["", "The offline SASS model (`bench/sass_report.py`: instructions per token, occupancy and an "
                  "assumed copy bandwidth; it predicts the larger of the memory time and the issue time) against "
                  "the same kernels measured (the benchmark's default layout is interleaved):", ""]
        lines += table(["variant", "measured on", "predicted ms", "predicted % of copy", "measured ms",
                        "measured % of copy"], sass_rows)
    return lines


def known_gaps(results: Results) -> List[str]:
    items = []
    # The backward against its floor.
    backward = []
    for name, doc in results.of_kind("benchmark"):
        copy = doc["copy_GBps"]
        ops = benchmark_rows(doc).get(("bfloat16", "add") + HEADLINE, {})
        for impl in FUSED:
            row = ops.get("backward", {}).get(impl)
            if row is None:
                continue
            text = f"{impl} {pct(pct_copy(row, copy))} on the {doc['device']}"
            step, forward = ops.get("step", {}).get(impl), ops.get("forward", {}).get(impl)
            if step and forward and step["median_ms"] - forward["median_ms"] < 0.8 * row["median_ms"]:
                text += (f" (a reading out of line with the same run's step: step minus forward is "
                         f"{ms(step['median_ms'] - forward['median_ms'])} ms against {ms(row['median_ms'])} ms for the "
                         f"backward alone)")
            backward.append(text)
    if backward:
        items.append(
            "**The weight-gradient backward runs well below copy bandwidth.** Headline, bf16, floor over measured: "
            + "; ".join(backward) + ". The floor counts each byte the gradient must move once; the kernels move "
            "more: `torch.zeros` fills the `[V, d]` gradient before the kernels write its touched rows (two writes "
            "of those rows), `torch.sort` sorts the ids (int32 keys and an int64 permutation, several radix passes), "
            "the rows of `grad_out` are read in sorted order (a random gather, one row per token), and runs of equal "
            "ids that cross a 32-token chunk leave fp32 partials that a second kernel adds (up to two rows per "
            "chunk, written and read). By the byte model, at the headline in bf16 the partials are 0.25 GB and the "
            "zero fill 0.07 GB beside a 1.15 GB floor: the sort aside, the kernels and the fill move 1.28x the floor "
            "at chunks of 32 tokens, 1.09x at 256. The levers: longer chunks (fewer partials, but fewer programs), "
            "then every gradient row written once by the kernels (zero rows included, as the CPU backend does); "
            "`bench/backward_cost.py` times each part and chunk length.")
    # The CUDA concat forward behind Triton's.
    concat = []
    for name, doc in results.of_kind("benchmark"):
        ops = benchmark_rows(doc).get(("bfloat16", "concat") + HEADLINE, {})
        cuda, triton = ops.get("forward", {}).get("cuda"), ops.get("forward", {}).get("triton")
        if cuda and triton and cuda["median_ms"] > triton["median_ms"]:
            concat.append(f"{ms(cuda['median_ms'])} ms against {ms(triton['median_ms'])} ms "
                          f"({ratio(cuda['median_ms'] / triton['median_ms'])}) on the {doc['device']}")
    if concat:
        items.append("**The CUDA concat forward is behind Triton's.** Headline-concat, bf16: " + "; ".join(concat)
                     + ". The cause is not measured yet. The two tile concat differently: Triton's kernel takes 8 tokens "
                     "x 64 pairs per program, each program one kind of column (copied token columns or PE); the CUDA "
                     "kernel gives each thread one 16-byte unit of a row for several tokens, as in add mode, with the "
                     "whole row of units across a block. By the SASS report a PE unit issues about three times a copy "
                     "unit's instructions, so at d_pos 64 the one warp that holds a row's PE units (beside copy units) "
                     "runs several times as long as the block's other warps, which hold their slot until it ends. "
                     "`bash bench/gpu_proof.sh concat` times blocks of one warp of units (`-DPOSENC_CONCAT_UNITS_X=32`: "
                     "a block's warps then take alike) against the installed build. `auto` still takes the CUDA "
                     "backend first (ahead on the backward and on host time); `backend=\"triton\"` is the faster "
                     "concat forward.")
    # The sparse gradient against nn.Embedding's: files without ``sparse_format`` measured the coalesced gradient
    # that sparse=True gave before it took nn.Embedding's format.
    sparse, coalesced = [], []
    for name, doc in results.of_kind("sparse-gradient"):
        values: Dict[int, Dict[str, float]] = {}
        for row in doc["rows"]:
            if row.get("sparse"):
                values.setdefault(row["tokens"], {})[row["impl"]] = row["backward_ms"]
        ratios = [v["fused"] / v["nn.Embedding"] for v in values.values() if "fused" in v and "nn.Embedding" in v]
        if ratios:
            text = f"{span(ratios, ratio)} on the {doc['device']}" + (" (faster)" if max(ratios) < 1 else "")
            (sparse if doc.get("sparse_format") else coalesced).append((text, max(ratios)))
    slower = [text for text, worst in sparse if worst > 1]
    sparse, coalesced = [text for text, _ in sparse], [text for text, _ in coalesced]
    if slower and not coalesced:  # (with figures of the coalesced form, the item below gives these too)
        items.append("**The sparse gradient is slower than `nn.Embedding`'s.** The wide table's backward with "
                     "`sparse=True`, fused time over `nn.Embedding(sparse=True)`'s: " + "; ".join(slower) + ".")
    if coalesced:
        items.append("**Some sparse-gradient figures are of its earlier, coalesced form.** The wide table's "
                     "backward with `sparse=True`, fused time over `nn.Embedding(sparse=True)`'s: " + "; ".join(coalesced)
                     + ". That form sorted the ids, ran `unique_consecutive` and read two values back to the host. "
                     "The gradient now takes nn.Embedding's format (one entry per token, uncoalesced): no sort, "
                     "one elementwise pass, and no host sync unless tokens are left out (a padding row, unchecked ids)" + (" (measured: " + "; ".join(sparse) + ")" if sparse else "")
                     + "; those devices have yet to measure it.")
    # Host time against the eager layer it replaces (the torch backend is the float64 reference, not a fused layer).
    host = []
    for name, doc in results.of_kind("host-overhead"):
        entry = doc.get("entry_points_us_per_call") or {}
        eager = next((v for k, v in entry.items() if k.startswith("eager")), None)
        if not eager:
            continue
        eager_embedding = next((v for k, v in eager.items() if k.split(" (")[0] != "add"), None)
        eager_add = next((v for k, v in eager.items() if k.split(" (")[0] == "add"), eager_embedding)
        for route, points in entry.items():
            if route.startswith(("eager", "torch")):
                continue
            for point, value in points.items():
                reference = eager_add if "add" in point.lower() or "Positional" in point else eager_embedding
                for mode in ("inference", "training"):
                    if reference is not None and value[mode] > reference[mode]:
                        host.append([device_of("host-overhead", doc), route, point, mode, _us(value[mode]),
                                     _us(reference[mode])])
    host_lines = []
    if host:
        items.append("**Host time above the eager layer it replaces.** Fusing should never cost host time against "
                     "eager's `nn.Embedding` + scale + add (the embedding entry points) or eager's `x + table "
                     "slice` (`add_sinusoidal` and its module), timed in the same run; the decoding calls where it "
                     "did, in us (the figures per device above give every row, and the files' notes how far rows "
                     "of the same code read apart on that host):")
        host_lines = [""] + table(["device", "backend or route", "entry point", "call", "fused", "eager"], host)
    if not items:
        return []
    return ["Each with the figures of the results files above.", ""] + [f"- {item}" for item in items] + host_lines


# ---- the document ---------------------------------------------------------------------------------

HEADER = """\
# Performance

<!-- Generated by `python bench/performance_doc.py` from bench/results/*.json: edit that script's text or the
results files, then run it again (`--check` says whether this file is current). -->

What the fused layer costs on each device it was measured on, how it was measured, what it must cost
(the byte model), and where it falls short. Every figure below is read from a results file in
`bench/results/`; each file records its device, versions and date, printed with its figures.
`bench/README.md` says how to run the benchmarks and what each tool writes.
"""

METHOD = """\
## Method

**Implementations.** `eager` is what users run today: `posenc_fast.baselines.EagerSinusoidalEmbedding`,
`nn.Embedding` + a registered fp32 sinusoid table, the embed scale, an add (or `torch.cat`) and a cast.
`compile` and `compile-max-autotune` are `torch.compile` of that same module (default mode and
`mode="max-autotune-no-cudagraphs"`, `dynamic=False`, compiled afresh for each case; compilation and
autotuning happen in the warm-up, outside the timing). `triton`, `cuda` and `cpu` are
`SinusoidalEmbedding(backend=...)`, timed with the host-side id range check off
(`posenc_fast.id_check(False)`): with it on, each call pays one device-to-host synchronisation.

**Ops.** `forward` runs under `torch.no_grad()`, as inference and decoding do. `backward` is
`torch.autograd.grad` of one retained forward graph: the weight gradient alone. `step` is
`weight.grad = None`, the forward and `backward(grad_out)`: one training step of the layer without the
optimizer. Embed scale sqrt(d_model) and int64 ids throughout.

**Timing on a GPU.** `triton.testing.do_bench` with `return_mode="all"`, the median taken; it flushes
the L2 cache before every run, after three untimed calls of our own. Inputs are random and never zeros
(ids uniform over the whole vocabulary, N(0, 1) tables and output gradients), rotated among up to 8 sets
where one set is smaller than 4x the L2, so that no run reads what the previous one left in cache. The
decode case is timed one call at a time with CUDA events, the GPU idle when the start event is
recorded: its time includes the host work (Python, dispatch, launch), as in a decoding loop without
CUDA graphs. Before timing, each implementation's output and weight gradient are compared with eager's
(relative error under 1e-2 in bf16, 1e-3 in fp32), and the backward is run twice and compared bit for bit.

**The ceiling.** The copy bandwidth of the same run: a 1 GiB device-to-device `copy_` of random data,
bytes read plus bytes written over its median time. On a CPU the ceiling is a gather + write instead
(`torch.index_select` of random rows of a 128 MiB table into an output buffer: the forward's own
traffic without its arithmetic), since a row gather cannot stream as a copy does. Timing on a CPU is
`time.perf_counter` around each call, as many calls as fit in about half a second.

**The other tools.** `bench/cuda_forward_ab.py` runs two builds of the CUDA forward in worker processes
that take turns on the GPU (rounds of `do_bench`, outputs compared bit for bit), and Nsight
Compute on the headline kernel. `bench/host_overhead.py` times the host work of one decoding call as the
calling thread's CPU time (`time.thread_time`), best of 7 repeats; without a GPU, the `cuda` backend's
host-emulation build with zero-token launches and Triton's real launcher on a stand-in CUDA driver
(`bench/fake_cuda_driver.py`) leave out only the driver's own work, and `--real cuda` times real
launches on a GPU. `bench/sparse_gradient_cost.py` times the weight-gradient backward alone (a fresh
`.grad` each time, fused and `nn.Embedding` alternating). `bench/cpu_in_context.py` times the CPU layer round-robin with compile and eager in
one process: warm, right after a GEMM, and as a training step, beside the plain torch ops of the same run.
`bench/sass_report.py` is a model, not a measurement: it compiles every kernel for sm_80 and sm_90 and
counts the instructions on each kernel's hot path.
"""

BYTE_MODEL = """\
## The byte model

`posenc_fast.benchmark.bytes_moved(op, case)` (`posenc_fast/benchmark/cases.py`) counts the fewest bytes
an op must move through memory: each input read once, each output written once. With N tokens, output
width D, token width T (D, or D - 64 PE columns in concat mode), vocabulary V, element size e and 8-byte
ids:

- forward = 8N + N·T·e (one table row gathered per token) + N·D·e (the output). Positions and the PE
  are computed from the token index and the frequencies, never read.
- backward = N·T·e (the token columns of `grad_out`) + 8N + V·T·e (the dense gradient, written once,
  zero rows included: a separate zero fill is traffic an implementation adds, as is sorting the ids).
- step = forward + backward.

The floor of an op is its bytes over the ceiling above; "% of copy" is the floor over the measured
time. The results files record each row's bytes (the "GB moved" columns below).

**Why the forward is memory-bound.** Per (sin, cos) pair the kernels do about 20 fused multiply-adds and
one 64-bit integer multiply (the exact turn, `docs/design.md`), and one multiply-add per output element
for `embed_scale * w + pe`: about 22 floating-point operations per output element against 4 bytes
moved in bf16 (2 read, 2 written). A data-center GPU issues several times more fp32 arithmetic per byte
of DRAM bandwidth than that, so the fused forward waits on memory, as a copy does.

**Why a fused forward can exceed 100% of copy.** The model counts one table row per token. Where the
table is about the size of the L2 cache (the headline: 64 MiB of bf16 rows for 524288 tokens, each id
used 16 times on average), repeated rows are served from L2, and DRAM traffic falls towards
8N + (distinct ids)·T·e + N·D·e. The fused layer reads no PE table, so more of the token table stays in
L2 than in eager's or compile's run. The wide case's 2 GiB table gets no such reuse.

**What eager moves.** Eager PyTorch runs the gather, the scale, the add of the fp32 table (which
promotes to fp32) and the cast back as separate passes: about 20 bytes per bf16 output element, some 5x
the fused forward's bytes, and its backward about 8x. That, not arithmetic, is the speedup below.
"""


def build(results: Results) -> str:
    lines = [HEADER, "## The results files", ""]
    lines += table(["file", "what", "device", "versions", "date"],
                   ([f"`{name}`", WHAT[kind], device_of(kind, doc), versions_of(kind, doc), date_of(kind, doc)]
                    for name, kind, doc in results.files))
    lines += ["", METHOD, BYTE_MODEL, "## Figures per device", "",
              "Each file under its device, with what made it, its versions and its date.", ""]
    for device in results.devices():
        files = [f for f in results.for_device(device) if f[1] in RENDER]
        if not files:
            continue
        lines += [f"### {device}", ""]
        for name, kind, doc in files:
            lines += [f"#### `{name}`: {WHAT[kind]}; {versions_of(kind, doc)}; {date_of(kind, doc)}", ""]
            lines += RENDER[kind](name, doc, results) + [""]
    predicted = predicted_against_measured(results)
    if predicted:
        lines += ["## Predicted against measured", ""] + predicted + [""]
    gaps = known_gaps(results)
    if gaps:
        lines += ["## Known gaps", ""] + gaps + [""]
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=RESULTS, help="folder of results files (default: bench/results)")
    parser.add_argument("--out", default=OUT, help="the document to write (default: docs/performance.md)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out is not current")
    args = parser.parse_args(argv)
    text = build(Results(args.results))
    if args.check:
        try:
            with open(args.out, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"{args.out} is stale: run python bench/performance_doc.py", file=sys.stderr)
            return 1
        print(f"{args.out} is current")
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
