"""Offline SASS report: the forward and gradient kernels compiled for sm_80 and sm_90 without a GPU,
counted on their hot path, and a roofline prediction per GPU.

    python bench/sass_report.py                  # both backends, sm_80 and sm_90 -> bench/results/sass-sm*.json
    python bench/sass_report.py --arch 90 --backend triton --only bf16-add   # a quick look, printed only

Triton kernels go through ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` with
the tiles and warps ``triton_backend`` would launch for the headline shape; the CUDA kernels through
``compile_cuda``, ``nvcc -cubin -arch=sm_XX -O3 -Xptxas -v`` of csrc/cuda/forward_<dtype>.cu and
csrc/cuda/weight_grad.cu (the flags of ``_build``; it returns ptxas' report).  With ``--cubin-dir`` the
CUDA cubins already there are read instead of compiled again: tests/test_sass_report.py compiles every
CUDA source once, for its ptxas checks and for this report.  Both cubins are read with ``cuobjdump -sass``
(Triton's bundled copy, else CUDA's).

**Hot path.** The SASS of a kernel is cut into basic blocks; loops are the backward branches.  The
hot path of one thread is the path from the entry to an EXIT that moves the most bytes of its main
stream (forward: every global store, which all write the output; gradient: the 128-bit loads of
grad_out rows), then (forward) loads the most bytes in 128-bit loads (valid ids read their rows),
then uses the fewest global accesses (the widest), and among those has the fewest instructions.
The search does not know correlated branches (one condition tested twice): kernel code whose
hot path must be counted should not test a skippable condition separately per step, or the
count is a lower bound.  That selects the vector
store/load paths over the element-by-element fallbacks, the 32-bit over the 64-bit division, and
in the gradient the tokens whose run of ids does not end.  A subroutine call (Triton's 64-bit
remainder) costs the fewest instructions from the subroutine's entry to its RET.  Blocks inside a
loop count ``trips`` times (gradient stage 1: CHUNK tokens per program; the CUDA kernel's loop
takes 8 tokens per trip).  Every SASS instruction except NOP counts as one warp-instruction.

**Roles.** A kernel that has both kinds of work (concat: copy units of token columns and PE units)
has one hot path per kind: the best path through each store block, classed "pe" if it converts
a phase to floating point (I2F) and "copy" otherwise; each role keeps its best path.

**Warp-instructions per token** (of d_model outputs; the gradient: of token_width grad_out
columns) = sum over roles r of I_r * W_r / (32 * B_r): a thread on role r issues I_r instructions
while moving B_r bytes of the stream, and a token's row needs W_r bytes of that role's columns, so
W_r / B_r threads (W_r / (32 B_r) warps) of it.  It depends on no launch geometry, and a narrow
store costs what its instructions cost.  **Instructions per element** = that * 32 / d_model (thread
instructions per output element).

**Occupancy**: warps per SM from registers (allocated per warp in units of 256), the block size and
the SM's warp and block limits.  **Roofline** (headline: 2^19 tokens, d_model 1024):
T_mem = bytes_moved / copy bandwidth; T_issue = warp-instructions * tokens / (SMs * 4 schedulers *
clock * efficiency), with FP64 arithmetic counted at its pipe's cost in issue cycles; the
prediction is T = max(T_mem, T_issue) and the percentage is T_mem / T; gradient stage 1 adds
T_latency, each warp having ``rows_in_flight`` grad_out rows per two dependent memory latencies
(order, then row; Little's law).  The numbers assumed are in
GPUS.  It is a model, not a measurement: docs/performance.md compares measurements with it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
sys.path.insert(0, ROOT)

# Headline shape (posenc_fast/benchmark/cases.py): 64 x 8192 tokens, d_model 1024, concat: 64 PE columns.
TOKENS = 64 * 8192
D_MODEL = 1024
D_POS = 64
ID_BYTES = 8
GRAD_VOCAB = 32768
GRAD_CHUNK_TOKENS = 32  # sorted tokens per stage-1 work item, both backends (GRAD_CHUNK)

# Assumed per GPU: copy bandwidth (read + write counted; H100 as measured there (docs/performance.md), A100 and
# RTX 4090 at ~88-90% of their datasheet 2.04 and 1.01 TB/s), SMs, sustained SM clock under a
# memory-bound load (below the boost clock: 1.98 / 1.41 / 2.52 GHz), the arch whose SASS stands for
# it (sm_89 SASS is close to sm_80's), the SM's warp and block limits, the fraction of cycles a
# scheduler issues while the memory system is saturated, and FP64 issue cycles per warp-instruction
# (16 FP64 lanes per scheduler on A100/H100; 1/64 of the FP32 rate on the RTX 4090).
GPUS = {
    "H100": dict(arch=90, copy_GBps=3000.0, sms=132, clock_GHz=1.755, max_warps=64, max_blocks=32,
                 issue_efficiency=0.8, fp64_cycles=2, latency_ns=700),
    "A100": dict(arch=80, copy_GBps=1800.0, sms=108, clock_GHz=1.41, max_warps=64, max_blocks=32,
                 issue_efficiency=0.8, fp64_cycles=2, latency_ns=700),
    "RTX4090": dict(arch=80, copy_GBps=900.0, sms=128, clock_GHz=2.52, max_warps=48, max_blocks=24,
                    issue_efficiency=0.8, fp64_cycles=64, latency_ns=600),
}
REGISTERS_PER_SM = 65536
FP64_OPS = re.compile(r"^(DFMA|DADD|DMUL|DSETP|DMNMX|F2F\.F64|F2F\.F32\.F64|I2F\.F64|F2I\.F64|DEPBAR_NEVER)")


# ---------------------------------------------------------------- SASS parsing and the hot path

@dataclass
class Instr:
    addr: int
    pred: str
    op: str
    args: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNC = re.compile(r"Function\s*:\s*(\S+)")


def cuobjdump() -> str:
    candidates = []
    try:
        import triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    candidates += [shutil.which("cuobjdump") or "", "/usr/local/cuda/bin/cuobjdump"]
    for path in candidates:
        if path and os.path.exists(path):
            return path
    raise FileNotFoundError("cuobjdump not found (Triton's NVIDIA backend or the CUDA toolkit provides it)")


def parse_sass(text: str) -> Dict[str, List[Instr]]:
    functions: Dict[str, List[Instr]] = {}
    current = None
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = _LINE.search(line)
        if m and current is not None:
            body = m.group(2).strip()
            pred = ""
            if body.startswith("@"):
                pred, body = body.split(None, 1)
            op, _, args = body.partition(" ")
            current.append(Instr(int(m.group(1), 16), pred, op, args.strip()))
    return functions


# A cubin's variants come one after another, and each reads it twice (finding the function, analyzing it).
@functools.lru_cache(maxsize=1)
def sass(cubin: str) -> Dict[str, List[Instr]]:
    return parse_sass(subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout)


def resource_usage(cubin: str) -> Dict[str, Dict[str, int]]:
    text = subprocess.run([cuobjdump(), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    usage, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            usage[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            name = None
    return usage


def access_width(op: str) -> int:
    """Bits moved by one thread's LDG/STG."""
    for part in op.split(".")[1:]:
        if part in ("128", "64", "32", "16", "8"):
            return int(part)
        if part in ("U16", "S16"):
            return 16
        if part in ("U8", "S8"):
            return 8
    return 32


