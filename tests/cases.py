"""One case list and one backend list, shared by every test that compares a backend with the reference.

A new backend is one entry in ``backend_targets``; a new case is one entry in ``CASES``.

Slow tests carry ``pytest.mark.slow`` (deselected by the default run, pyproject.toml's addopts) where they
are defined: ``targets(slow_on_interpreter=why)`` marks a test's triton-interpreter target, and
``cases_on_targets`` marks the (case, triton-interpreter) pairs of the cases whose ``slow_on_interpreter``
says why.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Tuple

import pytest
import torch


def backend_targets():
    """(backend, device) pairs that can run here, as pytest params.

    Without a GPU, the CUDA backend's kernels run compiled for the host ("cuda-host-emulation",
    built once per user by ``posenc_fast._build.build_host_emulation``; needs nvcc's headers and a
    C++ compiler; POSENC_FAST_TEST_CUDA_EMULATION=0 leaves it out), as Triton's run in its interpreter.
    The CPU backend ("cpu") runs wherever its extension is installed or a C++ compiler can build it.
    """
    targets = [pytest.param("torch", "cpu", id="torch-cpu")]
    if cpu_extension_problem() is None:
        targets.append(pytest.param("cpu", "cpu", id="cpu"))
    triton_ok = True
    try:
        import triton  # noqa: F401
    except Exception:
        triton_ok = False
    if torch.cuda.is_available():
        targets.append(pytest.param("torch", "cuda", id="torch-cuda"))
        if triton_ok:
            targets.append(pytest.param("triton", "cuda", id="triton-cuda"))
        if cuda_extension_problem() is None:
            targets.append(pytest.param("cuda", "cuda", id="cuda"))
    else:
        if triton_ok:
            targets.append(pytest.param("triton", "cpu", id="triton-interpreter"))
        if cuda_host_emulation_problem() is None:
            targets.append(pytest.param("cuda", "cpu", id="cuda-host-emulation"))
    return targets


INTERPRETER = "triton-interpreter"  # the id of the target that runs the Triton kernels in Triton's interpreter


@dataclasses.dataclass(frozen=True)
class BackendTraits:
    """What the tests expect of a backend beyond the reference's numbers: a new backend is a row of
    ``BACKEND_TRAITS`` (and its target in ``backend_targets``)."""

    prepared_launch: bool  # repeated eager calls take a prepared launch (the backend has prepare_forward)
    exported: bool  # tests/test_export.py runs torch.export programs of it (on CPU tensors)
    example: Tuple[str, str]  # examples/train_tiny_lm.py's --pe and --dropout for its run (tests/test_examples.py)
    example_slow: Optional[str] = None  # why that run is slow, if it is


BACKEND_TRAITS = {
    "torch": BackendTraits(prepared_launch=False, exported=True, example=("concat", "0")),
    "cpu": BackendTraits(prepared_launch=True, exported=True, example=("add", "0.1")),
    "triton": BackendTraits(prepared_launch=True, exported=False, example=("add", "0"),
                            example_slow="a training run through Triton (its interpreter without a GPU): ~20 s"),
    "cuda": BackendTraits(prepared_launch=True, exported=False, example=("concat", "0.1")),
}
PREPARED_BACKENDS = tuple(name for name, traits in BACKEND_TRAITS.items() if traits.prepared_launch)


def _marked_slow(param, why):
    """``param`` marked slow only because Triton's interpreter runs it (``interpreter``: .ci/run leaves these
    to GPU runs, where the same cases run natively in the default run)."""
    return pytest.param(*param.values, id=param.id,
                        marks=(*param.marks, pytest.mark.slow(reason=why), pytest.mark.interpreter))


def targets(slow_on_interpreter: Optional[str] = None):
    """``backend_targets()``; with ``slow_on_interpreter`` (why: what takes long, and how long), the
    triton-interpreter target is marked slow, the others run in the default run."""
    params = backend_targets()
    if slow_on_interpreter is None:
        return params
    return [_marked_slow(p, slow_on_interpreter) if p.id == INTERPRETER else p for p in params]


def gpu_kernel_backends():
    """The names of the targets' backends that run kernels of their own on a GPU (every one but the
    reference's torch ops); empty without a GPU."""
    return [p.values[0] for p in backend_targets() if p.values[1] == "cuda" and p.values[0] != "torch"]


