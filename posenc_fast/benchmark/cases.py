"""The benchmark's cases and byte model: which problem sizes run, which implementations and ops
exist, and the fewest bytes each op must move (bench/README.md, "The byte model")."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import List, Optional, Sequence, Tuple

import torch


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