def _target(args: str) -> Optional[int]:
    m = re.search(r"0x([0-9a-f]+)\s*$", args)
    return int(m.group(1), 16) if m else None


@dataclass
class Block:
    start: int
    instrs: List[Instr]
    succs: List[int] = field(default_factory=list)  # block indices; -1: leaves the function (EXIT / RET)


def basic_blocks(instrs: List[Instr]) -> List[Block]:
    leaders = {instrs[0].addr}
    for i, ins in enumerate(instrs):
        if ins.base in ("BRA", "EXIT", "RET", "BRX", "JMP", "JMX", "BPT") and i + 1 < len(instrs):
            leaders.add(instrs[i + 1].addr)
        if ins.base in ("BRA", "JMP"):
            t = _target(ins.args)
            if t is not None:
                leaders.add(t)
    blocks: List[Block] = []
    for ins in instrs:
        if ins.addr in leaders:
            blocks.append(Block(ins.addr, []))
        blocks[-1].instrs.append(ins)
    index = {b.start: i for i, b in enumerate(blocks)}
    for i, b in enumerate(blocks):
        last = b.instrs[-1]
        falls = i + 1 < len(blocks)
        if last.base in ("BRA", "JMP"):
            t = _target(last.args)
            if t in index:
                b.succs.append(index[t])
            if (last.pred or ".DIV" in last.op) and falls:
                b.succs.append(i + 1)
        elif last.base in ("EXIT", "RET", "BRX", "JMX", "BPT"):
            b.succs.append(-1)
            if last.pred and falls:
                b.succs.append(i + 1)
        elif falls:
            b.succs.append(i + 1)
    # A backward branch (a loop's latch) also stands for leaving the loop: the path goes on to the
    # loop's exits, so that the blocks of a loop lie on entry-to-exit paths of the acyclic graph.
    for i, b in enumerate(blocks):
        for head in [s for s in b.succs if 0 <= s <= i]:
            exits = {s for j in range(head, i + 1) for s in blocks[j].succs if s == -1 or s > i}
            if not exits and i + 1 < len(blocks):  # left through a BREAK/BSYNC region: at the latch
                exits = {i + 1}
            b.succs.extend(sorted(exits - set(b.succs)))
    return blocks