def cases_on_targets(cases, dtypes):
    """(case, dtype, backend, device) params for every case, dtype and target, with the ids (and order) of
    the three parametrize decorators case, dtype, target; the triton-interpreter target is marked slow
    for the cases with a ``slow_on_interpreter`` reason."""
    params = []
    for case, dtype, target in itertools.product(cases, dtypes, backend_targets()):
        param = pytest.param(case, dtype, *target.values, id=f"{case.name}-{dtype}-{target.id}", marks=target.marks)
        if case.slow_on_interpreter and target.id == INTERPRETER:
            param = _marked_slow(param, case.slow_on_interpreter)
        params.append(param)
    return params


def cuda_extension_problem():
    """None if the built CUDA extension (posenc_fast._C) loads, else why not."""
    from posenc_fast.backends import cuda_backend

    return cuda_backend.extension_problem()


def cpu_extension_problem():
    """None if the CPU extension (posenc_fast._cpu) is installed or builds here (into the per-user
    cache, from a source checkout), else why not; POSENC_FAST_TEST_CPU=0 leaves the target out."""
    import os

    from posenc_fast.backends import cpu_backend

    if os.environ.get("POSENC_FAST_TEST_CPU", "1") == "0":
        return "POSENC_FAST_TEST_CPU=0"
    return cpu_backend.build_on_demand()


_host_emulation_build = []  # [(path, None) or (None, problem)], once per session
_host_emulation_loaded = []  # [problem or None], once per session


def host_emulation_build():
    """(path, None) for the host-emulation build of the CUDA kernels, built or found cached, else (None, why
    not).  Loads nothing: on a GPU, the cuda backend keeps the real extension."""
    if not _host_emulation_build:
        import os

        from posenc_fast import _build

        if os.environ.get("POSENC_FAST_TEST_CUDA_EMULATION", "1") == "0":
            _host_emulation_build.append((None, "POSENC_FAST_TEST_CUDA_EMULATION=0"))
        else:
            try:
                _host_emulation_build.append((_build.build_host_emulation(), None))
            except Exception as error:  # no compiler, no CUDA headers, no pybind11: the target is left out
                _host_emulation_build.append((None, f"{type(error).__name__}: {error}"))
    return _host_emulation_build[0]


def cuda_host_emulation_problem():
    """Load the host-emulation build of the CUDA kernels into the cuda backend (machines without a GPU:
    backend='cuda' then runs on CPU tensors only, for the rest of the process); None on success, else why
    it is unavailable."""
    if not _host_emulation_loaded:
        from posenc_fast.backends import cuda_backend

        path, problem = host_emulation_build()
        if problem is None:
            try:
                cuda_backend.use_host_emulation(path)
            except Exception as error:
                problem = f"{type(error).__name__}: {error}"
        _host_emulation_loaded.append(problem)
    return _host_emulation_loaded[0]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ids_shape: Tuple[int, ...]
    vocab: int
    d_model: int
    mode: str = "add"
    d_pos: Optional[int] = None
    layout: str = "interleaved"
    # "zero" | "int" | "per_sequence" | "positions" | "positions_broadcast" | "far"
    position_rule: str = "zero"
    embed_scale: float = 1.0
    pe_scale: float = 1.0
    padding_idx: Optional[int] = None
    ids_dtype: torch.dtype = torch.int64
    hot_id: bool = False  # many tokens share one id: long gradient runs
    frequencies: str = "base"  # "base": base^(-2i/D); "random": h random rates; "random_tail": h + 1 (odd D)
    zero_pe_at_padding: bool = False
    precision: str = "float32"
    # Why the case is slow through Triton's interpreter, where it is: cases_on_targets marks it slow there.
    slow_on_interpreter: Optional[str] = None

    @property
    def token_width(self) -> int:
        return self.d_model - self.d_pos if self.mode == "concat" else self.d_model


