"""A/B of the CUDA forward kernel's build options on a GPU, in one run.

The installed extension against builds of the same csrc/ with extra preprocessor defines, timed in
alternation on the same data (with Triton's forward as a third reference row).

    python bench/cuda_forward_ab.py --build-only [--define POSENC_FORWARD_MIN_BLOCKS=1]   # build, no GPU needed
    python bench/cuda_forward_ab.py [--define ...] [--cases headline,headline-fp32] [--json FILE] [--ncu]

Two runs of the benchmark differ by a few percent from machine to machine, and a device session
is too short to rebuild and re-run the package twice, so a build option worth 5-10% is timed here
in one run: one worker process per build (Python keeps one extension module per name, so two builds
cannot share a process), each with its build loaded as the cuda backend's module, taking turns on
the GPU: each round times every variant once (do_bench, rotated order).  Every variant's output is
checked bitwise against the installed build's (a SHA-256 of the bytes) before it is timed.  Prints
the median ms per variant and case, the percent of the measured copy bandwidth (by
posenc_fast.benchmark's byte count), and the ratio to the installed build.  Builds go to ``--work``
(one folder per hash of csrc/ and define set; a finished build of the same sources is reused), for POSENC_FAST_CUDA_ARCHS (default 90).
With ``--ncu``, Nsight Compute's registers, occupancy and throughput of each build's kernel on the
first case follow.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from datetime import date

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from posenc_fast import _build  # noqa: E402
from posenc_fast.benchmark.results import write_document  # noqa: E402
from posenc_fast.cli import positive_int  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sources_digest() -> str:
    """A short hash of csrc/ (sources and headers): a build of other sources is never reused."""
    digest = hashlib.sha256()
    source_dir = os.path.join(REPO, "csrc")
    for root, _, files in sorted(os.walk(source_dir)):
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, source_dir).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:12]


def variant_dir(work: str, defines) -> str:
    return os.path.join(work, sources_digest(), "_".join(d.replace("=", "-") for d in defines) or "plain")


def build_variant(work: str, defines, log) -> str:
    """The extension built from this tree's csrc/ with ``-D`` each of ``defines``; its path."""
    build_dir = variant_dir(work, defines)
    output = os.path.join(build_dir, "posenc_fast_ab_C.so")
    if os.path.exists(output):
        return output
    nvcc = _build.find_nvcc()
    if nvcc is None:
        raise RuntimeError(_build.no_nvcc_message())
    archs = _build.parse_cuda_archs(os.environ.get("POSENC_FAST_CUDA_ARCHS") or "90")
    source_dir = os.path.join(REPO, "csrc")
    plan = _build.plan_build(source_dir, build_dir, output, nvcc, archs)
    flags = [f"-D{d}" for d in defines]
    plan = plan._replace(compiles=[cmd + flags for cmd in plan.compiles])
    os.makedirs(build_dir, exist_ok=True)
    _build.run_build(plan, build_dir, log=log)
    return output