# (stream bytes, secondary bytes, -global accesses, -instructions), maximised lexicographically: the
# most bytes of the stream, then of the secondary accesses (forward: the loads, so that valid ids
# read their rows), moved in the fewest (widest) accesses, with the fewest instructions.
Score = Tuple[int, int, int, int]


def _block_cost(block: Block, stream, secondary, callee_cost: Dict[int, int], trips: int) -> Score:
    instructions = sum(1 for ins in block.instrs if ins.base != "NOP")
    stream_bytes = sum(access_width(ins.op) // 8 for ins in block.instrs if stream(ins))
    secondary_bytes = sum(access_width(ins.op) // 8 for ins in block.instrs if secondary(ins))
    accesses = sum(1 for ins in block.instrs if ins.base in ("LDG", "STG"))
    for ins in block.instrs:
        if ins.base == "CALL":
            instructions += callee_cost.get(_target(ins.args), 0)
    return stream_bytes * trips, secondary_bytes * trips, -accesses * trips, -instructions * trips


def _loop_trips(blocks: List[Block], trips: int) -> List[int]:
    factor = [1] * len(blocks)
    for i, b in enumerate(blocks):
        for s in b.succs:
            if 0 <= s <= i:  # a backward branch: blocks s..i are its loop
                for j in range(s, i + 1):
                    factor[j] = trips
    return factor


def _min_path_to_ret(blocks: List[Block], entry: int) -> int:
    """Fewest instructions from block `entry` to a RET, forward edges only (a subroutine)."""
    best = [None] * len(blocks)
    for i in range(len(blocks) - 1, entry - 1, -1):
        own = sum(1 for ins in blocks[i].instrs if ins.base != "NOP")
        options = [0 if s == -1 else best[s] for s in blocks[i].succs if s == -1 or s > i]
        options = [o for o in options if o is not None]
        best[i] = own + min(options) if options else None
    return best[entry] or 0


def _add(a: Score, b: Score) -> Score:
    return tuple(x + y for x, y in zip(a, b))


@dataclass
class Path:
    instructions: int
    stream_bytes: int
    accesses: int
    instrs: List[Instr]
    secondary_bytes: int = 0

    @property
    def score(self) -> Score:
        """The hot-path order (module docstring), for choosing among paths through different blocks."""
        return self.stream_bytes, self.secondary_bytes, -self.accesses, -self.instructions


def hot_paths(instrs: List[Instr], stream, secondary=lambda ins: False, trips: int = 1) -> List[Path]:
    """The best entry-to-exit path through each block holding a stream access (module docstring)."""
    blocks = basic_blocks(instrs)
    index = {b.start: i for i, b in enumerate(blocks)}
    callees = {_target(ins.args) for ins in instrs if ins.base == "CALL"}
    callee_cost = {t: _min_path_to_ret(blocks, index[t]) for t in callees if t in index}
    factor = _loop_trips(blocks, trips)
    cost = [_block_cost(b, stream, secondary, callee_cost, f) for b, f in zip(blocks, factor)]
    n = len(blocks)
    neg = None
    # Forward: best score from the entry through block i (inclusive).
    fwd: List[Optional[Score]] = [neg] * n
    fwd_prev = [-1] * n
    fwd[0] = cost[0]
    for i in range(n):
        if fwd[i] is None:
            continue
        for s in blocks[i].succs:
            if s > i:
                cand = _add(fwd[i], cost[s])
                if fwd[s] is None or cand > fwd[s]:
                    fwd[s], fwd_prev[s] = cand, i
    # Backward: best score from after block i to an exit.
    bwd: List[Optional[Score]] = [neg] * n
    bwd_next = [-2] * n
    for i in range(n - 1, -1, -1):
        for s in blocks[i].succs:
            if s == -1:
                cand, nxt = (0, 0, 0, 0), -1
            elif s > i and bwd[s] is not None:
                cand, nxt = _add(bwd[s], cost[s]), s
            else:
                continue
            if bwd[i] is None or cand > bwd[i]:
                bwd[i], bwd_next[i] = cand, nxt
    paths = {}
    for i in range(n):
        if cost[i][0] == 0 or fwd[i] is None or bwd[i] is None:
            continue
        chain = []
        j = i
        while j != -1:
            chain.append(j)
            j = fwd_prev[j]
        chain.reverse()
        j = bwd_next[i]
        while j not in (-1, -2):
            chain.append(j)
            j = bwd_next[j]
        key = tuple(chain)
        if key not in paths:
            flat = []
            for j in chain:
                flat.extend(ins for ins in blocks[j].instrs if ins.base != "NOP")
            score = _add(fwd[i], bwd[i])
            paths[key] = Path(-score[3], score[0], -score[2], flat, score[1])
    return list(paths.values())


def global_accesses(path: Path) -> Dict[str, Dict[str, int]]:
    out: Dict[str, Dict[str, int]] = {"loads": {}, "stores": {}}
    for ins in path.instrs:
        kind = "loads" if ins.base == "LDG" else "stores" if ins.base == "STG" else None
        if kind:
            w = str(access_width(ins.op))
            out[kind][w] = out[kind].get(w, 0) + 1
    return out


def opcode_histogram(instrs: List[Instr], top: int = 12) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for ins in instrs:
        counts[ins.base] = counts.get(ins.base, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:top])


# ---------------------------------------------------------------- variants

@dataclass
class Variant:
    backend: str
    kernel: str  # forward | grad_chunk | grad_carry
    dtype: str  # bf16 | fp32
    mode: str = "add"  # add | concat
    layout: str = "interleaved"  # interleaved | split
    math: str = "float32"  # float32 | float64
    warps_per_block: int = 4
    trips: int = 1
    rows_in_flight: int = 1  # gradient stage 1: grad_out rows a warp has in flight per order->row round trip

    @property
    def name(self) -> str:
        if self.kernel == "forward":
            return f"{self.backend}-forward-{self.dtype}-{self.mode}-{self.layout}-{self.math}"
        return f"{self.backend}-{self.kernel}-{self.dtype}"

    @property
    def elem_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    @property
    def token_width(self) -> int:
        return D_MODEL - D_POS if self.mode == "concat" else D_MODEL

    @property
    def pe_width(self) -> int:
        return D_POS if self.mode == "concat" else D_MODEL


def forward_variants(backend: str, only: Optional[str]) -> List[Variant]:
    out = []
    for dtype in ("bf16", "fp32"):
        for mode in ("add", "concat"):
            for layout in ("interleaved", "split"):
                for math in ("float32", "float64"):
                    v = Variant(backend, "forward", dtype, mode, layout, math)
                    if not only or only in v.name:
                        out.append(v)
    return out


def grad_variants(backend: str, only: Optional[str]) -> List[Variant]:
    out = []
    for kernel in ("grad_chunk", "grad_carry"):
        for dtype in ("bf16", "fp32"):
            v = Variant(backend, kernel, dtype)
            if not only or only in v.name:
                out.append(v)
    return out


# ---- Triton

def _triton_modules():
    from posenc_fast.backends import triton_backend

    kernels = triton_backend._load_kernels()
    return triton_backend, kernels


ALIGNED = ("ids_ptr", "weight_ptr", "out_ptr", "turns_ptr", "turn_low_ptr", "turn_high_ptr", "sorted_ids_ptr", "order_ptr", "grad_out_ptr",
           "grad_weight_ptr", "partials_ptr", "weight_row_stride", "out_row_stride", "token_width", "pe_width",
           "grad_out_row_stride", "num_pairs", "sin_base", "num_sin", "cos_base", "num_cos")


def _triton_compile(fn, signature, constexprs, arch, num_warps):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from posenc_fast.backends import triton_backend

    for name in constexprs:
        signature[name] = "constexpr"
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED
             if n in names and signature[n] != "constexpr"}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, **triton_backend.compile_options()})