CASES = [
    Case("basic", (2, 9), 37, 16),
    Case("split", (2, 9), 37, 16, layout="split"),
    Case("odd_width", (3, 5), 11, 7, position_rule="int", embed_scale=2.0),
    Case("odd_width_split", (3, 5), 11, 9, layout="split", position_rule="per_sequence"),
    Case("width_1", (4, 3), 5, 1, position_rule="int"),
    Case("width_2_split", (4, 3), 5, 2, layout="split"),
    Case("empty", (0, 4), 10, 8),
    Case("empty_last_axis", (3, 0), 10, 8, mode="concat", d_pos=3),
    Case("one_d", (23,), 50, 12, position_rule="int", padding_idx=0),
    Case("three_d", (2, 2, 6), 13, 10, layout="split", position_rule="per_sequence", ids_dtype=torch.int32),
    Case("scalar_id", (), 13, 6, position_rule="int"),
    Case("concat", (2, 11), 40, 24, mode="concat", d_pos=8, embed_scale=math.sqrt(16)),
    Case("concat_odd", (2, 11), 40, 15, mode="concat", d_pos=5, layout="split", position_rule="positions"),
    Case("concat_pe_1", (2, 7), 40, 6, mode="concat", d_pos=1),
    Case("explicit_positions", (3, 17), 64, 32, position_rule="positions", pe_scale=0.5),
    Case("broadcast_positions", (3, 17), 64, 18, layout="split", position_rule="positions_broadcast"),
    Case("far_positions", (4, 33), 64, 64, position_rule="far"),
    Case("far_positions_split_concat", (4, 33), 64, 70, mode="concat", d_pos=38, layout="split", position_rule="far"),
    Case("scaled", (2, 9), 37, 16, embed_scale=32.0, pe_scale=0.125, padding_idx=3),
    Case("hot_id_padding", (3, 70), 9, 8, padding_idx=-1, hot_id=True, ids_dtype=torch.int32,
         slow_on_interpreter="a hot-id case through the interpreter: 4 to 9 s each"),
    Case("long_sequence", (1, 600), 500, 8, layout="split", position_rule="int", hot_id=True,
         slow_on_interpreter="the longest case through Triton's interpreter: 5 to 40 s each"),
    Case("wide", (1, 5), 7, 300, mode="concat", d_pos=131, position_rule="per_sequence"),
    Case("cos_first", (2, 9), 37, 16, layout="split_cos_first", position_rule="int"),
    Case("cos_first_odd", (2, 9), 37, 11, layout="split_cos_first", frequencies="random"),
    Case("cos_first_odd_tail", (2, 9), 37, 11, layout="split_cos_first", frequencies="random_tail"),
    Case("split_odd_sin_tail", (3, 8), 20, 9, layout="split", frequencies="random_tail", embed_scale=3.0),
    Case("interleaved_odd_sin_tail", (3, 8), 20, 13, frequencies="random_tail", position_rule="positions"),
    Case("concat_sin_tail", (2, 6), 20, 12, mode="concat", d_pos=7, layout="split", frequencies="random_tail"),
    Case("random_rates", (2, 10), 30, 20, frequencies="random", position_rule="far"),
    # Widths whose units are whole 16-byte vectors (the CUDA kernels' vector path) with per-sequence
    # offsets: a thread's consecutive tokens cross sequence boundaries, and the last one is partial.
    Case("per_sequence_whole_vectors", (3, 7), 37, 32, position_rule="per_sequence"),
    Case("per_sequence_whole_vectors_split", (3, 7), 37, 32, layout="split", position_rule="per_sequence",
         ids_dtype=torch.int32, padding_idx=2, zero_pe_at_padding=True, hot_id=True),
    Case("zero_pe_at_padding", (3, 12), 15, 10, layout="split", padding_idx=1, zero_pe_at_padding=True,
         hot_id=True, position_rule="positions"),
    Case("zero_pe_at_padding_concat", (3, 12), 15, 10, mode="concat", d_pos=4, padding_idx=0,
         zero_pe_at_padding=True, hot_id=True),
    # Several column blocks of 4-aligned columns (Triton's grouped dropout path, gradient blocks > 256).
    Case("wide_split_blocks", (2, 5), 30, 600, layout="split", position_rule="int"),
    Case("wide_concat_blocks", (2, 5), 30, 776, mode="concat", d_pos=264, hot_id=True),
    Case("float64_math", (2, 9), 37, 16, precision="float64", embed_scale=math.sqrt(24), pe_scale=1 / math.sqrt(3),
         position_rule="far"),
    Case("float64_math_concat_split_tail", (3, 7), 20, 15, mode="concat", d_pos=9, layout="split",
         frequencies="random_tail", precision="float64", position_rule="per_sequence"),
    Case("float64_math_cos_first", (2, 6), 20, 12, layout="split_cos_first", precision="float64", padding_idx=0,
         zero_pe_at_padding=True, hot_id=True, position_rule="positions"),
]

# Positions the design promises to be exact at (fp32 products fail at these): docs/design.md.
DESIGN_POSITIONS = [0, 1, 2, 65535, 65536, 10**6, 3 * 10**7, 2**24 - 1, 2**24, -(2**24), -1, -65536]


