"""Host time per call of the layer with the kernel launch stubbed out, on any machine.

    python bench/host_overhead.py [--calls N] [--json PATH] [--entry-points]
    python bench/host_overhead.py --real cuda [--calls N] [--json PATH]      (on a GPU)
    python bench/host_overhead.py --smoke [--entry-points]      (small tables: the harness runs; tests/test_benchmark.py)

A decoding step calls the layer with a handful of tokens (the benchmark's decode case: 64 sequences
of one token, d_model 4096, vocabulary 262144), so the host path, not the GPU, sets its speed, and
users pay it on every generated token.  This times that path alone, without a GPU: the ``cuda``
backend's host-emulation build is loaded (nvcc's headers and a host compiler are needed, as for the
tests) and its launch bindings are called with zero tokens, so they convert every argument and
return before any kernel.  What is timed: the module call, its checks, the output allocation and
the binding call: after the first call, the module's prepared launch (``posenc_fast._prepared``,
``_C.ForwardLaunch`` with nine arguments), plus the stub's own Python frame (a few tenths of a us,
so the number is a little high); the general path (validation, backend choice, argument packing,
``_C.ForwardLaunch`` built and run with every argument) is timed too, with the prepared launch turned
off.  Not timed: the CUDA launch itself (cudaLaunchKernel, a few us, paid by every implementation alike).

Time is the calling thread's CPU time (``time.thread_time``), best of several repeats, so that other
processes on a shared machine inflate it less than wall time.  For scale, the eager module
(nn.Embedding + scale + PE table add) is timed on CPU tensors of width 8: its aten ops' host work
plus a negligible computation, about what eager spends on the host before its kernels launch.

``--entry-points`` adds a table of every entry point (module, functional, ``add_sinusoidal`` and
its module), in inference and in training, on ``cuda`` (zero-token launches, as above), on ``triton``
(Triton's real JIT and launcher, the kernels compiled for an H100, onto a stand-in CUDA driver whose
launch returns at once: bench/fake_cuda_driver.py; a prepared launch's repeated calls go through the kept
kernel's launch function onto the same stand-in; so, like the ``cuda`` rows, everything but the driver's
launch call; where that driver cannot be built, the kernels are stubbed and only our host work
is timed, as the output says), on ``cpu`` twice (with zero-token launches on the same case as ``cuda``: its
host work alone; then running its kernel on a tiny case) and on ``torch`` (its kernels run for real on the
tiny case, so a few us of compute are included).

``--real cuda`` times the decode case as a user runs it on a GPU instead: real tensors, real launches
(Triton's launcher and cudaLaunchKernel included), the calling thread's CPU time per call for
``auto`` and each GPU backend, in inference and training, and eager's module on the same tensors.
The kernels run asynchronously and take less than the host path here, so the thread's time is the
host time (the stream is synchronised after each repeat).  ``--real cpu`` runs the same on the CPU
backends (a dry run of the harness without a GPU; there the kernels' compute is included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # fake_cuda_driver, beside this file

import posenc_fast as pf  # noqa: E402
from posenc_fast import _build, _prepared, baselines  # noqa: E402
from posenc_fast.backends import cpu_backend, cuda_backend  # noqa: E402

# The bound: fusing never costs host time against the eager layer it replaces, timed in the same run.
EAGER_RATIO_BOUND = 1.0


class _ZeroTokenLaunches:
    """The real binding, but every forward is called with zero tokens: its arguments are converted
    and checked as always, and it returns before launching anything."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def ForwardLaunch(self, *static):  # noqa: N802 (the binding's class name)
        return _ZeroTokenLaunch(self._module.ForwardLaunch(*static))


class _ZeroTokenLaunch:
    """A ``ForwardLaunch`` whose calls (the prepared launch's ``__call__``, the general path's ``run``) pass
    zero tokens."""

    def __init__(self, launch):
        self._launch = launch

    def __call__(self, ids, ids_dtype, weight, weight_row_stride, out, offset, seq_len, num_tokens, last):
        return self._launch(ids, ids_dtype, weight, weight_row_stride, out, offset, seq_len, 0, last)

    def run(self, ids, ids_dtype, weight, weight_row_stride, out, positions, offsets, offset, seq_len, num_tokens,
            *rest):
        return self._launch.run(ids, ids_dtype, weight, weight_row_stride, out, positions, offsets, offset, seq_len,
                                0, *rest)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