def triton_cubins(variant: Variant, arch: int, workdir: str) -> Tuple[str, str, Variant]:
    backend, kernels = _triton_modules()
    tl_dtype = variant.dtype
    if variant.kernel == "forward":
        split = variant.layout == "split"
        pe_width = variant.pe_width
        from posenc_fast._spec import KernelParams, PEColumns

        # The launch's own parameters, so that the tiles are the ones a call of this shape gets.
        params = KernelParams(variant.mode == "concat", variant.token_width, pe_width,
                              PEColumns.of(variant.layout, pe_width, False), 1.0, 1.0, -1, variant.math == "float64")
        tiles = backend._forward_tiles(params, TOKENS, variant.elem_bytes)
        sig = {"ids_ptr": "*i64", "weight_ptr": f"*{tl_dtype}", "out_ptr": f"*{tl_dtype}", "turns_ptr": "*i64", "turn_low_ptr": "*i32",
               "turn_high_ptr": "*i32", "positions_ptr": "*i64", "offsets_ptr": "*i64", "seed_ptr": "*i64"}
        sig.update({n: "i64" if n == "offset" else "i32" for n in (
            "offset", "seq_len", "num_tokens", "num_embeddings", "weight_row_stride", "out_row_stride",
            "token_width", "pe_width", "num_pairs", "num_turns", "sin_base", "num_sin", "cos_base", "num_cos",
            "pe_zero_id", "num_copy_blocks")})
        sig.update({"embed_scale": "fp64", "pe_scale": "fp64", "dropout_threshold": "i32", "dropout_scale": "fp64"})
        # Headline: 2**19 tokens of 1024 columns and a 32768-row table fit 32-bit offsets.
        wide = backend._needs_wide_index(TOKENS, tiles.block_t, D_MODEL, GRAD_VOCAB, variant.token_width)
        constexprs = {"CONCAT": variant.mode == "concat", "INTERLEAVED": not split, "POSITION_SOURCE": 0,
                      "BLOCK_T": tiles.block_t, "BLOCK_P": tiles.block_p, "SOFTWARE_BF16": False,
                      "FLOAT64": variant.math == "float64", "DROPOUT": False, "GROUPED": False,
                      "WIDE_INDEX": wide, "ZERO_COS_TAIL": False,
                      "positions_ptr": None, "offsets_ptr": None, "seed_ptr": None}
        fn, warps = kernels.forward_kernel, tiles.warps
        if variant.mode == "add":
            variant.trips = tiles.block_t  # a program's token loop (when not unrolled)
    else:
        block_bytes = getattr(backend, "GRAD_BLOCK_BYTES", None)
        block_d = min(block_bytes // variant.elem_bytes if block_bytes else backend.GRAD_BLOCK_D, D_MODEL)
        constexprs = {"CHUNK": backend.GRAD_CHUNK, "BLOCK_D": block_d, "SOFTWARE_BF16": False}
        if variant.kernel == "grad_chunk":
            sig = {"sorted_ids_ptr": "*i32", "order_ptr": "*i64", "grad_out_ptr": f"*{tl_dtype}",
                   "grad_weight_ptr": f"*{tl_dtype}", "partials_ptr": "*fp32", "seed_ptr": "*i64",
                   "num_tokens": "i32", "num_embeddings": "i32", "token_width": "i32",
                   "grad_out_row_stride": "i32", "padding_idx": "i32", "embed_scale": "fp32",
                   "dropout_threshold": "i32"}
            constexprs.update(DROPOUT=False, seed_ptr=None)
            fn = kernels.grad_chunk_kernel
            variant.trips = backend.GRAD_CHUNK
            variant.rows_in_flight = getattr(backend, "GRAD_ROWS_IN_FLIGHT", 1)
        else:
            sig = {"sorted_ids_ptr": "*i32", "grad_weight_ptr": f"*{tl_dtype}", "partials_ptr": "*fp32",
                   "num_tokens": "i32", "num_embeddings": "i32", "token_width": "i32", "padding_idx": "i32",
                   "embed_scale": "fp32"}
            fn = kernels.grad_carry_kernel
        extra = getattr(backend, "grad_constexprs", None)
        if extra is not None:
            constexprs.update(extra(variant.kernel))
        warps = backend.GRAD_WARPS
    compiled = _triton_compile(fn, sig, constexprs, arch, warps)
    variant.warps_per_block = warps
    path = os.path.join(workdir, f"{variant.name}-sm{arch}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    return path, compiled.metadata.name, variant


# ---- CUDA

def nvcc() -> str:
    from posenc_fast import _build

    path = _build.find_nvcc()
    if path is None:
        raise FileNotFoundError("nvcc not found")
    return path


def cubin_name(source: str, arch: int) -> str:
    return f"{os.path.splitext(os.path.basename(source))[0]}-sm{arch}.cubin"


def compile_cuda(source: str, arch: int, workdir: str) -> str:
    """Compile csrc/<source> for sm_<arch> to ``workdir/cubin_name(source, arch)``; returns ptxas' ``-v`` report.

    The device code flags of ``_build.plan_build`` but its ``-lineinfo`` (line tables: the same SASS)."""
    cmd = [nvcc(), "-cubin", f"-arch=sm_{arch}", "-O3", "-std=c++17", f"-I{CSRC}", "-Xptxas", "-v",
           os.path.join(CSRC, source), "-o", os.path.join(workdir, cubin_name(source, arch))]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source} for sm_{arch}:\n{result.stdout[-4000:]}")
    return result.stdout


def cuda_cubin(source: str, arch: int, workdir: str) -> str:
    """The cubin of csrc/<source> for sm_<arch> in workdir, compiled unless there already (--cubin-dir)."""
    path = os.path.join(workdir, cubin_name(source, arch))
    if not os.path.exists(path):
        compile_cuda(source, arch, workdir)
    return path


def demangle(names: List[str]) -> Dict[str, str]:
    filt = shutil.which("c++filt") or shutil.which("cu++filt")
    if not filt:
        return {n: n for n in names}
    text = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, text.splitlines()))