def make_inputs(case: Case, device: str, dtype: torch.dtype, seed: int):
    """Fresh random ids (over the whole vocabulary), weight and position arguments for ``case``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, case.vocab, case.ids_shape, generator=g)
    if case.hot_id and ids.numel():
        flat = ids.view(-1)
        hot = torch.rand(flat.shape, generator=g) < 0.6
        flat[hot] = case.padding_idx % case.vocab if case.padding_idx is not None else 1
    weight = torch.randn(case.vocab, case.token_width, generator=g, dtype=torch.float64)
    kwargs = dict(mode=case.mode, d_pos=case.d_pos, layout=case.layout, embed_scale=case.embed_scale,
                  pe_scale=case.pe_scale, padding_idx=case.padding_idx)
    if case.zero_pe_at_padding:
        kwargs["zero_pe_at_padding"] = True
    if case.precision != "float32":
        kwargs["precision"] = case.precision
    pe_width = case.d_pos if case.mode == "concat" else case.d_model
    if case.frequencies != "base":
        count = pe_width // 2 + (1 if case.frequencies == "random_tail" else 0)
        # Rates spread over [-8, 8) rad per position, and some below 1e-4 as long wavelengths are.
        rates = (torch.rand(count, generator=g, dtype=torch.float64) - 0.5) * 16
        rates[::3] *= 1e-5
        kwargs["frequencies"] = rates.tolist()
    sequences = case.ids_shape[:-1]
    if case.position_rule == "int":
        kwargs["offset"] = int(torch.randint(-(2**24), 2**24, (), generator=g))
    elif case.position_rule == "per_sequence":
        kwargs["offset"] = torch.randint(-(2**24), 2**24 - 1000, sequences, generator=g).to(device)
    elif case.position_rule == "positions":
        positions = torch.randint(-(2**24), 2**24 + 1, case.ids_shape, generator=g)
        flat = positions.view(-1)
        n = min(flat.numel(), len(DESIGN_POSITIONS))
        flat[:n] = torch.tensor(DESIGN_POSITIONS[:n])
        kwargs["positions"] = positions.to(torch.int32 if case.ids_dtype == torch.int32 else torch.int64).to(device)
    elif case.position_rule == "positions_broadcast":
        kwargs["positions"] = torch.randint(-(2**24), 2**24, (case.ids_shape[-1],), generator=g).to(device)
    elif case.position_rule == "far":
        kwargs["positions"] = torch.randint(2**24 - 2**20, 2**24 + 1, case.ids_shape, generator=g).to(device)
    return ids.to(case.ids_dtype).to(device), weight.to(dtype).to(device), kwargs


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unit in the last place of ``dtype`` at float64 values ``x`` (normal and subnormal range)."""
    info = torch.finfo(dtype)
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[dtype]
    _, exponent = torch.frexp(x.abs().clamp_min(info.tiny))  # |x| = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), (exponent - 1 - mantissa_bits).to(x.dtype)).clamp_min(info.tiny * 2.0**-mantissa_bits)


def output_bound(exact: torch.Tensor, dtype: torch.dtype, precision: str = "float32") -> torch.Tensor:
    """The accuracy bar, per element, against the float64 result ``exact``.

    fp32: 1e-6 + 2^-22 |y|.  bf16/fp16: the fp32 result correctly rounded, i.e. half an
    ulp of the exact result plus the fp32 bar.  That is tighter than one ulp
    (so truncation instead of rounding fails) and, unlike a bare ulp, honest where the
    sum cancels to below ~2^-13 and the ulp is finer than fp32 accumulation resolves
    (docs/design.md).  float64: the reference itself, 1e-12.

    precision="float64" (float64 arithmetic, one rounding): fp32 outputs correctly rounded
    (half an ulp, plus 2^-20 of it for float64's own error); bf16/fp16 go through fp32,
    so half an ulp plus half an fp32 ulp.
    """
    if dtype == torch.float64:
        return 1e-12 + 1e-12 * exact.abs()
    if precision == "float64":
        fp32_half_ulp = 0.5 * ulp(exact, torch.float32) * (1 + 2.0**-20)
        return fp32_half_ulp if dtype == torch.float32 else 0.5 * ulp(exact, dtype) + fp32_half_ulp
    fp32_bar = 1e-6 + 2.0**-22 * exact.abs()
    if dtype == torch.float32:
        return fp32_bar
    return 0.5 * ulp(exact, dtype) + fp32_bar


def assert_within(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str):
    assert actual.shape == exact.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(exact.shape)}"
    # Compared where the output is (a GPU output against a CPU reference: on the GPU), so that a check
    # of 2**31 elements does not copy gigabytes to the host.
    device = actual.device
    err = (actual.double() - exact.double().to(device)).abs()
    bound = bound.double().to(device)
    ok = err <= bound  # NaN (an unwritten, poisoned element) fails
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        idx = tuple(bad)
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} elements out of bounds; first at {idx}: "
            f"got {actual[idx].double().item()!r}, exact {exact[idx].double().item()!r}, "
            f"err {err[idx].item():.3g} > bound {bound[idx].item():.3g}"
        )
