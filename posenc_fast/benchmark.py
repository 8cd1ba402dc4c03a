"""``python -m posenc_fast bench``: time the fused layer against eager PyTorch and torch.compile.

This module owns the benchmark: the cases, the byte model, the implementations compared, how
they are timed, and the outputs (a printed table, ``<out>/<device-slug>.json`` and a PNG plot).
``bench/test_bench.py`` runs the same cases through pytest-benchmark; ``bench/README.md`` says
how to read the results and ``bench/NOTES.md`` holds the predictions.

Implementations (``IMPLS``):

- ``eager``: ``baselines.EagerSinusoidalEmbedding`` (nn.Embedding + a registered fp32 sinusoid
  table, embed scale, add or torch.cat, cast): what users run today.
- ``compile`` / ``compile-max-autotune``: ``torch.compile`` of that same module (default mode /
  ``mode="max-autotune-no-cudagraphs"``), ``dynamic=False``, compiled afresh for every case.
- ``triton`` / ``cuda``: ``SinusoidalEmbedding(backend=...)``, timed with the host-side id range
  check OFF (``posenc_fast.id_check(False)``); the headline forward with the check on is printed
  as an extra line (the JSON's ``impl`` enum has no slot for it).
- ``torch``: the float64 reference backend; CPU smoke runs only, printed but never written to
  the JSON (not in its ``impl`` enum).

Ops: ``forward`` (under ``torch.no_grad()``, as inference and decoding run it), ``backward``
(``torch.autograd.grad`` of one retained forward graph: the weight gradient alone) and ``step``
(``weight.grad = None``, forward, ``backward(grad_out)``).

Timing (GPU): ``triton.testing.do_bench`` with ``return_mode="all"`` and the median taken; it
flushes the L2 cache before every run, after our own warm-up calls (so ``torch.compile``,
autotuning and Triton's JIT stay out of the numbers).  Inputs are random (ids over the whole
vocabulary, N(0, 1) weights and output gradients, never zeros) and rotated among several sets
when one set would fit in L2.  Latency cases (decode) are timed one call at a time with the GPU
idle at the start event, so host overhead (Python, dispatch, launches) is part of the time, as in
a decoding loop without CUDA graphs.  CPU: ``_timing.median_ms``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import gc
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import config
from ._timing import cuda_event_times, median_ms
from .baselines import EagerSinusoidalEmbedding
from .module import SinusoidalEmbedding

OPS = ("forward", "backward", "step")
IMPLS = ("eager", "compile", "compile-max-autotune", "triton", "cuda", "torch")
JSON_IMPLS = ("eager", "compile", "compile-max-autotune", "triton", "cuda")  # the schema's impl enum
FUSED_IMPLS = ("triton", "cuda", "torch")
COMPILE_IMPLS = ("compile", "compile-max-autotune")
GPU_DEFAULT_IMPLS = ("eager", "compile", "compile-max-autotune", "triton", "cuda")
CPU_DEFAULT_IMPLS = ("eager", "torch")

ID_BYTES = 8  # ids are int64, as nn.Embedding users hold them
D_POS = 64  # PE columns in concat mode

# The exact keys of one entry of the JSON's "cases" list, and of the document (bench/README.md).
RESULT_KEYS = ("op", "impl", "dtype", "mode", "tokens", "d_model", "vocab", "median_ms", "bytes", "GBps",
               "peak_mem_bytes")
DOCUMENT_KEYS = ("device", "torch", "triton", "cuda", "date", "copy_GBps", "cases")

# Targets of the benchmark issue, checked by summarize(): (op, quantity, bar).
TARGETS = (
    ("forward", "pct_copy", 85.0),
    ("forward", "x_eager", 2.5),
    ("forward", "x_compile", 1.1),
    ("backward", "x_eager", 1.3),
    ("backward", "x_compile", 1.5),
    ("step", "x_eager", 2.0),
    ("step", "x_compile", 1.3),
)
DECODE_TARGET_X_EAGER = 2.0


# --------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem size.  ``tokens = batch * seq_len``; embed_scale is sqrt(d_model) throughout."""

    name: str
    group: str  # "headline", "wide", "decode" or "sweep": --cases accepts group names
    batch: int
    seq_len: int
    d_model: int
    vocab: int
    dtype: torch.dtype = torch.bfloat16
    mode: str = "add"
    ops: Tuple[str, ...] = OPS
    latency: bool = False  # time one call at a time, host overhead included (decode)
    autotune: bool = False  # also time compile-max-autotune by default (its autotuning is slow)
    full_only: bool = False  # run only with --full (or when named in --cases)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def d_pos(self) -> Optional[int]:
        return D_POS if self.mode == "concat" else None

    @property
    def token_width(self) -> int:
        """Width of the table and of the gathered rows: d_model (add) or d_model - d_pos (concat)."""
        return self.d_model - D_POS if self.mode == "concat" else self.d_model

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def config_key(self) -> Tuple:
        """What identifies a case in the JSON (which has no case names)."""
        return (self.dtype_name, self.mode, self.tokens, self.d_model, self.vocab)