def cuda_function(variant: Variant, arch: int, workdir: str) -> Tuple[str, str, Variant]:
    cpp = {"bf16": "__nv_bfloat16", "fp32": "float"}[variant.dtype]
    if variant.kernel == "forward":
        cubin = cuda_cubin(f"cuda/forward_{variant.dtype}.cu", arch, workdir)
        math = "float" if variant.math == "float32" else "double"
        interleaved = "true" if variant.layout == "interleaved" else "false"
        wanted = f"forward_kernel<{cpp}, {math}, long, {interleaved}, false, false>("
        variant.warps_per_block = 8
    else:
        cubin = cuda_cubin("cuda/weight_grad.cu", arch, workdir)
        wanted = (f"grad_chunk_kernel<{cpp}, {cpp}, int, false>(" if variant.kernel == "grad_chunk"
                  else f"grad_carry_kernel<{cpp}, int>(")
        variant.warps_per_block = 4
        if variant.kernel == "grad_chunk":
            with open(os.path.join(CSRC, "cuda", "weight_grad.cu")) as f:
                rows = int(re.search(r"kRowsInFlight\s*=\s*(\d+)", f.read()).group(1))
            variant.trips = 32 // rows  # cuda_backend.GRAD_CHUNK tokens per chunk, kRowsInFlight per trip
            variant.rows_in_flight = rows
    names = list(sass(cubin))
    for mangled, plain in demangle(names).items():
        if wanted in plain:
            return cubin, mangled, variant
    raise LookupError(f"{wanted} not in {cubin}")


