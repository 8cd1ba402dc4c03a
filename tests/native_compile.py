"""Compile every Triton kernel family natively for NVIDIA GPUs, without a GPU; print JSON lines.

Run in its own process with TRITON_INTERPRET=0 (Triton fixes interpreter-or-compiler
when its own library and our kernels are defined, so it cannot share a process with
interpreted kernels).  ``tests/test_triton_native_compile.py`` runs it; by hand:

    TRITON_INTERPRET=0 python tests/native_compile.py
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from posenc_fast.backends import triton_backend
from posenc_fast.backends import triton_kernels as kernels

BUNDLED_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
ARCHS = (80, 90)
# What a real launch specialises on: 16-byte aligned pointers, widths and strides divisible by 16.
ALIGNED = ("ids_ptr", "weight_ptr", "out_ptr", "turns_ptr", "turn_low_ptr", "turn_high_ptr", "positions_ptr", "offsets_ptr", "seed_ptr", "sorted_ids_ptr",
           "order_ptr", "grad_out_ptr", "grad_weight_ptr", "partials_ptr", "weight_row_stride",
           "out_row_stride", "token_width", "pe_width", "num_pairs", "grad_out_row_stride")
FORWARD_VARIANTS = [
    # (dtype, concat, split, position_source, float64 math, dropout); add mode: tiles and warps as
    # triton_backend._forward_tiles picks them for d_model 1024.  Dropout: "grouped" (one Philox call per four columns) or "any" (one per element).
    ("bf16", False, False, 0, False, None), ("bf16", False, True, 0, False, None),
    ("bf16", True, False, 1, False, None), ("bf16", True, True, 2, False, None),
    ("fp32", False, False, 2, False, None), ("fp16", False, True, 1, False, None),
    ("fp32", True, True, 0, False, None), ("fp16", True, False, 0, False, None),
    ("fp32", False, True, 0, True, None), ("bf16", False, False, 2, True, None),
    ("bf16", False, False, 0, False, "grouped"), ("bf16", False, True, 1, False, "grouped"),
    ("fp16", True, False, 0, False, "grouped"), ("fp32", True, True, 2, False, "any"),
    ("bf16", True, False, 0, False, "any"), ("fp32", False, False, 0, True, "grouped"),
]
# Triton's JIT turns an integer argument equal to 1 into a constant (a Python int in the kernel, with no
# .to() or .dtype): an offset of 1 (a decoding step), a length, a width or a count of 1.  These variants
# compile with every integer argument 1, as such a launch does.
ONE_VALUED_INTS = ("offset", "seq_len", "num_tokens", "num_embeddings", "weight_row_stride", "out_row_stride",
                   "token_width", "pe_width", "num_pairs", "num_turns", "sin_base", "num_sin", "cos_base", "num_cos",
                   "pe_zero_id", "num_copy_blocks", "dropout_threshold", "grad_out_row_stride", "padding_idx")
ONE_VALUED_FORWARD = [FORWARD_VARIANTS[i] for i in (0, 5, 7, 13)]  # add/concat, each position source, dropout
# (kernel, dtype, dropout)
GRAD_VARIANTS = [(kernel, dtype, False) for kernel in ("grad_chunk_kernel", "grad_carry_kernel")
                 for dtype in ("fp32", "fp16", "bf16")]
GRAD_VARIANTS += [("grad_chunk_kernel", "fp32", True), ("grad_chunk_kernel", "bf16", True)]


def forward_name(dtype, concat, split, position_source, float64, dropout, ints_one=False):
    return (f"forward-{dtype}-{'concat' if concat else 'add'}-{'split' if split else 'interleaved'}"
            f"-pos{position_source}{'-f64math' if float64 else ''}{f'-dropout_{dropout}' if dropout else ''}"
            f"{'-ints1' if ints_one else ''}")


def grad_name(kernel, dtype, dropout, ints_one=False):
    return f"{kernel}-{dtype}{'-dropout' if dropout else ''}{'-ints1' if ints_one else ''}"


def _ints_one(fn, constexprs):
    """``constexprs`` with every integer argument of ``fn`` that a launch can pass as 1 made the constant 1."""
    return dict(constexprs, **{name: 1 for name in ONE_VALUED_INTS if name in fn.arg_names})


def _forward_signature(dtype, position_source, dropout):
    sig = {"ids_ptr": "*i64", "weight_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "turns_ptr": "*i64", "turn_low_ptr": "*i32",
           "turn_high_ptr": "*i32", "positions_ptr": "*i64", "offsets_ptr": "*i64", "seed_ptr": "*i64"}
    sig.update({name: "i64" if name == "offset" else "i32" for name in (
        "offset", "seq_len", "num_tokens", "num_embeddings", "weight_row_stride", "out_row_stride",
        "token_width", "pe_width", "num_pairs", "num_turns", "sin_base", "num_sin", "cos_base", "num_cos",
        "pe_zero_id", "num_copy_blocks")})
    # A threshold of 2**31 or more (p >= 0.5) arrives as u32.
    sig.update({"embed_scale": "fp64", "pe_scale": "fp64", "dropout_threshold": "u32" if dropout == "any" else "i32",
                "dropout_scale": "fp64"})
    return sig


def _grad_signature(kernel, dtype):
    if kernel == "grad_chunk_kernel":
        return {"sorted_ids_ptr": "*i32", "order_ptr": "*i64", "grad_out_ptr": f"*{dtype}",
                "grad_weight_ptr": f"*{dtype}", "partials_ptr": "*fp32", "seed_ptr": "*i64", "num_tokens": "i32",
                "num_embeddings": "i32", "token_width": "i32", "grad_out_row_stride": "i32",
                "padding_idx": "i32", "embed_scale": "fp32", "dropout_threshold": "u32"}
    return {"sorted_ids_ptr": "*i32", "grad_weight_ptr": f"*{dtype}", "partials_ptr": "*fp32",
            "num_tokens": "i32", "num_embeddings": "i32", "token_width": "i32", "padding_idx": "i32",
            "embed_scale": "fp32"}


def _compile(fn, signature, constexprs, arch, num_warps):
    for name in constexprs:
        signature[name] = "constexpr"
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED
             if n in names and signature[n] != "constexpr"}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, **triton_backend.compile_options()})


def triton_ptxas(arch):
    """The ptxas Triton itself runs for ``arch``: the one that reads the PTX it emits.

    Triton sets the PTX ``.version`` from the ptxas it picks, and the pick differs across
    releases: 3.5 has one ptxas; 3.6 to 3.8 use ``ptxas-blackwell`` from sm_100; 3.9 uses it
    (CUDA 13.4, PTX 9.4) from sm_90, where its plain ``ptxas`` (CUDA 12.9) stops at PTX 8.8.
    ``TRITON_PTXAS_PATH`` / ``TRITON_PTXAS_BLACKWELL_PATH`` override it as they do for Triton."""
    try:
        from triton.backends.nvidia import compiler as nvidia
    except ImportError:
        return BUNDLED_PTXAS
    try:
        tool = nvidia.get_ptxas(arch)
    except TypeError:  # Triton 3.5: get_ptxas() takes no arch
        tool = nvidia.get_ptxas()
    return tool.path


class PtxasCannotRead(Exception):
    """ptxas is older than the PTX (e.g. ``Unsupported .version 9.4``): the test skips with the reason."""


def _ptxas(compiled, arch):
    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)  # e.g. sm_90a for Hopper
    ptxas = triton_ptxas(arch)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        result = subprocess.run([ptxas, f"-arch={target}", "-v", f.name, "-o", os.devnull],
                                capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    report = result.stderr
    if result.returncode != 0:
        if "Unsupported .version" in report:
            version = re.search(r"^\.version\s+(\S+)", ptx, re.M).group(1)
            raise PtxasCannotRead(f"{ptxas} cannot read the PTX {version} that Triton {triton.__version__} "
                                  f"emits for sm_{arch}: {report.strip()[:300]}")
        raise subprocess.CalledProcessError(result.returncode, ptxas, result.stdout, report)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spill_bytes = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    vector_ops = len(re.findall(r"\b(?:ld|st)\.global\S*\.v[24]\.", ptx))
    return {"target": target, "ptxas": ptxas, "registers": registers, "spill_bytes": spill_bytes, "vector_memory_ops": vector_ops}


def _record(name, arch, build):
    entry = {"name": name, "arch": arch}
    try:
        entry.update(_ptxas(build(), arch))
        entry["ok"] = True
    except PtxasCannotRead as exc:
        entry.update(ok=False, skip=str(exc))
    except Exception as exc:  # reported to the test, which fails with the message
        entry.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:4000])
    print(json.dumps(entry), flush=True)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    for arch in ARCHS:
        for variant, ints_one in [(v, False) for v in FORWARD_VARIANTS] + [(v, True) for v in ONE_VALUED_FORWARD]:
            dtype, concat, split, position_source, float64, dropout = variant
            if concat:  # 8 tokens x 64 / 128 pair slots (a PE of 128 / 256 columns)
                tiles = SimpleNamespace(block_t=8, block_p=128 if split else 64, warps=triton_backend.FORWARD_WARPS)
            else:
                params = SimpleNamespace(concat=False, pe_width=1024, num_pairs=512, float64_math=float64,
                                         columns=SimpleNamespace(interleaved=not split))
                tiles = triton_backend._forward_tiles(params, 1 << 19, {"bf16": 2, "fp16": 2, "fp32": 4}[dtype])
            constexprs = {"CONCAT": concat, "INTERLEAVED": not split, "POSITION_SOURCE": position_source,
                          "BLOCK_T": tiles.block_t, "BLOCK_P": tiles.block_p, "SOFTWARE_BF16": False,
                          "FLOAT64": float64, "DROPOUT": dropout is not None, "GROUPED": dropout == "grouped",
                          # 64-bit index math for one variant in four (outputs past 2**31 elements)
                          "WIDE_INDEX": FORWARD_VARIANTS.index(variant) % 4 == 3,
                          "ZERO_COS_TAIL": split and not concat and position_source == 1}
            if position_source != 2:
                constexprs["positions_ptr"] = None
            if position_source != 1:
                constexprs["offsets_ptr"] = None
            if dropout is None:
                constexprs["seed_ptr"] = None
            if ints_one:
                constexprs = _ints_one(kernels.forward_kernel, constexprs)
            _record(forward_name(*variant, ints_one), arch, lambda: _compile(
                kernels.forward_kernel, _forward_signature(dtype, position_source, dropout), constexprs, arch,
                tiles.warps))
        for (kernel, dtype, dropout), ints_one in [(v, False) for v in GRAD_VARIANTS] + [(v, True) for v in GRAD_VARIANTS]:
            constexprs = {"CHUNK": 32, "BLOCK_D": 256, "SOFTWARE_BF16": False}
            if kernel == "grad_chunk_kernel":
                constexprs["DROPOUT"] = dropout
                if not dropout:
                    constexprs["seed_ptr"] = None
            if ints_one:
                constexprs = _ints_one(getattr(kernels, kernel), constexprs)
            _record(grad_name(kernel, dtype, dropout, ints_one), arch, lambda: _compile(
                getattr(kernels, kernel), _grad_signature(kernel, dtype), constexprs, arch, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
