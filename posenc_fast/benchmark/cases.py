"""The benchmark's cases and byte model: which problem sizes run on which device (one list for GPU
and CPU), which implementations and ops exist, the targets, and the fewest bytes each op must move."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import List, Optional, Sequence, Tuple

import torch


OPS = ("forward", "backward", "step")
IMPLS = ("eager", "compile", "compile-max-autotune", "triton", "cuda", "cpu", "torch")
JSON_IMPLS = ("eager", "compile", "compile-max-autotune", "triton", "cuda", "cpu")  # the schema's impl enum
FUSED_IMPLS = ("triton", "cuda", "cpu", "torch")
COMPILE_IMPLS = ("compile", "compile-max-autotune")
GPU_DEFAULT_IMPLS = ("eager", "compile", "compile-max-autotune", "triton", "cuda")
# On CPU: the native kernels (what backend="auto" runs there) beside eager and torch.compile.
CPU_DEFAULT_IMPLS = ("eager", "compile", "cpu")

ID_BYTES = 8  # ids are int64, as nn.Embedding users hold them
D_POS = 64  # PE columns in concat mode

# The exact keys of one entry of the JSON's "cases" list, and of the document (bench/README.md).
RESULT_KEYS = ("op", "impl", "dtype", "mode", "tokens", "d_model", "vocab", "median_ms", "bytes", "GBps",
               "peak_mem_bytes")
DOCUMENT_KEYS = ("device", "torch", "triton", "cuda", "date", "copy_GBps", "cases")

# (op, quantity, bar), reported met or missed by report.target_report.
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

# Targets of the cpu-headline case; pct_copy is over the CPU floor (timing.gather_bandwidth_GBps), and
# docs/cpu_backend.md says why these bars.
CPU_TARGETS = (
    ("forward", "pct_copy", 70.0),
    ("forward", "x_eager", 2.0),
    ("forward", "x_compile", 1.0),
    ("step", "x_eager", 1.5),
)


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
    device_type: str = "cuda"  # the device whose default list holds the case ("cuda" or "cpu")

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


# In the order they run: the cases with targets first, so a run cut short by its time budget has them.
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

# CPU cases, at the sizes people run on CPU.  They run on torch's threads (`bench --threads 1`: one
# core); results.device_name says why the count matters.
CPU_CASES: Tuple[Case, ...] = (
    Case("cpu-headline", "cpu", 8, 512, 512, 32000, dtype=torch.float32, device_type="cpu"),
    Case("cpu-long", "cpu", 4, 4096, 1024, 32000, dtype=torch.float32, device_type="cpu"),
    Case("cpu-bf16", "cpu", 8, 512, 512, 32000, device_type="cpu", full_only=True),
    Case("cpu-concat", "cpu", 8, 512, 512, 32000, dtype=torch.float32, mode="concat", device_type="cpu",
         full_only=True),
)
CASES = CASES + CPU_CASES
QUICK_CASES = ("headline", "decode")
CPU_QUICK_CASES = ("cpu-headline",)
HEADLINE = {"cuda": "headline", "cpu": "cpu-headline"}  # the case each device's targets are read from
CASE_BY_NAME = {case.name: case for case in CASES}


def select_cases(patterns: Optional[Sequence[str]] = None, *, quick: bool = False, full: bool = False,
                 device_type: str = "cuda") -> List[Case]:
    """Cases to run, in run order.  ``patterns`` (chosen among all cases, of either device): a case
    name, else a group name ("sweep"), else an fnmatch pattern ("headline*"); without them
    ``--quick``'s cases, ``--full``'s list, or the default list of ``device_type`` ("cuda", "cpu")."""
    if patterns and quick:
        raise ValueError("--quick (POSENC_FAST_BENCH_QUICK=1) chooses its own cases: pass either it or a case list "
                         "(--cases, POSENC_FAST_BENCH_CASES)")
    if patterns:
        chosen = []
        for pattern in patterns:
            hits = ([c for c in CASES if c.name == pattern] or [c for c in CASES if c.group == pattern]
                    or [c for c in CASES if fnmatch.fnmatchcase(c.name, pattern)])
            if not hits:
                raise ValueError(f"no case matches {pattern!r}; cases: {', '.join(CASE_BY_NAME)} "
                                 f"(groups: headline, wide, decode, sweep, cpu)")
            chosen.extend(hits)
        names = {c.name for c in chosen}
        cases = [c for c in CASES if c.name in names]
    elif quick:
        cases = [CASE_BY_NAME[name] for name in (CPU_QUICK_CASES if device_type == "cpu" else QUICK_CASES)]
    else:
        home = "cpu" if device_type == "cpu" else "cuda"
        cases = [c for c in CASES if c.device_type == home and (full or not c.full_only)]
    if full:
        cases = [dataclasses.replace(c, autotune=True, ops=c.ops if c.latency else OPS) for c in cases]
    return cases


def for_device(case: Case, device: torch.device) -> Case:
    """The case at the size this device runs it: unchanged on its own device (and a CPU case on a
    GPU); a GPU case on CPU (a smoke run of the harness, not a measurement) at 1/2048 of the tokens,
    width <= 128 and vocab / 64."""
    if device.type == "cuda" or case.device_type == "cpu":
        return case
    if case.latency:
        batch, seq_len = case.batch, case.seq_len
    else:
        tokens = max(case.tokens // 2048, 1)
        seq_len = min(case.seq_len, 32, tokens)
        batch = max(tokens // seq_len, 1)
    return dataclasses.replace(case, batch=batch, seq_len=seq_len, d_model=min(case.d_model, 128),
                               vocab=max(case.vocab // 64, 2))


def bytes_moved(op: str, case: Case) -> int:
    """The fewest bytes ``op`` must move through device memory for ``case``, each input read once and each
    output written once: docs/performance.md, "The byte model" (the backward reads only grad_out's token
    columns: PE columns feed no parameter)."""
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
