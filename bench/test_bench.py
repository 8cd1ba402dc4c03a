"""The benchmark suite through pytest-benchmark: one test per (case, op, implementation) of
``posenc_fast.benchmark``, timed with ``benchmark.pedantic`` and a device synchronisation inside
the timed function (pytest-benchmark reads a host clock).

    pytest bench/ --benchmark-only                                # the default cases of this machine's device
    POSENC_FAST_BENCH_QUICK=1 pytest bench/ --benchmark-only      # GPU: headline + decode; CPU: cpu-headline
    POSENC_FAST_BENCH_CPU=1 pytest bench/ --benchmark-only        # the CPU cases on a GPU machine

Without a GPU it times the CPU cases (4096 tokens and more, d_model >= 512): the native CPU
backend (``cpu``, what ``auto`` runs there) beside ``eager`` and ``torch.compile``.
``POSENC_FAST_BENCH_CASES`` / ``POSENC_FAST_BENCH_IMPLS`` filter as the CLI's ``--cases`` /
``--impls`` do; ``torch.set_num_threads`` follows torch's default (``OMP_NUM_THREADS=1`` for one core).
Each result's ``extra_info``: bytes (the byte model), GBps, copy_GBps (measured once per
session), pct_copy, and the case's fields; tests are grouped by case and op, so each group
compares the implementations.  The numbers that go into bench/results/ come from
``python -m posenc_fast bench`` (CUDA events), not from here.
"""

import os
import time

import pytest
import torch

from posenc_fast import benchmark as bench
from posenc_fast import config

# Without a GPU the suite times the CPU cases; POSENC_FAST_BENCH_CPU=1 asks for them on a GPU machine too.
RUN_ON_CPU = os.environ.get("POSENC_FAST_BENCH_CPU", "0") == "1" or not torch.cuda.is_available()

DEVICE = torch.device("cpu" if RUN_ON_CPU else "cuda")
TIMED_SECONDS = 0.3 if DEVICE.type == "cuda" else 1.0  # timed rounds per test, roughly


def _env_list(name):
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


def _params():
    explicit = _env_list("POSENC_FAST_BENCH_IMPLS")
    impls = explicit or list(bench.GPU_DEFAULT_IMPLS if DEVICE.type == "cuda" else bench.CPU_DEFAULT_IMPLS)
    cases = bench.select_cases(_env_list("POSENC_FAST_BENCH_CASES"),
                               quick=os.environ.get("POSENC_FAST_BENCH_QUICK", "0") == "1", device_type=DEVICE.type)
    params = []
    for case in (bench.for_device(c, DEVICE) for c in cases):
        for impl in impls:
            if impl == "compile-max-autotune" and not (case.autotune or explicit):
                continue
            for op in case.ops:
                params.append(pytest.param(case, impl, op, id=f"{case.name}-{op}-{impl}"))
    return params


class _Built:
    """The inputs of one case and one implementation built over them, kept while consecutive tests
    use them (tests run case by case, implementation by implementation) and dropped after."""

    case = None
    inputs = None
    impl = None
    runner = None

    @classmethod
    def get(cls, case, impl):
        if cls.case != case:
            cls.inputs = cls.runner = cls.impl = None
            bench._free_memory(DEVICE)
            bench._reset_compiler()
            cls.inputs = bench.CaseInputs(case, DEVICE, bench.rotation_sets(case, DEVICE),
                                          need_grads=any(op != "forward" for op in case.ops))
            cls.case = case
        if cls.impl != impl:
            cls.runner = None
            bench._free_memory(DEVICE)
            cls.runner = bench.build_runner(impl, case, cls.inputs, DEVICE)
            cls.impl = impl
        return cls.runner, cls.inputs


_unavailable = {}


@pytest.fixture(scope="session")
def copy_GBps():
    return bench.copy_bandwidth_GBps(DEVICE)


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


@pytest.mark.parametrize("case,impl,op", _params())
def test_bench(benchmark, case, impl, op, copy_GBps):
    if impl not in _unavailable:
        _unavailable[impl] = bench.impl_unavailable(impl, DEVICE)
    if _unavailable[impl] is not None:
        pytest.skip(_unavailable[impl].splitlines()[0])
    runner, inputs = _Built.get(case, impl)
    make = {"forward": bench.forward_fn, "backward": bench.backward_fn, "step": bench.step_fn}[op]
    with config.id_check(False):
        fn = make(runner, inputs)

        def timed():
            fn()
            _sync()  # pytest-benchmark reads a host clock: the work must be done when it stops

        for _ in range(3):  # compilation, autotuning and JIT stay out of the timed rounds
            timed()
        t0 = time.perf_counter()
        timed()
        one = max(time.perf_counter() - t0, 1e-6)
        rounds = int(min(200, max(5, TIMED_SECONDS / one)))
        benchmark.group = f"{case.name} {op}"
        benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=2)
    nbytes = bench.bytes_moved(op, case)
    info = {"bytes": nbytes, "copy_GBps": copy_GBps, "op": op, "impl": impl, "dtype": case.dtype_name,
            "mode": case.mode, "tokens": case.tokens, "d_model": case.d_model, "vocab": case.vocab,
            "id_check": False, "device": bench.device_name(DEVICE),
            "floor": "copy" if DEVICE.type == "cuda" else "gather + write (torch.index_select)"}
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)  # None under --benchmark-disable
    if stats is not None and stats.median > 0:
        gbps = nbytes / stats.median / 1e9
        info.update(GBps=gbps, pct_copy=100.0 * gbps / copy_GBps)
    benchmark.extra_info.update(info)
    runner.weight.grad = None