WARMUP_CALLS = 200  # before each repeat (--smoke: 20)


def per_call_us(fn, calls: int, repeats: int = 7, sync=lambda: None) -> float:
    best = float("inf")
    for _ in range(repeats):
        for _ in range(WARMUP_CALLS):
            fn()
        sync()
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
        sync()
    return best


def inference_and_training_us(call, calls: int, sync=lambda: None) -> dict:
    """{"inference": us, "training": us} per call of ``call``, id check off: under ``no_grad``, then with
    grad enabled (where ``call`` has a trainable input, each call makes an autograd node)."""
    with pf.id_check(False):
        with torch.no_grad():
            inference = per_call_us(call, calls, sync=sync)
        return {"inference": inference, "training": per_call_us(call, calls, sync=sync)}


def real_device_table(device: torch.device, calls: int, num_sequences: int, d_model: int, vocab: int) -> dict:
    """{implementation: {"inference": us, "training": us}}: host time per decode call on ``device`` with
    real launches, id check off, bf16 on a GPU (the benchmark's decode case), fp32 on the CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, vocab, (num_sequences, 1), device=device)
    backends = ("auto", "cuda", "triton") if device.type == "cuda" else ("auto", "cpu")
    table = {}
    for backend in backends:
        try:
            layer = pf.SinusoidalEmbedding(vocab, d_model, embed_scale=d_model ** 0.5, backend=backend,
                                           device=device, dtype=dtype)
            layer(ids, offset=17)
        except Exception as error:  # a backend this machine cannot run: said, not timed
            table[backend] = {"unavailable": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            continue
        table[backend] = inference_and_training_us(lambda: layer(ids, offset=17), calls, sync=sync)
        del layer
    eager = baselines.EagerSinusoidalEmbedding(vocab, d_model, max_len=64, embed_scale=d_model ** 0.5,
                                               device=device, dtype=dtype)
    table["eager (nn.Embedding + scale + add)"] = inference_and_training_us(lambda: eager(ids), calls, sync=sync)
    return table


# The entry-point table: every entry point, inference (no autograd) and training (autograd node), per backend.
# ``cuda``: the host-emulation build with zero-token launches, as above (host work only); ``cpu`` so too, then,
# with ``torch``, running its kernels for real on a tiny case (TABLE_* below: a few us of compute included).
TABLE_TOKENS, TABLE_WIDTH, TABLE_VOCAB = 64, 8, 1000


def _entry_points(backend: str, width: int, vocab: int, device=None, dtype=None, tokens: int = TABLE_TOKENS):
    """name -> (make() -> (call(), trainable tensor)) for each entry point (CPU fp32 tensors by default)."""
    on = dict(device=device, dtype=dtype)

    def module():
        layer = pf.SinusoidalEmbedding(vocab, width, embed_scale=width ** 0.5, backend=backend, **on)
        ids = torch.randint(0, vocab, (tokens, 1), device=device)
        return (lambda: layer(ids, offset=17)), layer.weight

    def functional():
        weight = torch.randn(vocab, width, requires_grad=True, **on)
        ids = torch.randint(0, vocab, (tokens, 1), device=device)
        return (lambda: pf.sinusoidal_embedding(ids, weight, offset=17, embed_scale=width ** 0.5,
                                                backend=backend)), weight

    def add_function():
        x = torch.randn(tokens, 1, width, requires_grad=True, **on)
        return (lambda: pf.add_sinusoidal(x, offset=17, backend=backend)), x

    def add_module():
        layer = pf.SinusoidalPositionalEncoding(width, backend=backend, device=device)
        x = torch.randn(tokens, 1, width, requires_grad=True, **on)
        return (lambda: layer(x, offset=17)), x

    return {"SinusoidalEmbedding": module, "sinusoidal_embedding": functional, "add_sinusoidal": add_function,
            "SinusoidalPositionalEncoding": add_module}


class _NoTritonLaunch:
    """Stands for a Triton kernel: ``kernel[grid](...)`` returns at once, so that the ``triton`` backend's
    host work (ours, before Triton's launcher) can be timed where the stand-in driver cannot be built."""

    def __getitem__(self, grid):
        return _no_launch


def _no_launch(*args, **kwargs):
    return None


def _triton_on_a_stand_in_driver():
    """Point the triton backend at Triton's real JIT and launcher over the stand-in CUDA driver
    (bench/fake_cuda_driver.py: kernels compiled for sm_90, launches that return at once), on CPU tensors
    taken for device 0's; else, where that driver cannot be built, at stub kernels (our host work only).
    Returns (what was timed, a function that restores the backend), or None where Triton is not installed."""
    try:
        import triton
    except ImportError:
        return None
    from types import SimpleNamespace

    import fake_cuda_driver
    from posenc_fast.backends import triton_backend

    saved = (triton_backend.triton, triton_backend._Kernels.state, triton_backend._kernels_interpreted,
             triton_backend.available, triton_backend.interpreting, triton_backend.KeptLaunches)
    why_not = fake_cuda_driver.unavailable()
    if why_not is None and (triton_backend._kernels_interpreted or triton_backend.interpreting()):
        why_not = "Triton's interpreter is on (TRITON_INTERPRET)"
    if why_not is None:
        restore_driver = fake_cuda_driver.install()
        triton_backend._load_kernels()  # compiled, not interpreted (checked above)
        real_compiled_launches = triton_backend.KeptLaunches

        class OnDeviceZero(real_compiled_launches):
            """The prepared launch's compiled kernels as on device 0 (the tensors are on the CPU here)."""

            def __init__(self, kernel, device_index):
                super().__init__(kernel, 0)
                self._current_device = _device_zero

        triton_backend.KeptLaunches = OnDeviceZero
        timed = ("Triton's JIT, then the kept kernel's launch function, onto a stand-in driver "
                 "(bench/fake_cuda_driver.py)")
    else:
        restore_driver = None
        stub = SimpleNamespace(forward_kernel=_NoTritonLaunch(), grad_chunk_kernel=_NoTritonLaunch(),
                               grad_carry_kernel=_NoTritonLaunch())
        triton_backend.triton, triton_backend._Kernels.state, triton_backend._kernels_interpreted = triton, stub, False
        timed = f"ours up to Triton's launcher, which is stubbed (no stand-in driver: {why_not})"
    triton_backend.available = lambda device: None
    triton_backend.interpreting = lambda: True  # the prepared launch's check for CPU tensors

    def restore():
        (triton_backend.triton, triton_backend._Kernels.state, triton_backend._kernels_interpreted,
         triton_backend.available, triton_backend.interpreting, triton_backend.KeptLaunches) = saved
        if restore_driver is not None:
            restore_driver()
    return timed, restore


def _triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _device_zero() -> int:
    return 0


def entry_point_table(calls: int, gpu_case=(4096, 262144)):
    """{backend: {entry point: {"inference": us, "training": us}}} and eager's own, id check off; and
    {backend: what its rows time} where that is not said above (triton).  ``gpu_case``: the width and
    vocabulary of the ``cuda`` and ``triton`` rows and of ``cpu``'s zero-token rows."""
    table, timed = {}, {}
    # The host extension, built here where a checkout has none yet (as backend='cpu' builds it: not with
    # POSENC_FAST_BUILD_ON_DEMAND=0): the cpu rows run it.
    cpu_backend.prepare(torch.device("cpu"))
    host_problem = cpu_backend.extension_problem()
    if host_problem is not None:
        print(f"host_overhead: no host extension ({host_problem}); the cpu rows fail", file=sys.stderr)
    # (backend, whether its kernels are left out): ``cpu`` twice, its launches made with zero tokens as the
    # ``cuda`` rows' (its host work alone, on the same case), then running its kernel on a tiny case.
    for backend, host_only in (("cuda", True), ("triton", True), ("cpu", True), ("cpu", False), ("torch", False)):
        restore = None
        if backend == "triton":
            triton_setup = _triton_on_a_stand_in_driver()
            if triton_setup is None:
                continue  # Triton not installed
            timed["triton"], restore = triton_setup
        elif backend == "cpu" and host_only:
            if cpu_backend.extension() is None:
                continue  # (no zero-token rows; the tiny case's rows then fail, naming why)
            real_state = cpu_backend._lookup()
            cpu_backend._lookup.state = real_state._replace(module=_ZeroTokenLaunches(real_state.module))
            restore = lambda: setattr(cpu_backend._lookup, "state", real_state)  # noqa: E731
        try:
            width, vocab = gpu_case if host_only else (TABLE_WIDTH, TABLE_VOCAB)
            label = f"{backend} (d {width}, zero-token launches)" if backend == "cpu" and host_only else \
                f"{backend} (d {width})"
            rows = table[label] = {}
            # Each entry point made and timed twice, the better kept: on the 2-core VM a whole entry point
            # (inference, all seven repeats) sometimes read about 5 us slow, in one run and not the next,
            # and not again when made afresh; the cause was not found (no system call per call).
            for _ in range(2):
                for name, make in _entry_points(backend, width, vocab).items():
                    call, trainable = make()
                    us = inference_and_training_us(call, calls)
                    del call, trainable
                    best = rows.get(name, us)
                    rows[name] = {part: min(us[part], best[part]) for part in us}
        finally:
            if restore is not None:
                restore()  # (triton: launches prepared on the stubs are no longer current, their kernel module)
    eager = baselines.EagerSinusoidalEmbedding(TABLE_VOCAB, TABLE_WIDTH, max_len=32, embed_scale=TABLE_WIDTH ** 0.5)
    ids = torch.randint(0, TABLE_VOCAB, (TABLE_TOKENS, 1))
    table[f"eager (nn.Embedding + scale + add, d {TABLE_WIDTH})"] = {
        "nn.Module": inference_and_training_us(lambda: eager(ids), calls)}
    return table, timed


# The triton backend's launches on a real GPU, timed side by side: the kept compiled kernel through its launch
# function (the default), and the JIT's ``kernel[grid]`` on every call.
TRITON_ROUTES = ("kept kernel", "JIT kernel[grid]")


def _triton_route(route: str):
    """Make launches prepared from now on take ``route``, with no launch prepared before (the functional entry
    points keep theirs per spec); returns a function that restores the default."""
    from posenc_fast import _prepared
    from posenc_fast.backends import triton_launch
    saved_range = triton_launch.TESTED_TRITON
    _prepared.forget_functional_launches()
    if route == "JIT kernel[grid]":
        triton_launch.TESTED_TRITON = ((0, 0), (0, 0))  # no release in range: nothing is kept

    def restore():
        triton_launch.TESTED_TRITON = saved_range
    return restore


def real_entry_point_table(device: torch.device, calls: int, tokens: int, width: int, vocab: int) -> dict:
    """{row: {entry point: {"inference": us, "training": us}}}: every entry point with real launches on
    ``device`` (bf16 on a GPU), each backend (triton once per launch route) and eager's equivalents timed in
    the same run: ``nn.Embedding`` + scale + add of a table slice for the embeddings, ``x`` + a table slice for
    ``add_sinusoidal`` and its module."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = [("auto", "auto", None), ("cuda", "cuda", None)] if device.type == "cuda" else [("auto", "auto", None)]
    if _triton_version() is not None:
        rows += [(f"triton ({route})", "triton", route) for route in TRITON_ROUTES]
    table = {}
    for label, backend, route in rows:
        restore = _triton_route(route) if route is not None else None
        try:
            entries = table[label] = {}
            for _ in range(2):  # made and timed twice, the better kept (entry_point_table says why)
                for name, make in _entry_points(backend, width, vocab, device, dtype, tokens).items():
                    try:
                        call, trainable = make()
                        call()
                    except Exception as error:  # a backend this machine cannot run: said, not timed
                        entries[name] = {"unavailable": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
                        continue
                    us = inference_and_training_us(call, calls, sync=sync)
                    del call, trainable
                    best = entries.get(name, us)
                    entries[name] = {part: min(us[part], best[part]) for part in us}
        finally:
            if restore is not None:
                restore()
    eager = baselines.EagerSinusoidalEmbedding(vocab, width, max_len=64, embed_scale=width ** 0.5, device=device,
                                               dtype=dtype)
    ids = torch.randint(0, vocab, (tokens, 1), device=device)
    pe = eager.pe
    x = torch.randn(tokens, 1, width, device=device, dtype=dtype, requires_grad=True)
    table["eager"] = {
        "embedding (nn.Embedding + scale + add)": inference_and_training_us(lambda: eager(ids), calls, sync=sync),
        "add (x + table slice)": inference_and_training_us(lambda: (x + pe[17:18]).to(x.dtype), calls, sync=sync)}
    return table


def print_real_entry_point_table(table: dict) -> None:
    """Each row against eager's equivalent: inference / training us, and the ratios."""
    eager = table["eager"]
    eager_of = {"SinusoidalEmbedding": "embedding (nn.Embedding + scale + add)",
                "sinusoidal_embedding": "embedding (nn.Embedding + scale + add)",
                "add_sinusoidal": "add (x + table slice)", "SinusoidalPositionalEncoding": "add (x + table slice)"}
    for label, entries in table.items():
        for name, us in entries.items():
            if "unavailable" in us:
                print(f"  {label:36s} {name:40s} unavailable: {us['unavailable']}")
            elif label == "eager":
                print(f"  {label:36s} {name:40s} {us['inference']:6.1f} / {us['training']:6.1f}")
            else:
                base = eager[eager_of[name]]
                print(f"  {label:36s} {name:40s} {us['inference']:6.1f} / {us['training']:6.1f}   "
                      f"{us['inference'] / base['inference']:.2f}x / {us['training'] / base['training']:.2f}x eager")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000, help="calls per repeat")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--real", metavar="DEVICE",
                        help="time real calls on DEVICE (cuda on a GPU; cpu for a dry run) instead of stubbed launches")
    parser.add_argument("--entry-points", action="store_true",
                        help="also time every backend and entry point, inference and training")
    parser.add_argument("--smoke", action="store_true",
                        help="a run of the harness on small tables (d_model 64, vocab 1000; 4 GiB tables otherwise) "
                             "with few calls: it checks that everything runs, its numbers mean little")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    if args.real:
        try:
            real = torch.device(args.real)
        except RuntimeError:
            parser.error(f"--real {args.real!r} is not a device name (cuda, cuda:1, cpu)")
        if real.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--real {args.real}: this torch sees no CUDA device (torch {torch.__version__})")

    num_sequences, d_model, vocab = (64, 64, 1000) if args.smoke else (64, 4096, 262144)
    if args.smoke:
        global WARMUP_CALLS
        WARMUP_CALLS = 20
        if args.calls == parser.get_default("calls"):
            args.calls = 20
    if args.real:
        return _main_real(real, args, num_sequences, d_model, vocab)
    cuda_backend.use_host_emulation(_build.build_host_emulation())
    loaded = cuda_backend._lookup()
    cuda_backend._lookup.state = loaded._replace(module=_ZeroTokenLaunches(loaded.module))
    layer = pf.SinusoidalEmbedding(vocab, d_model, backend="cuda")
    ids = torch.randint(0, vocab, (num_sequences, 1))
    rows = {}
    with torch.no_grad():
        with pf.id_check(False):
            rows["layer, id check off"] = per_call_us(lambda: layer(ids, offset=17), args.calls)
            if layer._prepared is None:
                raise RuntimeError("the layer's calls did not run a prepared launch: the number above is not "
                                   "the one this harness is meant to report")
        rows["layer, id check on"] = per_call_us(lambda: layer(ids, offset=17), args.calls)
        with pf.id_check(False):
            # A stand-in launch that serves no call and is never prepared again: every call takes the general path.
            layer._prepared = _prepared._NoForward(layer.spec, layer.backend, layer.dropout, layer.weight)
            rows["layer, general path (no prepared launch), id check off"] = per_call_us(
                lambda: layer(ids, offset=17), args.calls)
            layer._prepared = None
    with pf.id_check(False):  # grad enabled and a trainable table: an autograd node per call
        rows["layer, training forward (autograd), id check off"] = per_call_us(lambda: layer(ids, offset=17),
                                                                             args.calls)
    eager = baselines.EagerSinusoidalEmbedding(vocab, 8, max_len=8)
    with torch.no_grad():
        rows["eager module, CPU, width 8 (host work + tiny compute)"] = per_call_us(lambda: eager(ids), args.calls)
    table, timed = entry_point_table(args.calls, (d_model, vocab)) if args.entry_points else (None, None)
    cuda_backend.use_host_emulation(None)

    print(f"host time per call, decode case ({num_sequences} tokens, d_model {d_model}, vocab {vocab}), "
          f"kernel launch stubbed; torch {torch.__version__}")
    for label, us in rows.items():
        print(f"  {label:56s} {us:6.1f} us")
    if table is not None:
        print(f"every entry point, {TABLE_TOKENS} tokens, id check off (cuda and cpu zero-token launches: host work "
              f"only; triton: as below; cpu, torch: vocab {TABLE_VOCAB}, tiny compute included): inference / training "
              "us per call")
        for backend, what in timed.items():
            print(f"  ({backend}: {what})")
        for backend, entries in table.items():
            for name, us in entries.items():
                print(f"  {backend:42s} {name:30s} {us['inference']:6.1f} / {us['training']:6.1f}")
    ratio = rows["layer, id check off"] / rows["eager module, CPU, width 8 (host work + tiny compute)"]
    print(f"layer / eager, inference, id check off: {ratio:.2f}x (bound {EAGER_RATIO_BOUND:g}x: "
          f"{'met' if ratio <= EAGER_RATIO_BOUND else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": {"tokens": num_sequences, "d_model": d_model, "vocab": vocab}, "smoke": args.smoke,
                       "device": _cpu_name(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
                       "torch": torch.__version__, "clock": "time.thread_time, best of 7 (entry points: of 2 x 7, made twice)",
                       "us_per_call": rows, "eager_ratio_bound": EAGER_RATIO_BOUND,
                       "entry_points_us_per_call": table, "entry_points_timed": timed,
                       "triton": _triton_version()}, f, indent=2)
    return 0