def worker(build: str) -> int:
    """Serve the parent's requests, one JSON line each on stdin, with ``build`` as the cuda backend's
    module: about (versions, copy bandwidth), bytes, digest (SHA-256 of one forward's output), time."""
    answers = os.fdopen(os.dup(1), "w")  # the answers alone on the pipe: anything else printed goes to stderr
    os.dup2(2, 1)

    import torch

    import posenc_fast as pf
    from posenc_fast.backends import cuda_backend
    from posenc_fast.backends._extension import Extension, load_file
    from posenc_fast.benchmark.cases import CASE_BY_NAME, bytes_moved
    from posenc_fast.benchmark.timing import copy_bandwidth_GBps, time_op

    if build != "installed":  # before anything looks the module up: this process's posenc_fast._C is the build
        cuda_backend._lookup.state = Extension(load_file("posenc_fast._C", build), None)
    problem = cuda_backend.available(torch.device("cuda"))
    if problem is not None:
        print(f"worker {build}: the cuda backend is unavailable: {problem}", file=sys.stderr)
        return 2
    pf.set_id_check(False)  # as in the benchmark's timed rows: the kernels alone
    device = torch.device("cuda")
    inputs = {}

    def case_inputs(name):
        """Random ids and table (never zeros; the same in every worker) and the forward's arguments."""
        if name not in inputs:
            inputs.clear()  # one case's tensors at a time
            case = CASE_BY_NAME[name]
            g = torch.Generator(device=device).manual_seed(0)
            weight = torch.randn(case.vocab, case.token_width, device=device, dtype=case.dtype, generator=g)
            ids = torch.randint(0, case.vocab, (case.batch, case.seq_len), device=device, generator=g)
            inputs[name] = ids, weight, dict(mode=case.mode, d_pos=case.d_pos, embed_scale=case.embed_scale)
        return inputs[name]

    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "about":
            import triton

            answer = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                          triton=triton.__version__, date=date.today().isoformat(),
                          copy_GBps=round(copy_bandwidth_GBps(device), 1))
        elif op == "bytes":
            answer = dict(bytes=bytes_moved("forward", CASE_BY_NAME[request["case"]]))
        else:
            ids, weight, kw = case_inputs(request["case"])
            backend = request.get("backend", "cuda")
            run = lambda: pf.sinusoidal_embedding(ids, weight, backend=backend, **kw)  # noqa: E731
            if op == "digest":
                out = run()
                answer = dict(sha256=hashlib.sha256(out.view(torch.uint8).cpu().numpy().tobytes()).hexdigest())
            else:
                answer = dict(ms=time_op(run, device).median_ms)
        print(json.dumps(answer), file=answers, flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--define", action="append", default=None, metavar="NAME=VALUE",
                        help="one variant per --define (default: POSENC_FORWARD_MIN_BLOCKS=1, the compiler's own "
                             "register count for the 2-byte kernels); "
                             "several defines in one variant separated by commas")
    parser.add_argument("--work", default="/tmp/posenc_fast_cuda_ab")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--cases", default="headline,headline-fp32,headline-concat,wide")
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--ncu-seconds", type=float, default=40, help="time limit of each build's ncu run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a build's path, or "installed"
    args = parser.parse_args(argv)
    variants = [tuple(v.split(",")) for v in (args.define or ["POSENC_FORWARD_MIN_BLOCKS=1"])]
    os.makedirs(args.work, exist_ok=True)
    if args.build_only:
        with open(os.path.join(args.work, "build.log"), "a") as log:
            for defines in variants:
                print(f"built {build_variant(args.work, defines, log)}", flush=True)
        return 0

    builds = {"installed": "installed"}
    with open(os.path.join(args.work, "build.log"), "a") as log:
        for defines in variants:
            builds[" ".join(defines)] = build_variant(args.work, defines, log)
    if args.worker:
        return worker(args.worker)
    cases = args.cases.split(",")
    workers = {name: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--work", args.work,
                                       *[f"--define={','.join(d)}" for d in variants], "--worker", path],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
               for name, path in builds.items()}

    def ask(name, **request):
        workers[name].stdin.write(json.dumps(request) + "\n")
        line = workers[name].stdout.readline()
        if not line:
            raise RuntimeError(f"the worker of {name!r} exited (its error is above)")
        return json.loads(line)

    report = dict(what="bench/cuda_forward_ab.py", rows=[], **ask("installed", op="about"))
    names = list(builds) + ["triton"]  # Triton's row from the installed build's worker
    for case_name in cases:
        digests = {name: ask(name, op="digest", case=case_name)["sha256"] for name in builds}
        differing = [name for name, digest in digests.items() if digest != digests["installed"]]
        if differing:
            print(f"{case_name}: {differing} DIFFER bitwise from the installed build: not timed")
            return 1
        times = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                owner, backend = ("installed", "triton") if name == "triton" else (name, "cuda")
                times[name].append(ask(owner, op="time", case=case_name, backend=backend)["ms"])
        floor_bytes = ask("installed", op="bytes", case=case_name)["bytes"]
        base = statistics.median(times["installed"])
        for name in names:
            ms = statistics.median(times[name])
            row = dict(case=case_name, variant=name, median_ms=round(ms, 4),
                       copy_pct=round(100 * floor_bytes / (ms * 1e6) / report["copy_GBps"], 1),
                       vs_installed=round(ms / base, 3), rounds_ms=[round(t, 4) for t in times[name]])
            report["rows"].append(row)
            print(f"{case_name:16s} {name:32s} {ms:8.4f} ms  {row['copy_pct']:5.1f}% of copy  "
                  f"x{row['vs_installed']:.3f} of installed", flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait(timeout=60)
    write_report(args.json, report)  # before ncu, which a caller's time limit may cut
    if args.ncu and shutil.which("ncu"):
        for name, path in builds.items():
            cmd = ["ncu", "--clock-control", "none", "-k", "regex:forward_kernel", "-c", "1",
                   "--section", "Occupancy", "--section", "SpeedOfLight", "--section", "LaunchStats",
                   sys.executable, os.path.abspath(__file__), "--work", args.work,
                   *[f"--define={','.join(d)}" for d in variants], "--worker", path]
            try:
                out = subprocess.run(cmd, input=json.dumps(dict(op="digest", case=cases[0])) + "\n",
                                     capture_output=True, text=True, timeout=args.ncu_seconds)
            except subprocess.TimeoutExpired:
                print(f"ncu, {name}: did not finish in {args.ncu_seconds} s")
                continue
            keep = [line.strip() for line in out.stdout.splitlines()
                    if any(k in line for k in ("Registers Per Thread", "Achieved Occupancy", "Theoretical Occupancy",
                                               "Memory Throughput", "DRAM Throughput", "Duration", "Block Limit"))]
            print(f"ncu, {name}, {cases[0]}:\n  " + "\n  ".join(
                keep or out.stdout.splitlines()[-15:] + out.stderr.splitlines()[-5:]))
            report.setdefault("ncu", {})[name] = keep
            write_report(args.json, report)
    return 0


def write_report(path, report) -> None:
    if path:
        write_document(path, report)


if __name__ == "__main__":
    sys.exit(main())