def _sweep(tokens: int, label: str) -> Case:
    return Case(f"sweep-{label}", "sweep", tokens // 4096, 4096, 1024, 32768, ops=("forward",))


# In the order they run: the targets first, so a run cut short by its time budget still
# has them.
CASES: Tuple[Case, ...] = (
    Case("headline", "headline", 64, 8192, 1024, 32768, autotune=True),
    Case("decode", "decode", 64, 1, 4096, 262144, ops=("forward",), latency=True, autotune=True),
    Case("wide", "wide", 16, 4096, 4096, 262144),
    _sweep(4096, "4k"),
    _sweep(16384, "16k"),
    _sweep(65536, "64k"),
    _sweep(262144, "256k"),
    _sweep(1048576, "1m"),
    Case("headline-concat", "headline", 64, 8192, 1024, 32768, mode="concat"),
    Case("headline-fp32", "headline", 64, 8192, 1024, 32768, dtype=torch.float32),
    Case("headline-fp32-concat", "headline", 64, 8192, 1024, 32768, dtype=torch.float32, mode="concat",
         full_only=True),
    Case("wide-concat", "wide", 16, 4096, 4096, 262144, mode="concat", full_only=True),
    Case("wide-fp32", "wide", 16, 4096, 4096, 262144, dtype=torch.float32, full_only=True),
)
QUICK_CASES = ("headline", "decode")
CASE_BY_NAME = {case.name: case for case in CASES}


def select_cases(patterns: Optional[Sequence[str]] = None, *, quick: bool = False, full: bool = False) -> List[Case]:
    """Cases to run, in run order.  ``patterns`` (chosen among all cases): a case name, else a
    group name ("sweep"), else an fnmatch pattern ("headline*"); without them ``--quick``'s pair,
    ``--full``'s list, or the default list."""
    if patterns:
        chosen = []
        for pattern in patterns:
            hits = ([c for c in CASES if c.name == pattern] or [c for c in CASES if c.group == pattern]
                    or [c for c in CASES if fnmatch.fnmatchcase(c.name, pattern)])
            if not hits:
                raise ValueError(f"no case matches {pattern!r}; cases: {', '.join(CASE_BY_NAME)} "
                                 f"(groups: headline, wide, decode, sweep)")
            chosen.extend(hits)
        names = {c.name for c in chosen}
        cases = [c for c in CASES if c.name in names]
    elif quick:
        cases = [CASE_BY_NAME[name] for name in QUICK_CASES]
    else:
        cases = [c for c in CASES if full or not c.full_only]
    if full:
        cases = [dataclasses.replace(c, autotune=True, ops=c.ops if c.latency else OPS) for c in cases]
    return cases


def for_device(case: Case, device: torch.device) -> Case:
    """The case at the size this device runs it: unchanged on GPU; on CPU (smoke runs of the
    harness, not measurements) 1/2048 of the tokens, width <= 128 and vocab / 64."""
    if device.type == "cuda":
        return case
    if case.latency:
        batch, seq_len = case.batch, case.seq_len
    else:
        tokens = max(case.tokens // 2048, 1)
        seq_len = min(case.seq_len, 32, tokens)
        batch = max(tokens // seq_len, 1)
    return dataclasses.replace(case, batch=batch, seq_len=seq_len, d_model=min(case.d_model, 128),
                               vocab=max(case.vocab // 64, 2))


# --------------------------------------------------------------------------------------------
# Byte model


def bytes_moved(op: str, case: Case) -> int:
    """The fewest bytes ``op`` must move through device memory for ``case`` (each input read once,
    each output written once), with N tokens, width D, token width T (D, or D - d_pos in concat),
    vocabulary V, element size e and 8-byte ids:

    - forward = 8N (ids) + N*T*e (the gathered table rows, one per token) + N*D*e (the output).
      Positions are ``offset + t`` and the PE is computed, so neither is read.
    - backward = N*T*e (grad_out's token columns; the PE columns of a concat output have no
      parameter to feed) + 8N (ids) + V*T*e (the dense [V, T] weight gradient, written once).
      Zero-fill is *included in that one write*: a minimal kernel writes every row exactly once,
      the sum of its tokens' gradients or zero, so a separate memset of the gradient is extra
      traffic an implementation pays, not part of the floor.  Sorting the ids (if an
      implementation sorts) is likewise the implementation's cost.
    - step = forward + backward (the backward pass reads the ids again).

    The gathered-row term counts one row per token.  When the table is not much larger than L2
    (the headline: 64 MiB of bf16 rows against 50-60 MB of L2), repeated ids hit in L2 and the
    DRAM traffic can be less: as low as 8N + (distinct ids)*T*e + N*D*e.  Then GB/s by this model
    can exceed the copy bandwidth; bench/NOTES.md gives both counts for the headline.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    e = case.dtype.itemsize
    n, d, t, v = case.tokens, case.d_model, case.token_width, case.vocab
    forward = ID_BYTES * n + n * t * e + n * d * e
    backward = n * t * e + ID_BYTES * n + v * t * e
    return {"forward": forward, "backward": backward, "step": forward + backward}[op]


def floor_ms(op: str, case: Case, copy_GBps: float) -> float:
    """The bandwidth floor: bytes_moved / the measured copy bandwidth, in milliseconds."""
    return bytes_moved(op, case) / (copy_GBps * 1e6)


# --------------------------------------------------------------------------------------------
# Inputs and implementations


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 32 << 20
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20))


def rotation_sets(case: Case, device: torch.device) -> int:
    """Input sets to cycle through: enough that the data of the sets together is 4x the L2 (up to
    8 sets), so that repeated runs do not time the cache; one set when it is that large already."""
    per_set = case.tokens * (ID_BYTES + 2 * case.d_model * case.dtype.itemsize)  # ids, output, grad_out
    target = 4 * _l2_bytes(device)
    return 1 if per_set >= target else min(8, math.ceil(target / per_set))


class CaseInputs:
    """Random inputs of one case: the weight table (N(0, 1)), and ``sets`` of ids (uniform over the
    whole vocabulary) and output gradients (N(0, 1)) to rotate through.  Never zeros."""

    def __init__(self, case: Case, device: torch.device, sets: int, seed: int = 0, need_grads: bool = True):
        g = torch.Generator(device=device).manual_seed(seed)
        self.weight = torch.randn(case.vocab, case.token_width, dtype=case.dtype, device=device, generator=g)
        shape = (case.batch, case.seq_len)
        self.ids = [torch.randint(0, case.vocab, shape, device=device, generator=g) for _ in range(sets)]
        self.grads = ([torch.randn(shape + (case.d_model,), dtype=case.dtype, device=device, generator=g)
                       for _ in range(sets)] if need_grads else [])


class Runner:
    """One implementation built for one case: ``module(ids)`` and the parameter it trains."""

    def __init__(self, impl: str, module: Callable, weight: torch.nn.Parameter):
        self.impl = impl
        self.module = module
        self.weight = weight


def impl_unavailable(impl: str, device: torch.device) -> Optional[str]:
    """None if ``impl`` can be timed on ``device``, else why not."""
    if impl not in IMPLS:
        return f"unknown implementation {impl!r}; expected one of {IMPLS}"
    if impl == "triton":
        if device.type != "cuda":
            return "Triton kernels are timed on a GPU only (on CPU they run in Triton's interpreter)"
        from .backends import triton_backend

        return triton_backend.available(device)
    if impl == "cuda":
        if device.type != "cuda":  # (a host-emulation build, which tests load, runs on CPU: not a timing)
            return "the CUDA backend is timed on a GPU only"
        try:
            from .backends import cuda_backend
        except Exception as error:  # the backend is optional and may be half-written: never fatal here
            return f"posenc_fast.backends.cuda_backend does not import ({type(error).__name__}: {error})"
        return cuda_backend.available(device)
    return None


def build_runner(impl: str, case: Case, inputs: CaseInputs, device: torch.device) -> Runner:
    """The implementation ``impl`` over ``inputs.weight`` (shared, not copied)."""
    weight = torch.nn.Parameter(inputs.weight)
    if impl in FUSED_IMPLS:
        module = SinusoidalEmbedding.from_pretrained(weight, mode=case.mode, d_pos=case.d_pos,
                                                     embed_scale=case.embed_scale, backend=impl)
        return Runner(impl, module, module.weight)
    eager = EagerSinusoidalEmbedding(case.vocab, case.d_model, mode=case.mode, d_pos=case.d_pos,
                                     max_len=case.seq_len, embed_scale=case.embed_scale, device=device,
                                     dtype=case.dtype)
    eager.embed.weight = weight
    if impl == "eager":
        return Runner(impl, eager, weight)
    mode = "max-autotune-no-cudagraphs" if impl == "compile-max-autotune" else None
    return Runner(impl, torch.compile(eager, mode=mode, dynamic=False), weight)


def forward_fn(runner: Runner, inputs: CaseInputs) -> Callable[[], torch.Tensor]:
    sets = itertools.cycle(inputs.ids)

    def forward():
        with torch.no_grad():
            return runner.module(next(sets))

    return forward


def backward_fn(runner: Runner, inputs: CaseInputs) -> Callable[[], torch.Tensor]:
    """The weight gradient of one retained forward graph per input set (the graphs live as long as
    the returned function)."""
    pairs = [(runner.module(ids), grad) for ids, grad in zip(inputs.ids, inputs.grads)]
    cycle = itertools.cycle(pairs)
    weight = runner.weight

    def backward():
        out, grad = next(cycle)
        return torch.autograd.grad(out, (weight,), grad, retain_graph=True)[0]

    return backward


def step_fn(runner: Runner, inputs: CaseInputs) -> Callable[[], None]:
    cycle = itertools.cycle(list(zip(inputs.ids, inputs.grads)))
    weight = runner.weight

    def step():
        ids, grad = next(cycle)
        weight.grad = None  # as optimizer.zero_grad() does: the gradient is assigned, not accumulated
        runner.module(ids).backward(grad)

    return step


def relative_error(out: torch.Tensor, ref: torch.Tensor, elements: int = 1 << 24) -> float:
    """||out - ref|| / ||ref|| in float64, over chunks of rows (no full-size float64 temporaries)."""
    a, b = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    rows = max(1, elements // max(a.shape[1], 1))
    num = den = 0.0
    for start in range(0, a.shape[0], rows):
        x, y = a[start:start + rows].double(), b[start:start + rows].double()
        num += float(((x - y) ** 2).sum())
        den += float((y ** 2).sum())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def agreement_bar(dtype: torch.dtype) -> float:
    """Largest ||impl - eager|| / ||eager|| accepted.  bf16: a few outputs differ by one rounding;
    eager's gradient also rounds grad * scale to bf16 before summing.  fp32: eager's fp32 angles
    are off by ~1e-4 rad at position 8192, small against sqrt(d)-scaled token values."""
    return 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3


# --------------------------------------------------------------------------------------------
# Timing, copy bandwidth, peak memory


@dataclasses.dataclass
class Timing:
    median_ms: float
    spread_pct: Optional[float]  # (p80 - p20) / median, in %; None where not measured (CPU)


def _do_bench_times(fn: Callable, warmup_ms: int = 25, rep_ms: int = 200) -> List[float]:
    from triton.testing import do_bench

    times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return list(times) if isinstance(times, (list, tuple)) else [float(times)]


def _latency_times(fn: Callable, device: torch.device, reps: int = 200) -> List[float]:
    """One call per pair of events, the GPU idle before each: host overhead counts (decode)."""
    return cuda_event_times(fn, device, reps)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def time_op(fn: Callable, device: torch.device, *, latency: bool = False, warmup_calls: int = 3,
            cpu_reps: int = 5) -> Timing:
    """Median time of ``fn`` in ms after ``warmup_calls`` untimed calls (compile, autotune, JIT).
    On CPU (smoke runs) one warm-up call and ``cpu_reps`` timed ones."""
    if device.type != "cuda":
        return Timing(median_ms(fn, device, warmup=1, reps=cpu_reps), None)
    for _ in range(warmup_calls):
        fn()
    _sync(device)
    times = sorted(_latency_times(fn, device) if latency else _do_bench_times(fn))
    median = statistics.median(times)
    spread = 100.0 * (_quantile(times, 0.8) - _quantile(times, 0.2)) / median if median > 0 else None
    return Timing(median, spread)


def copy_bandwidth_GBps(device: torch.device, nbytes: Optional[int] = None) -> float:
    """A large device-to-device copy of random data, counting bytes read plus bytes written."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.randn(nbytes // 4, device=device)  # random, never zeros
    dst = torch.empty_like(src)
    timing = time_op(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (timing.median_ms * 1e6)


def step_peak_bytes(step: Callable, weight: torch.nn.Parameter, device: torch.device) -> Optional[int]:
    """Peak memory one step allocates on top of what was allocated before it (inputs, weight)."""
    if device.type != "cuda":
        return None
    weight.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


# --------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass
class Measurement:
    """One timed (case, op, impl); ``as_json()`` gives exactly the schema's keys."""

    case: Case
    op: str
    impl: str
    median_ms: float
    spread_pct: Optional[float] = None
    peak_mem_bytes: Optional[int] = None

    @property
    def bytes(self) -> int:
        return bytes_moved(self.op, self.case)

    @property
    def GBps(self) -> float:
        return self.bytes / (self.median_ms * 1e6) if self.median_ms > 0 else 0.0

    def as_json(self) -> dict:
        c = self.case
        return {"op": self.op, "impl": self.impl, "dtype": c.dtype_name, "mode": c.mode, "tokens": c.tokens,
                "d_model": c.d_model, "vocab": c.vocab, "median_ms": float(self.median_ms), "bytes": int(self.bytes),
                "GBps": float(self.GBps), "peak_mem_bytes": self.peak_mem_bytes}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_slug(name: str) -> str:
    """File-name form of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def _triton_version() -> str:
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:
        return "none"


def make_document(device: torch.device, copy_GBps: float, measurements: Iterable[Measurement],
                  kept_rows: Sequence[dict] = ()) -> dict:
    """The JSON document (bench/README.md: schema); rows of implementations outside the schema's
    ``impl`` enum (``torch``) are left out.  ``kept_rows``: rows of an earlier file (``--merge``),
    dropped where this run measured the same (op, impl, case)."""
    new_rows = [m.as_json() for m in measurements if m.impl in JSON_IMPLS]
    measured = {_key(r) + (r["impl"],) for r in new_rows}
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda or "none",
        "date": datetime.date.today().isoformat(),
        "copy_GBps": float(copy_GBps),
        "cases": [r for r in kept_rows if _key(r) + (r["impl"],) not in measured] + new_rows,
    }


class MergeError(ValueError):
    """--merge was given a results file it cannot merge with."""


def rows_to_merge(path: str, device: torch.device) -> Tuple[List[dict], Optional[str]]:
    """The rows of an earlier results file for the same device, and a note saying what was kept."""
    if not os.path.exists(path):
        return [], None
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    problems = validate_document(doc)
    if problems:
        raise MergeError(f"--merge: {path} does not follow the schema: {problems[0]}")
    if doc["device"] != device_name(device):
        raise MergeError(f"--merge: {path} was measured on {doc['device']!r}, not {device_name(device)!r}")
    return doc["cases"], (f"merged with {path}: its rows measured on {doc['date']} (copy {doc['copy_GBps']:.1f} "
                          f"GB/s) are kept where this run did not measure the same op, impl and case")


def validate_document(doc) -> List[str]:
    """Problems with ``doc`` against the schema (empty when it conforms)."""
    problems = []
    if not isinstance(doc, dict):
        return [f"document is {type(doc).__name__}, not an object"]
    if set(doc) != set(DOCUMENT_KEYS):
        problems.append(f"document keys {sorted(doc)} != {sorted(DOCUMENT_KEYS)}")
    for key in ("device", "torch", "triton", "cuda", "date"):
        if not isinstance(doc.get(key), str):
            problems.append(f"{key} is not a string")
    if isinstance(doc.get("date"), str) and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"]):
        problems.append(f"date {doc['date']!r} is not YYYY-MM-DD")
    if not _is_number(doc.get("copy_GBps")):
        problems.append("copy_GBps is not a number")
    cases = doc.get("cases")
    if not isinstance(cases, list):
        return problems + ["cases is not a list"]
    enums = {"op": OPS, "impl": JSON_IMPLS, "mode": ("add", "concat")}
    for i, row in enumerate(cases):
        if not isinstance(row, dict) or set(row) != set(RESULT_KEYS):
            got = sorted(row) if isinstance(row, dict) else row
            problems.append(f"cases[{i}] keys {got!r} != {sorted(RESULT_KEYS)}")
            continue
        for key, allowed in enums.items():
            if row[key] not in allowed:
                problems.append(f"cases[{i}].{key} = {row[key]!r} not in {allowed}")
        if not isinstance(row["dtype"], str):
            problems.append(f"cases[{i}].dtype is not a string")
        for key in ("tokens", "d_model", "vocab", "bytes"):
            if not (isinstance(row[key], int) and not isinstance(row[key], bool)):
                problems.append(f"cases[{i}].{key} is not an int")
        for key in ("median_ms", "GBps"):
            if not _is_number(row[key]):
                problems.append(f"cases[{i}].{key} is not a number")
        peak = row["peak_mem_bytes"]
        if peak is not None and not (isinstance(peak, int) and not isinstance(peak, bool)):
            problems.append(f"cases[{i}].peak_mem_bytes is neither an int nor null")
    return problems


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def write_document(path: str, doc: dict) -> None:
    """Write atomically (a run cut short leaves the last complete file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Derived numbers: speedups, targets


def _key(row: dict) -> Tuple:
    return (row["op"], row["dtype"], row["mode"], row["tokens"], row["d_model"], row["vocab"])


def speedups(rows: Sequence[dict]) -> Dict[Tuple, Tuple[Optional[float], Optional[float]]]:
    """For each row (keyed by _key + impl): (eager time / its time, best compile time / its time).
    "Over compile" is over the faster of the two compile modes measured for that case and op."""
    eager, best_compile = {}, {}
    for r in rows:
        if r["impl"] == "eager":
            eager[_key(r)] = r["median_ms"]
        elif r["impl"] in COMPILE_IMPLS:
            best_compile[_key(r)] = min(best_compile.get(_key(r), math.inf), r["median_ms"])
    out = {}
    for r in rows:
        k, ms = _key(r), r["median_ms"]
        x_eager = eager[k] / ms if k in eager and ms > 0 else None
        x_compile = best_compile[k] / ms if k in best_compile and ms > 0 else None
        out[k + (r["impl"],)] = (x_eager, x_compile)
    return out


def target_report(rows: Sequence[dict], copy_GBps: float, headline: Case, decode: Case,
                  deterministic: Optional[Dict[str, bool]] = None) -> List[str]:
    """One line per fused implementation and target of the issue, each 'ok' or 'MISSED'."""
    x = speedups(rows)
    by_key = {_key(r) + (r["impl"],): r for r in rows}
    fused = [impl for impl in ("triton", "cuda") if any(r["impl"] == impl for r in rows)]
    if not fused:
        return ["targets: no fused implementation was measured"]
    lines = [f"targets (headline {headline.tokens} tokens x {headline.d_model}, {headline.dtype_name}, "
             f"{headline.mode}; x compile = over the faster compile mode):"]

    def key(op, case, impl):
        return (op,) + (case.dtype_name, case.mode, case.tokens, case.d_model, case.vocab) + (impl,)

    for impl in fused:
        parts = []
        for op, quantity, bar in TARGETS:
            row = by_key.get(key(op, headline, impl))
            if row is None:
                parts.append(f"{op} {quantity}: not measured")
                continue
            if quantity == "pct_copy":
                value = 100.0 * row["GBps"] / copy_GBps if copy_GBps else None
            else:
                value = x[key(op, headline, impl)][0 if quantity == "x_eager" else 1]
            if value is None:
                parts.append(f"{op} {quantity}: no baseline")
                continue
            unit = "%" if quantity == "pct_copy" else "x"
            label = "of copy" if quantity == "pct_copy" else quantity.replace("x_", "over ")
            parts.append(f"{op} {value:.2f}{unit} {label} (>= {bar:g}{unit}) {'ok' if value >= bar else 'MISSED'}")
        if deterministic is not None and impl in deterministic:
            parts.append(f"backward deterministic: {'ok' if deterministic[impl] else 'MISSED'}")
        else:
            parts.append("backward deterministic: not checked here (see the run's log)")
        decode_row = by_key.get(key("forward", decode, impl))
        dx = x.get(key("forward", decode, impl), (None, None))[0]
        if decode_row is None or dx is None:
            parts.append("decode forward over eager: not measured")
        else:
            parts.append(f"decode forward {dx:.2f}x over eager (>= {DECODE_TARGET_X_EAGER:g}x) "
                         f"{'ok' if dx >= DECODE_TARGET_X_EAGER else 'MISSED'}")
        mine, eager = by_key.get(key("step", headline, impl)), by_key.get(key("step", headline, "eager"))
        if mine and eager and mine["peak_mem_bytes"] is not None and eager["peak_mem_bytes"] is not None:
            ok = mine["peak_mem_bytes"] < eager["peak_mem_bytes"]
            parts.append(f"step peak memory {mine['peak_mem_bytes'] / 2**20:.0f} MiB vs eager "
                         f"{eager['peak_mem_bytes'] / 2**20:.0f} MiB {'ok' if ok else 'MISSED'}")
        else:
            parts.append("step peak memory: not measured")
        lines.append(f"  {impl}:")
        lines.extend(f"    {p}" for p in parts)
    return lines


# --------------------------------------------------------------------------------------------
# Table and plot


def format_table(measurements: Sequence[Measurement], copy_GBps: float, *, device: str = "",
                 notes: Sequence[str] = ()) -> str:
    """The printed table: one line per (case, op, impl)."""
    rows = [m.as_json() for m in measurements]
    x = speedups(rows)
    lines = [
        f"posenc_fast bench on {device or '?'}: copy bandwidth {copy_GBps:.1f} GB/s (read + write); "
        f"posenc_fast timed with the id range check OFF (posenc_fast.id_check(False))",
        "bytes = the fewest bytes the op must move (posenc_fast.benchmark.bytes_moved); %copy = GB/s over the "
        "copy bandwidth; x eager / x compile = speedup (compile: the faster compile mode); peak = step only",
    ]
    header = (f"{'case':<21}{'op':<9}{'impl':<21}{'dtype':<9}{'tokens':>9}{'median ms':>11}{'spread':>8}"
              f"{'MB':>9}{'GB/s':>9}{'%copy':>7}{'x eager':>9}{'x compile':>10}{'peak MiB':>10}")
    lines += [header, "-" * len(header)]
    for m, r in zip(measurements, rows):
        x_eager, x_compile = x[_key(r) + (r["impl"],)]
        spread = f"{m.spread_pct:.0f}%" if m.spread_pct is not None else "-"
        peak = f"{m.peak_mem_bytes / 2**20:.0f}" if m.peak_mem_bytes is not None else "-"
        pct = f"{100.0 * m.GBps / copy_GBps:.0f}" if copy_GBps > 0 else "-"
        lines.append(
            f"{m.case.name:<21}{m.op:<9}{m.impl:<21}{m.case.dtype_name:<9}{m.case.tokens:>9}{m.median_ms:>11.4f}"
            f"{spread:>8}{m.bytes / 1e6:>9.1f}{m.GBps:>9.1f}{pct:>7}"
            f"{_fmt_x(x_eager):>9}{_fmt_x(x_compile):>10}{peak:>10}")
    lines.extend(notes)
    return "\n".join(lines)


def _fmt_x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3g}x"


def plot_results(rows: Sequence[dict], copy_GBps: float, path: str, title: str = "") -> Optional[str]:
    """Time against tokens per implementation, log-log, with the bandwidth floor (bytes over the
    copy bandwidth) drawn; for the forward op and, where measured, the step.  Uses the
    (dtype, mode, d_model, vocab) configuration with the most token counts (the sweep plus the
    headline).  Returns why no plot was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot written"
    configs: Dict[Tuple, set] = {}
    for r in rows:
        if r["op"] == "forward":
            configs.setdefault((r["dtype"], r["mode"], r["d_model"], r["vocab"]), set()).add(r["tokens"])
    if not configs:
        return "no forward measurements to plot"
    config_key = max(configs, key=lambda k: len(configs[k]))
    dtype, mode, d_model, vocab = config_key
    # The step gets its own panel where it was measured at two token counts or more (--full).
    ops = ["forward"] + [op for op in ("step",)
                         if len({r["tokens"] for r in rows if r["op"] == op
                                 and (r["dtype"], r["mode"], r["d_model"], r["vocab"]) == config_key}) > 1]
    fig, axes = plt.subplots(1, len(ops), figsize=(6.5 * len(ops), 4.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in rows if r["op"] == op and (r["dtype"], r["mode"], r["d_model"], r["vocab"]) == config_key]
        for impl in JSON_IMPLS:
            points = sorted((r["tokens"], r["median_ms"]) for r in mine if r["impl"] == impl)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
        if copy_GBps > 0:
            floor = sorted({(r["tokens"], r["bytes"] / (copy_GBps * 1e6)) for r in mine})
            ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", marker="_",
                    label=f"bytes / copy BW ({copy_GBps:.0f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("median time (ms)")
        ax.set_title(f"{op}: d_model {d_model}, vocab {vocab}, {dtype}, {mode}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class RunReport:
    measurements: List[Measurement]
    copy_GBps: float
    document: dict
    json_path: str
    notes: List[str]  # extra lines: id check on, determinism, agreement, skips, failures
    deterministic: Dict[str, bool]
    failures: List[str]


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_compiler() -> None:
    """Every case compiles afresh: dynamo's per-code-object cache would otherwise fill up across
    cases (and fall back to eager silently) or switch to dynamic shapes."""
    import torch._dynamo

    torch._dynamo.reset()
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))


def run_benchmark(cases: Sequence[Case], impls: Sequence[str], device: torch.device, out_dir: str, *,
                  ops: Sequence[str] = OPS, time_budget_s: Optional[float] = None, explicit_impls: bool = False,
                  merge: bool = False, log: Callable[[str], None] = print, seed: int = 0) -> RunReport:
    """Time every (case, op, impl), writing the JSON after each case; return what was measured.

    ``explicit_impls``: compile-max-autotune runs on every case (else only on cases marked
    ``autotune``).  ``time_budget_s``: once exceeded, the remaining (case, impl) pairs are skipped
    (and listed), so a run with a hard time limit still ends with a complete JSON.  ``merge``:
    keep the rows of an existing ``<out_dir>/<slug>.json`` that this run does not re-measure.
    """
    started = time.monotonic()
    slug = device_slug(device_name(device))
    json_path = os.path.join(out_dir, f"{slug}.json")
    notes: List[str] = []
    failures: List[str] = []
    deterministic: Dict[str, bool] = {}
    measurements: List[Measurement] = []
    kept_rows: List[dict] = []
    if merge:
        kept_rows, merge_note = rows_to_merge(json_path, device)
        if merge_note:
            notes.append(merge_note)

    usable = []
    for impl in impls:
        reason = impl_unavailable(impl, device)
        if reason is None:
            usable.append(impl)
        else:
            notes.append(f"skipped {impl}: {reason.splitlines()[0][:300]}")
            log(f"skipping {impl}: {reason.splitlines()[0][:300]}")

    copy = copy_bandwidth_GBps(device)
    log(f"device {device_name(device)}; copy bandwidth {copy:.1f} GB/s (read + write)")
    skipped_for_time = []

    for case in (for_device(c, device) for c in cases):
        case_ops = [op for op in case.ops if op in ops]
        if not case_ops:
            continue
        if any(impl in COMPILE_IMPLS for impl in usable):
            _reset_compiler()
        _free_memory(device)
        needs_grad = any(op != "forward" for op in case_ops)
        try:
            inputs = CaseInputs(case, device, rotation_sets(case, device), seed=seed, need_grads=needs_grad)
            reference = _eager_reference(case, inputs, device, needs_grad)
        except Exception as error:  # out of memory, most likely: the other cases can still run
            failures.append(f"{case.name}: preparing inputs and eager's reference failed: {type(error).__name__}: "
                            f"{(str(error).splitlines() or [''])[0][:300]}")
            log(f"FAILED {failures[-1]}")
            inputs = reference = None
            _free_memory(device)
            continue
        for impl in usable:
            if impl == "compile-max-autotune" and not (case.autotune or explicit_impls):
                continue
            if time_budget_s is not None and time.monotonic() - started > time_budget_s:
                skipped_for_time.append(f"{case.name}/{impl}")
                continue
            try:  # appends to measurements as it goes: what was timed before a failure is kept
                _measure_impl(case, case_ops, impl, inputs, reference, device, measurements, notes, deterministic,
                              failures, log)
            except Exception as error:  # one broken implementation must not lose the others' numbers
                first_line = (str(error).splitlines() or [""])[0][:300]
                failures.append(f"{case.name} {impl}: {type(error).__name__}: {first_line}")
                log(f"FAILED {failures[-1]}")
            _free_memory(device)
        del inputs, reference
        write_document(json_path, make_document(device, copy, measurements, kept_rows))
    if skipped_for_time:
        notes.append(f"time budget ({time_budget_s:g} s) reached; not run: {', '.join(skipped_for_time)}")
    notes.append(f"{len(measurements)} measurements in {time.monotonic() - started:.0f} s")
    doc = make_document(device, copy, measurements, kept_rows)
    write_document(json_path, doc)
    notes.extend(f"FAILED {f}" for f in failures)
    return RunReport(measurements, copy, doc, json_path, notes, deterministic, failures)


def _eager_reference(case: Case, inputs: CaseInputs, device: torch.device, needs_grad: bool):
    """Eager's output (and weight gradient) on the first input set: what every implementation
    must agree with."""
    runner = build_runner("eager", case, inputs, device)
    with torch.no_grad():
        out = runner.module(inputs.ids[0])
    grad = None
    if needs_grad:
        grad = torch.autograd.grad(runner.module(inputs.ids[0]), (runner.weight,), inputs.grads[0])[0]
    return out, grad


def _measure_impl(case, case_ops, impl, inputs, reference, device, measurements, notes, deterministic, failures,
                  log) -> None:
    """Check ``impl`` against eager's reference, then time each op (appended to ``measurements``)."""
    runner = build_runner(impl, case, inputs, device)
    bar = agreement_bar(case.dtype)
    results = []
    t0 = time.monotonic()
    with config.id_check(False):
        # Agreement with eager (also the compile / JIT warm-up of the forward).
        with torch.no_grad():
            out = runner.module(inputs.ids[0])
        _sync(device)
        if impl in COMPILE_IMPLS:
            log(f"  {case.name} {impl}: forward compiled in {time.monotonic() - t0:.1f} s")
        err = relative_error(out, reference[0])
        del out
        if not err <= bar:
            failures.append(f"{case.name} {impl}: output differs from eager, rel. error {err:.2e} > {bar:g}")
            log(f"MISMATCH {failures[-1]}")
        for op in case_ops:
            if op == "forward":
                fn = forward_fn(runner, inputs)
            elif op == "backward":
                fn = backward_fn(runner, inputs)
                first_out, first_grad = runner.module(inputs.ids[0]), inputs.grads[0]
                g1 = torch.autograd.grad(first_out, (runner.weight,), first_grad, retain_graph=True)[0]
                g2 = torch.autograd.grad(first_out, (runner.weight,), first_grad)[0]
                same = torch.equal(g1, g2)
                if case.name == "headline":
                    deterministic[impl] = same
                notes.append(f"{case.name} backward deterministic (two runs bitwise equal), {impl}: "
                             f"{'yes' if same else 'NO'}")
                gerr = relative_error(g1, reference[1])
                del first_out, g1, g2
                if not gerr <= bar:
                    failures.append(f"{case.name} {impl}: weight gradient differs from eager, rel. error "
                                    f"{gerr:.2e} > {bar:g}")
                    log(f"MISMATCH {failures[-1]}")
            else:
                fn = step_fn(runner, inputs)
            timing = time_op(fn, device, latency=case.latency)
            peak = step_peak_bytes(fn, runner.weight, device) if op == "step" else None
            m = Measurement(case, op, impl, timing.median_ms, timing.spread_pct, peak)
            results.append(m)
            measurements.append(m)
            log(f"  {case.name:<21}{op:<9}{impl:<21}{m.median_ms:10.4f} ms {m.GBps:9.1f} GB/s"
                + (f"  peak {peak / 2**20:.0f} MiB" if peak is not None else ""))
            del fn
            runner.weight.grad = None
            _free_memory(device)
    if case.name == "headline" and "forward" in case_ops and impl in FUSED_IMPLS:
        with config.id_check(True):
            on = time_op(forward_fn(runner, inputs), device, latency=case.latency)
        off = next(m for m in results if m.op == "forward")
        notes.append(f"headline forward with the id range check ON (one device->host sync per call), {impl}: "
                     f"{on.median_ms:.4f} ms ({100.0 * (on.median_ms / off.median_ms - 1):+.1f}% over the check off)")
    log(f"  {case.name} {impl}: {time.monotonic() - t0:.1f} s in all (warm-up and compilation included)")


# --------------------------------------------------------------------------------------------
# Command line


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="time the fused layer against eager PyTorch and torch.compile (bench/README.md)",
        description="Time forward, backward and a training step of eager PyTorch, torch.compile and the "
                    "fused backends; print a table, write <out>/<device-slug>.json and a PNG plot.")
    parser.add_argument("--out", default=os.path.join("bench", "results"),
                        help="folder for the JSON and the plot (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="only the headline and decode cases")
    parser.add_argument("--full", action="store_true",
                        help="every case, every op, compile-max-autotune everywhere (longer than one 10-minute call)")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated case names, groups or patterns (cases: {', '.join(CASE_BY_NAME)})")
    parser.add_argument("--impls", default=None,
                        help=f"comma-separated implementations among {', '.join(IMPLS)} "
                             f"(default: {','.join(GPU_DEFAULT_IMPLS)} on GPU, {','.join(CPU_DEFAULT_IMPLS)} on CPU)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: %(default)s)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
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
    time limit has a JSON, written after every case, but no plot yet)."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    problems = validate_document(doc)
    for p in problems:
        log(f"schema: {p}")
    if problems:
        return 1
    log(f"{path}: {doc['device']}, {doc['date']}, torch {doc['torch']}, triton {doc['triton']}, "
        f"CUDA {doc['cuda']}; copy {doc['copy_GBps']:.1f} GB/s; {len(doc['cases'])} measurements")
    for line in target_report(doc["cases"], doc["copy_GBps"], CASE_BY_NAME["headline"], CASE_BY_NAME["decode"]):
        log(line)
    png = os.path.splitext(path)[0] + ".png"
    why_not = plot_results(doc["cases"], doc["copy_GBps"], png, title=f"posenc_fast on {doc['device']}")
    log(f"wrote {png}" if why_not is None else f"no plot: {why_not}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    if args.summarize:
        return summarize(args.summarize)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    try:
        cases = select_cases(_split(args.cases), quick=args.quick, full=args.full)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    impls = _split(args.impls) or list(GPU_DEFAULT_IMPLS if device.type == "cuda" else CPU_DEFAULT_IMPLS)
    ops = _split(args.ops)
    for name, values, allowed in (("implementation", impls, IMPLS), ("op", ops, OPS)):
        unknown = [v for v in values if v not in allowed]
        if unknown:
            print(f"error: unknown {name} {', '.join(unknown)}; expected among {', '.join(allowed)}", file=sys.stderr)
            return 2

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        report = run_benchmark(cases, impls, device, args.out, ops=ops, time_budget_s=args.time_budget,
                               explicit_impls=bool(args.impls), merge=args.merge, log=log, seed=args.seed)
    except MergeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    notes = list(report.notes)
    if any(m.impl == "torch" for m in report.measurements):
        notes.append("torch (the float64 reference backend) is a CPU smoke-test row: printed, not written to the JSON")
    print()
    print(format_table(report.measurements, report.copy_GBps, device=report.document["device"], notes=notes))
    print(f"\nwrote {report.json_path}")
    png = os.path.splitext(report.json_path)[0] + ".png"
    why_not = plot_results(report.document["cases"], report.copy_GBps, png,
                           title=f"posenc_fast on {report.document['device']}")
    print(f"wrote {png}" if why_not is None else f"no plot: {why_not}")
    headline = for_device(CASE_BY_NAME["headline"], device)
    decode = for_device(CASE_BY_NAME["decode"], device)
    print()
    for line in target_report(report.document["cases"], report.copy_GBps, headline, decode, report.deterministic):
        print(line)
    return 1 if report.failures else 0