def _main_real(device, args, num_sequences, d_model, vocab) -> int:
    table = real_device_table(device, args.calls, num_sequences, d_model, vocab)
    entry_points = None
    if args.entry_points:
        entry_points = real_entry_point_table(device, args.calls, num_sequences, d_model, vocab)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    print(f"host time per call (thread CPU time, real launches), decode case ({num_sequences} tokens, d_model "
          f"{d_model}, vocab {vocab}), id check off, on {name}; torch {torch.__version__}: inference / training us")
    for impl, us in table.items():
        if "unavailable" in us:
            print(f"  {impl:40s} unavailable: {us['unavailable']}")
        else:
            print(f"  {impl:40s} {us['inference']:6.1f} / {us['training']:6.1f}")
    if entry_points is not None:
        print("every entry point, real launches, id check off: inference / training us per call, and against "
              "eager's equivalent timed in the same run")
        print_real_entry_point_table(entry_points)
    eager = table["eager (nn.Embedding + scale + add)"]
    for mode in ("inference", "training"):
        if "unavailable" in table["auto"]:
            break  # (said in the table above)
        ratio = table["auto"][mode] / eager[mode]
        print(f"auto / eager, {mode}: {ratio:.2f}x (bound {EAGER_RATIO_BOUND:g}x: "
              f"{'met' if ratio <= EAGER_RATIO_BOUND else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": {"tokens": num_sequences, "d_model": d_model, "vocab": vocab}, "device": name,
                       "host": _cpu_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                       "clock": "time.thread_time, best of 7, real launches", "eager_ratio_bound": EAGER_RATIO_BOUND,
                       "us_per_call": table, "entry_points_us_per_call": entry_points,
                       "triton": _triton_version()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
