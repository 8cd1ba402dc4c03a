"""Same-process A/B of the CPU forward kernel: a git revision's csrc/cpu/cpu_kernels.cpp against the working tree's.

    python bench/cpu_kernel_ab.py [--base HEAD] [--shapes 8x512,64x64,4096x1,1x4096] [--repeats 200]
                                  [--isa isa_avx2] [--offsets scalar|equal|distinct|padded]

Separate runs on a small shared VM differ by up to 2x, so a kernel change of a few percent
cannot be seen by timing the package before and after.  This builds both versions of the kernel file into one
program (bench/cpu_kernel_ab.cpp, with the package's own compile flags for the best ISA variant this CPU has)
and calls them alternately on the same data, warm (back to back), cold (after 96 MiB of other writes) and
fresh (warm tables, the output cycling through three buffers, as a module's newly allocated outputs do).
Prints p10 and median per version, the median ratio new / base (below 1: the working tree is faster), and
whether the two versions' outputs of the case are the same bits.
Run it on an idle machine: where one version splits a case over more threads than the other, load from other
processes penalises only that one.  Needs Linux on x86 (the AVX-512 or AVX2 variant's flags, read from
/proc/cpuinfo), a C++ compiler with OpenMP (-fopenmp), and a base revision with the same csrc/cpu/cpu_kernels.h and
csrc/common/kernel_args.h.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from posenc_fast import _build  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFSETS = ("scalar", "equal", "distinct", "padded")  # bench/cpu_kernel_ab.cpp's codes 0, 1, 2, 3


def isa_flags(requested: str = "best") -> list:
    """The package's flags for the requested variant (isa_avx512, isa_avx2, isa_baseline), or for the best one
    this CPU runs (CPU_X86_VARIANTS is ordered best first)."""
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    needs = {"isa_avx512": {"avx512f", "avx512dq", "avx512bw", "avx512vl"}, "isa_avx2": {"avx2", "fma", "bmi2", "f16c"}}
    for name, variant_flags in _build.CPU_X86_VARIANTS:
        if requested in ("best", name) and needs.get(name, set()) <= flags:
            return variant_flags
    if requested != "best":
        sys.exit(f"--isa {requested}: not a variant this CPU runs")
    return []


def build(base: str, workdir: str, isa: str = "best") -> str:
    cxx = _build.find_cxx()
    if cxx is None:
        sys.exit("no C++ compiler found")
    same_header = subprocess.run(["git", "-C", REPO, "diff", "--quiet", base, "--", "csrc/cpu/cpu_kernels.h",
                                  "csrc/common/kernel_args.h"])
    if same_header.returncode != 0:
        sys.exit(f"csrc/cpu/cpu_kernels.h or csrc/common/kernel_args.h differs between {base} and the working "
                 "tree: the two builds could not share one ForwardArgs")
    base_dir = os.path.join(workdir, "base")
    os.makedirs(base_dir)
    archive = subprocess.run(["git", "-C", REPO, "archive", base, "csrc"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", base_dir], input=archive, check=True)
    common = [cxx, "-std=c++17", "-O3", "-fopenmp", "-pthread"] + isa_flags(isa)
    roots = {"isa_a": os.path.join(base_dir, "csrc"), "isa_b": os.path.join(REPO, "csrc")}
    objects = [os.path.join(workdir, namespace + ".o") for namespace in roots]
    compiles = [subprocess.Popen(common + [f"-DPOSENC_CPU_ISA={namespace}", f"-I{root}", "-c",
                                           os.path.join(root, _build.CPU_SOURCES[0]), "-o", obj])
                for (namespace, root), obj in zip(roots.items(), objects)]
    if any(process.wait() != 0 for process in compiles):
        sys.exit("compiling cpu_kernels.cpp failed")
    program = os.path.join(workdir, "cpu_kernel_ab")
    subprocess.run(common + [f"-I{os.path.join(REPO, 'csrc')}", os.path.join(REPO, "bench", "cpu_kernel_ab.cpp")]
                   + objects + ["-o", program], check=True)
    return program


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--shapes", default="8x512,64x64,4096x1,1x4096", help="batch x length, comma-separated")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--offsets", default="scalar", choices=OFFSETS,
                        help="the positions: a scalar offset 0 (default), per-sequence offsets all 0 (the same "
                             "positions, given per sequence), per-sequence offsets 1000 apart (every token of a "
                             "column at its own position), or padded: a positions tensor as make_positions gives "
                             "right-padded sequences (padding_idx 1, zero PE at padding; sequence b keeps "
                             "length - b * length / (2 * batch) real tokens)")
    parser.add_argument("--isa", default="best", choices=["best"] + [name for name, _ in _build.CPU_X86_VARIANTS],
                        help="the instruction-set variant's flags to build both versions with (default: the best this "
                             "CPU runs)")
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    with tempfile.TemporaryDirectory() as workdir:
        program = build(args.base, workdir, args.isa)
        where = {"scalar": "a scalar offset", "equal": "equal per-sequence offsets",
                 "distinct": "distinct per-sequence offsets", "padded": "right-padded make_positions"}[args.offsets]
        print(f"V {args.vocab}, d {args.d}, fp32, {args.isa} ISA, {where}, {args.threads} threads, "
              f"{args.repeats} alternating calls each; base {args.base} vs working tree; ms")
        print(f"{'shape':>8} {'cache':>5} {'base p10':>9} {'base med':>9} {'new p10':>9} {'new med':>9} {'new/base':>9} "
              f"{'bits':>6}")
        for shape in args.shapes.split(","):
            batch, length = (int(n) for n in shape.split("x"))
            for cold in (0, 1, 2):
                line = subprocess.run([program, str(args.vocab), str(args.d), str(batch), str(length), str(args.threads),
                                       str(args.repeats), str(cold), str(OFFSETS.index(args.offsets))],
                                      check=True, capture_output=True, text=True).stdout
                *quantiles, same = line.split()
                a10, a50, b10, b50 = (float(x) for x in quantiles)
                ratio = b50 / a50 if a50 > 0 else float("nan")
                print(f"{shape:>8} {('warm', 'cold', 'fresh')[cold]:>5} {a10:9.4f} {a50:9.4f} {b10:9.4f} {b50:9.4f} "
                      f"{ratio:9.2f} {'same' if same == '1' else 'DIFFER':>6}")


if __name__ == "__main__":
    main()