# ---------------------------------------------------------------- metrics

def occupancy_warps(registers: int, warps_per_block: int, gpu: dict) -> int:
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // per_warp // warps_per_block * warps_per_block if per_warp else gpu["max_warps"]
    blocks = min(gpu["max_blocks"], by_regs // warps_per_block, gpu["max_warps"] // warps_per_block)
    return blocks * warps_per_block


def analyze(variant: Variant, cubin: str, function: str, variant_arch: int) -> dict:
    functions = sass(cubin)
    if function not in functions:  # Triton names its function after the kernel
        function = next(n for n in functions if n.endswith(function) or function in n)
    instrs = functions[function]
    usage = resource_usage(cubin).get(function, {})
    forward = variant.kernel == "forward"
    if forward:
        def stream(ins): return ins.base == "STG"
        def secondary(ins): return ins.base == "LDG" and access_width(ins.op) == 128
    else:
        def stream(ins): return ins.base == "LDG" and access_width(ins.op) == 128
        def secondary(ins): return False
    paths = hot_paths(instrs, stream, secondary, variant.trips)
    roles: Dict[str, Path] = {}
    for p in paths:
        role = "pe" if any(ins.base == "I2F" for ins in p.instrs) else "copy"
        if not forward:
            role = "rows"
        best = roles.get(role)
        # The same order as within hot_paths: a kernel whose stores are duplicated in branches (the
        # CUDA forward's add and concat PE code) has one path per copy, and the one with the
        # weight loads is the hot path of add mode (and counted for concat too, an over-count).
        if best is None or p.score > best.score:
            roles[role] = p
    e = variant.elem_bytes
    if forward:
        role_bytes = {"pe": variant.pe_width * e, "copy": (variant.token_width * e if variant.mode == "concat" else 0)}
    else:
        role_bytes = {"rows": variant.token_width * e}
    per_token = 0.0
    per_token_warps = 0.0
    fp64_per_token = 0.0
    role_report = {}
    for role, p in roles.items():
        warps = role_bytes.get(role, 0) / (32 * p.stream_bytes) if p.stream_bytes else 0.0
        fp64 = sum(1 for ins in p.instrs if FP64_OPS.match(ins.op))
        per_token += p.instructions * warps
        per_token_warps += warps
        fp64_per_token += fp64 * warps
        role_report[role] = {"instructions": p.instructions, "stream_bytes_per_thread": p.stream_bytes,
                             "warps_per_token": round(warps, 4), "global": global_accesses(p),
                             "fp64_instructions": fp64, "opcodes": opcode_histogram(p.instrs)}
    spills = sum(1 for ins in instrs if ins.base in ("LDL", "STL"))
    registers = usage.get("REG", 0)
    entry = {
        "name": variant.name, "backend": variant.backend, "kernel": variant.kernel, "dtype": variant.dtype,
        "mode": variant.mode, "layout": variant.layout, "math": variant.math,
        "function": function, "static_instructions": sum(1 for i in instrs if i.base != "NOP"),
        "registers": registers, "stack_bytes": usage.get("STACK", 0), "local_bytes": usage.get("LOCAL", 0),
        "spill_instructions": spills, "warps_per_block": variant.warps_per_block, "trips": variant.trips,
        "roles": role_report,
        "warp_instructions_per_token": round(per_token, 1),
        "instructions_per_element": round(per_token * 32 / (D_MODEL if forward else variant.token_width), 2),
        "all_stores_128bit": all(set(r["global"]["stores"]) <= {"128"} for r in role_report.values()
                                 if r["warps_per_token"] > 0),
        "gpus": {},
    }
    bytes_per_token = ID_BYTES + variant.token_width * e + D_MODEL * e if forward else None
    for gpu_name, gpu in GPUS.items():
        if gpu["arch"] != variant_arch:
            continue
        warps = occupancy_warps(registers, variant.warps_per_block, gpu)
        g = {"occupancy_warps_per_sm": warps, "occupancy": round(warps / gpu["max_warps"], 3)}
        if forward and per_token:
            cycles = per_token + fp64_per_token * (gpu["fp64_cycles"] - 1)
            t_issue = cycles * TOKENS / (gpu["sms"] * 4 * gpu["clock_GHz"] * 1e9 * gpu["issue_efficiency"])
            t_mem = bytes_per_token * TOKENS / (gpu["copy_GBps"] * 1e9)
            g.update(issue_ms=round(t_issue * 1e3, 4), memory_ms=round(t_mem * 1e3, 4),
                     predicted_ms=round(max(t_issue, t_mem) * 1e3, 4),
                     predicted_pct_of_copy=round(100 * t_mem / max(t_issue, t_mem), 1))
        if variant.kernel == "grad_chunk" and per_token:
            # Stage 1 streams grad_out rows; each needs its token from `order` first, so a warp
            # waits two dependent memory latencies per round of rows_in_flight rows (Little's law).
            grad_bytes = TOKENS * (variant.token_width * e + 12) + GRAD_VOCAB * variant.token_width * e
            t_mem = grad_bytes / (gpu["copy_GBps"] * 1e9)
            t_issue = per_token * TOKENS / (gpu["sms"] * 4 * gpu["clock_GHz"] * 1e9 * gpu["issue_efficiency"])
            row_bytes_per_warp = 32 * roles["rows"].stream_bytes / GRAD_CHUNK_TOKENS
            rounds_per_s = 1.0 / (2 * gpu["latency_ns"] * 1e-9)
            latency_bw = gpu["sms"] * warps * variant.rows_in_flight * row_bytes_per_warp * rounds_per_s
            t_latency = TOKENS * variant.token_width * e / latency_bw
            t = max(t_mem, t_issue, t_latency)
            g.update(memory_ms=round(t_mem * 1e3, 4), issue_ms=round(t_issue * 1e3, 4),
                     latency_ms=round(t_latency * 1e3, 4), predicted_ms=round(t * 1e3, 4),
                     predicted_pct_of_copy=round(100 * t_mem / t, 1), rows_in_flight=variant.rows_in_flight)
        entry["gpus"][gpu_name] = g
    return entry


# ---------------------------------------------------------------- main

def run(archs: List[int], backends: List[str], only: Optional[str], kernels: str,
        cubin_dir: Optional[str] = None) -> Dict[int, List[dict]]:
    results: Dict[int, List[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = cubin_dir or tmp
        for arch in archs:
            rows = results.setdefault(arch, [])
            for backend in backends:
                variants = []
                if kernels in ("all", "forward"):
                    variants += forward_variants(backend, only)
                if kernels in ("all", "grad"):
                    variants += grad_variants(backend, only)
                for v in variants:
                    try:
                        cubin, function, v = (triton_cubins if backend == "triton" else cuda_function)(v, arch, workdir)
                        entry = analyze(v, cubin, function, arch)
                    except Exception as exc:  # reported, not hidden: the row says why it is missing
                        entry = {"name": v.name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                    entry["arch"] = arch
                    rows.append(entry)
                    print(summary_line(entry), flush=True)
    return results


def summary_line(e: dict) -> str:
    if "error" in e:
        return f"sm_{e.get('arch')} {e['name']}: ERROR {e['error'][:300]}"
    stores = " ".join(f"{role}:" + "+".join(f"{n}x{w}" for w, n in sorted(r["global"]["stores"].items()))
                      for role, r in e["roles"].items() if r["warps_per_token"] > 0)
    pct = {g: v.get("predicted_pct_of_copy") for g, v in e["gpus"].items()}
    occ = {g: v["occupancy"] for g, v in e["gpus"].items()}
    return (f"sm_{e['arch']} {e['name']:<48} {e['warp_instructions_per_token']:>8} w-instr/token "
            f"{e['instructions_per_element']:>6}/elem regs {e['registers']:>3} spills {e['spill_instructions']} "
            f"stores {stores} occ {occ} %copy {pct}")


def main(argv: Optional[List[str]] = None) -> int:
    # Compile, never interpret: set before Triton is first imported.  Not at import, which a test
    # process does for compile_cuda while its Triton kernels stay in the interpreter.
    os.environ["TRITON_INTERPRET"] = "0"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--backend", nargs="+", default=["triton", "cuda"], choices=["triton", "cuda"])
    parser.add_argument("--kernels", default="all", choices=["all", "forward", "grad"])
    parser.add_argument("--only", default=None, help="substring of the variant names to keep")
    parser.add_argument("--json", action="store_true", help="print the entries as one JSON list last")
    # Not bench/results/ by default: a run must not overwrite the committed files unless asked to.
    parser.add_argument("--out", default="posenc_fast-bench-results",
                        help="directory for sass-sm<arch>.json (not written with --only; default: ./%(default)s; "
                             "--out bench/results replaces the committed files)")
    parser.add_argument("--cubin-dir", default=None,
                        help="directory for the cubins (default: a temporary one); CUDA cubins already there "
                             "(compile_cuda's names) are read instead of compiled again")
    args = parser.parse_args(argv)
    results = run(args.arch, args.backend, args.only, args.kernels, args.cubin_dir)
    if args.json:
        print(json.dumps([e for rows in results.values() for e in rows]))
    if args.only is None and args.out:
        os.makedirs(args.out, exist_ok=True)
        for arch, rows in results.items():
            with open(os.path.join(args.out, f"sass-sm{arch}.json"), "w") as f:
                json.dump({"arch": arch, "tokens": TOKENS, "d_model": D_MODEL, "d_pos_concat": D_POS,
                           "gpus": GPUS, "variants": rows}, f, indent=1)
    return 1 if any("error" in e for rows in results.values() for e in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
