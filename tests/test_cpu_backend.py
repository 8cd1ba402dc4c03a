"""The CPU backend beyond the shared suites: every instruction-set variant, thread counts, its two
work splits, and how ``auto`` chooses it.

The shared suites (test_functional, test_dropout, ...) run the ``cpu`` target with the variant the
CPU picks; here each variant this CPU can run (AVX-512, AVX2, baseline) is checked against the
float64 reference on every case, and results are checked to be bitwise independent of the number
of threads and of whether positions are shared (position-major) or per token (token-major).
"""

import os
import re
import subprocess
import time

import pytest
import torch

import posenc_fast as pf
from posenc_fast import _build, backends, reference
from posenc_fast._dispatch import resolve_backend
from posenc_fast._spec import PEColumns
from posenc_fast.backends import KernelParams, _extension, cpu_backend
from posenc_fast.backends._extension import Extension
from posenc_fast.positions import make_positions

from cases import CASES, assert_within, cpu_extension_problem, make_inputs, output_bound, ulp

pytestmark = pytest.mark.skipif(cpu_extension_problem() is not None,
                                reason=f"no CPU extension here: {cpu_extension_problem()}")


def _isas():
    module = cpu_backend.extension()
    return list(module.supported_isas()) if module is not None else []


@pytest.fixture
def isa(request):
    module = cpu_backend.extension()
    module.set_isa(request.param)
    yield request.param
    module.set_isa("")


def _gradients(fn, weight, grad_out):
    w = weight.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(fn(w), w, grad_out)
    return grad


@pytest.mark.parametrize("isa", _isas(), indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_isa_variant_matches_float64(isa, dtype, seed):
    for case in CASES:
        ids, weight, kwargs = make_inputs(case, "cpu", dtype, seed)
        out = pf.sinusoidal_embedding(ids, weight, backend="cpu", **kwargs)
        exact = reference.sinusoidal_embedding(ids, weight.double(), **kwargs)
        assert_within(out, exact, output_bound(exact, dtype, case.precision), f"{case.name} {isa} {dtype}")
        if dtype == torch.float16:
            continue  # gradients: fp32 and bf16 cover the summation; fp16 only changes the conversions
        g = torch.Generator().manual_seed(seed + 1)
        grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
        grad = _gradients(lambda w: pf.sinusoidal_embedding(ids, w, backend="cpu", **kwargs), weight, grad_out)
        exact_fn = lambda w: reference.sinusoidal_embedding(ids, w, **kwargs)  # noqa: E731
        exact_grad = _gradients(exact_fn, weight.double(), grad_out.double())
        bound = 1e-5 * _gradients(exact_fn, weight.double(), grad_out.double().abs()).abs() + 1e-30
        if dtype != torch.float32:
            bound = bound + ulp(exact_grad, dtype)
        assert_within(grad, exact_grad, bound, f"{case.name} grad {isa} {dtype}")


def _run(ids, weight, grad_out, threads, **kwargs):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = weight.detach().clone().requires_grad_()
        torch.manual_seed(1234)  # the dropout seed is drawn from torch's generator
        out = pf.sinusoidal_embedding(ids, w, backend="cpu", **kwargs)
        out.backward(grad_out)
        return out.detach(), w.grad
    finally:
        torch.set_num_threads(previous)


# Shapes whose position-major work is cut differently with the thread count: long sequences (chunks of
# positions: 600 positions in chunks of 152, 80 and 40 on 1, 2 and 5 threads, the last one partial; 150 in
# chunks of 40, the floor of 32768 output elements per chunk), and few or one position per sequence (chunks
# that also split the sequences into groups of unequal sizes, here 4, 8 and 11 groups of 1200 one-token
# sequences on 1, 2 and 5 threads: groups hold at least 32768 output elements too; csrc/cpu/cpu_kernels.cpp
# position_work).
THREAD_SHAPES = [(3, 150), (3, 600), (1200, 1), (300, 3)]


@pytest.mark.parametrize("shape", THREAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_results_do_not_depend_on_thread_count(dropout_p, shape, seed):
    """Forward and weight gradient are bitwise the same on 1, 2 and 5 threads (more than there are
    work chunks of some shapes, more than the cores of small machines)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, shape, generator=g)
    ids.view(-1)[::3] = 7  # a hot id: one long run
    weight = torch.randn(40, 300, generator=g)
    grad_out = torch.randn(*shape, 300, generator=g)
    kwargs = dict(embed_scale=3.0, padding_idx=2)
    if dropout_p:
        kwargs.update(dropout_p=dropout_p)
    per_sequence_offsets = torch.randint(0, 2000, shape[:1], generator=g)
    for offset in (0, per_sequence_offsets):
        first = _run(ids, weight, grad_out, 1, offset=offset, **kwargs)
        for threads in (2, 5):
            out, grad = _run(ids, weight, grad_out, threads, offset=offset, **kwargs)
            assert torch.equal(out, first[0]), f"forward differs on {threads} threads"
            assert torch.equal(grad, first[1]), f"weight gradient differs on {threads} threads"


def _int64_keys(ids, num_embeddings):
    """backends.sort_ids_for_gradient with int64 keys, which it uses only past 2^31 - 1 rows."""
    return torch.sort(torch.remainder(ids.to(torch.int64).clamp(-1, num_embeddings), num_embeddings + 1), stable=True)


@pytest.mark.parametrize("key_dtype", [torch.int32, torch.int64], ids=str)
def test_weight_gradient_writes_every_row_once(monkeypatch, key_dtype, seed):
    """The kernel zeroes only the rows no token's sum writes (csrc/cpu/cpu_kernels.cpp, ZeroUnwrittenRows), each
    chunk of rows finding its runs by a binary search: with 160 columns a chunk is 1638 rows, so on 2 and 5
    threads the rows around 1638 are at a chunk's edge, padding_idx (1637, with tokens) its last row.  The
    output is poisoned before the kernel (tests/conftest.py), so a row left neither zeroed nor summed fails
    (zeroing a row that a sum then writes cannot show: it costs time only).  Out-of-range ids (check off)
    get nothing; a wider grad_out row (row stride > width) and any thread count give the same bits."""
    vocab, width, padding_idx, embed_scale = 3000, 160, 1637, 3.0
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (400,), generator=g)
    ids[:12] = torch.tensor([0, 1637, 1637, 1638, 1638, vocab - 1, -5, vocab + 3, 1636, 5, 5, 1637])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    grad_out = torch.randn(ids.numel(), width + 24, generator=g)
    if key_dtype == torch.int64:
        monkeypatch.setattr(_extension, "sort_ids_for_gradient", _int64_keys)
    counted = (ids >= 0) & (ids < vocab) & (ids != padding_idx)
    exact = torch.zeros(vocab, width, dtype=torch.float64)
    exact.index_add_(0, ids[counted], grad_out[counted, :width].double() * embed_scale)
    bound = torch.zeros(vocab, width, dtype=torch.float64)
    bound.index_add_(0, ids[counted], grad_out[counted, :width].double().abs() * embed_scale * 1e-6)
    previous = torch.get_num_threads()
    grads = []
    try:
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            grads.append(cpu_backend.backward(grad_out, ids, vocab, width, embed_scale, padding_idx, torch.float32, None))
    finally:
        torch.set_num_threads(previous)
    assert_within(grads[0], exact, bound, f"weight gradient, {key_dtype} keys")
    assert all(torch.equal(grad, grads[0]) for grad in grads[1:])


def _same_bits(a, b):
    """Bitwise equality, the sign of zero included (torch.equal takes -0.0 for 0.0: a padding token's zero PE
    is sin * 0, whose sign tells its position)."""
    integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(integer), b.view(integer))


def _per_token_positions(kind, shape, g):
    """Positions [B, S] for a batch, and the keyword arguments that give them to the op.

    ``offset``: one scalar offset (every column at one position).  ``offsets``: per-sequence offsets, some
    equal to the first sequence's, some not.  ``positions``: a tensor whose columns mostly agree, with a
    sequence shifted (left padding), one at random positions, and padding tokens at ``padding_idx`` 1
    (``make_positions``' rule), the first sequence's included."""
    batch, length = shape
    columns = torch.arange(length)
    if kind == "offset":
        return columns.expand(shape) + 12345, dict(offset=12345)
    if kind == "offsets":
        offsets = torch.full((batch,), 12345)
        offsets[1::3] = 12000
        offsets[2::5] = int(torch.randint(0, 2**40, (), generator=g))
        return offsets[:, None] + columns, dict(offset=offsets)
    positions = (columns + 2).repeat(batch, 1)
    positions[1::3] += 3  # left padding: the row's positions shifted
    positions[2::4] = torch.randint(0, 2**40, (length,), generator=g)
    positions.view(-1)[::7] = 1  # padding tokens at padding_idx
    return positions, dict(positions=positions)


# With a scalar offset, 2000 x 8, 5000 x 1 and 2000 x 3 split their sequences into groups (of unequal sizes) on two
# threads or more; with per-token positions, 2000 x 8 does (shorter sequences take the token-major path).  4 x 4000
# is cut into chunks of positions that differ with the thread count (smaller batches are one item: 32768 output
# elements at least).
@pytest.mark.parametrize("shape", [(4, 33), (3, 150), (4, 4000), (2000, 8), (5000, 1), (2000, 3)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["offset", "offsets", "positions"])
@pytest.mark.parametrize("mode", ["add", "concat"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_position_major_equals_token_major(mode, dropout_p, kind, shape, seed):
    """The batch as B sequences of S tokens (position-major where S >= 8 or the offset is a scalar: one
    sin/cos row per column, made again only for a token at another position) and as B * S one-token
    sequences at the same positions (token-major: one row per token) give bitwise the same output, with
    padding's zero PE, dropout (the mask follows the token's place, the same in both) and threads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30, shape, generator=g)
    ids.view(-1)[::4] = 1
    weight = torch.randn(30, 20, generator=g, dtype=torch.float64).to(torch.bfloat16)
    positions, placement = _per_token_positions(kind, shape, g)
    kwargs = dict(mode=mode, d_pos=6 if mode == "concat" else None, layout="split", padding_idx=1,
                  zero_pe_at_padding=True, embed_scale=2.0)
    if dropout_p:
        kwargs.update(dropout_p=dropout_p)
    previous_threads = torch.get_num_threads()
    try:
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            torch.manual_seed(seed)  # the dropout seed is drawn from torch's generator: the same one for both calls
            batch = pf.sinusoidal_embedding(ids, weight, backend="cpu", **placement, **kwargs)
            torch.manual_seed(seed)
            tokens = pf.sinusoidal_embedding(ids.reshape(-1, 1), weight, backend="cpu",
                                             positions=positions.reshape(-1, 1), **kwargs)
            assert _same_bits(batch, tokens.reshape(batch.shape)), threads
    finally:
        torch.set_num_threads(previous_threads)


def test_auto_runs_the_cpu_backend_and_falls_back_to_torch(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.float32) == "cpu"
    assert resolve_backend("auto", cpu, torch.bfloat16, float64_math=True) == "cpu"
    assert resolve_backend("auto", cpu, torch.float64) == "torch"  # float64 weights: the reference op
    monkeypatch.setattr(cpu_backend._lookup, "state", Extension(None, "not built (test)"))
    monkeypatch.setenv("POSENC_FAST_BUILD_ON_DEMAND", "0")  # backend="cpu" by name would build it
    assert resolve_backend("auto", cpu, torch.float32) == "torch"
    with pytest.raises(RuntimeError, match="not built"):
        resolve_backend("cpu", cpu, torch.float32)


def test_cpu_backend_refuses_other_devices():
    reason = cpu_backend.available(torch.device("cuda"))
    assert reason is not None and "CPU tensors" in reason


def test_cuda_backend_on_cpu_tensors_names_the_cpu_backend(monkeypatch):
    from posenc_fast.backends import cuda_backend

    monkeypatch.setattr(cuda_backend, "_host_emulation", False)  # other tests may leave the test setting on
    with pytest.raises(RuntimeError) as raised:
        pf.sinusoidal_embedding(torch.zeros(2, 3, dtype=torch.long), torch.randn(4, 8), backend="cuda")
    assert "\n" not in str(raised.value) and "use backend='cpu' (or 'auto') for cpu tensors" in str(raised.value)


def _offset_places(g, shape):
    """Two starting positions: one anywhere, one from which the positions pass 2^63 - 1 mid-sequence (they
    wrap, as torch's int64 addition does)."""
    anywhere = int(torch.randint(-(2**40), 2**40, (), generator=g))
    return [anywhere, 2**63 - int(torch.randint(1, shape[1], (), generator=g))]


@pytest.mark.skipif(not {"avx512", "avx2"} <= set(_isas()), reason="needs a CPU with both AVX-512 and AVX2")
@pytest.mark.parametrize("precision", ["float32", "float64"])
@pytest.mark.parametrize("where", ["positions", "offset"])
def test_avx2_and_avx512_variants_agree_bitwise(where, precision, seed):
    """The AVX2 variant converts the reduced angle to float in vectorisable steps (its two 32-bit words,
    the low one's last bits folded where they cannot change the rounding) and, along runs of consecutive
    positions, adds the rates to the previous position's phases; the AVX-512 one multiplies
    and converts directly.  Same integers, same rounding, so the same bits: at random positions (a row
    per token) and from scalar offsets (150 positions: several blocks and chunks on 2 threads)."""
    g = torch.Generator().manual_seed(seed)
    shape = (3, 150)
    ids = torch.randint(0, 50, shape, generator=g)
    weight = torch.randn(50, 96, generator=g)
    if where == "positions":
        places = [dict(positions=torch.randint(-(2**40), 2**40, shape, generator=g))]
    else:
        places = [dict(offset=offset) for offset in _offset_places(g, shape)]
    rates = ((torch.rand(48, generator=g, dtype=torch.float64) - 0.5) * 16).tolist()
    module = cpu_backend.extension()
    previous_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for place in places:
            outputs = []
            for name in ("avx512", "avx2"):
                module.set_isa(name)
                outputs.append(pf.sinusoidal_embedding(ids, weight, frequencies=rates, precision=precision,
                                                       backend="cpu", **place))
            assert _same_bits(outputs[0], outputs[1]), place
    finally:
        module.set_isa("")
        torch.set_num_threads(previous_threads)


@pytest.mark.parametrize("isa", _isas(), indirect=True)
@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_phases_by_addition_match_multiplied_phases(isa, precision, seed):
    """Where the ISA has no 64-bit vector multiply (AVX2, SSE2), a run of consecutive positions adds the
    rates to the previous position's phases: a position-major item's columns (a scalar offset, offsets or
    a positions tensor), across blocks, chunks and threads; the tokens of a sequence whose positions are
    not the column's (made again, one after another); a padding token with no PE, which takes phases of
    its own; and a sequence's tokens on the token-major path (one sequence per call).  Descending positions
    give no such run: every phase is a product.  The same integers mod 2^64, so the same bits, wrapping
    past 2^63 - 1 included.  (The variants differ from each other where one has FMA: each is compared
    with itself.)"""
    g = torch.Generator().manual_seed(seed)
    shape = (3, 150)
    ids = torch.randint(0, 50, shape, generator=g)
    ids.view(-1)[::5] = 1  # padding, zero PE: phases of their own
    weight = torch.randn(50, 96, generator=g)
    rates = ((torch.rand(48, generator=g, dtype=torch.float64) - 0.5) * 16).tolist()
    kwargs = dict(frequencies=rates, precision=precision, padding_idx=1, zero_pe_at_padding=True, backend="cpu")
    columns = torch.arange(shape[1])
    previous_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for offset in _offset_places(g, shape):
            shifts = torch.tensor([0, 0, 7])  # the last sequence's tokens are not at their columns' positions
            positions = columns + (shifts[:, None] + offset)  # int64 wraps as the kernel's does
            multiplied = pf.sinusoidal_embedding(ids.flip(-1), weight, positions=positions.flip(-1), **kwargs).flip(-2)
            added = {"offsets": pf.sinusoidal_embedding(ids, weight, offset=shifts + offset, **kwargs),
                     "positions": pf.sinusoidal_embedding(ids, weight, positions=positions, **kwargs),
                     "one sequence per call": torch.cat([
                         pf.sinusoidal_embedding(ids[b:b + 1], weight, positions=positions[b:b + 1], **kwargs)
                         for b in range(shape[0])])}
            for name, out in added.items():
                assert _same_bits(out, multiplied), (name, offset)
            scalar = pf.sinusoidal_embedding(ids[:2], weight, offset=offset, **kwargs)
            assert _same_bits(scalar, multiplied[:2]), ("offset", offset)
            # make_positions: a padding token at padding_idx between two consecutive real positions (p - 1,
            # then padding, then p), whose zero row is kept for the next one: the run goes on past it.
            fairseq = make_positions(ids, 1, offset)
            multiplied = pf.sinusoidal_embedding(ids.flip(-1), weight, positions=fairseq.flip(-1), **kwargs).flip(-2)
            assert _same_bits(pf.sinusoidal_embedding(ids, weight, positions=fairseq, **kwargs), multiplied), offset
            for b in range(shape[0]):
                one = pf.sinusoidal_embedding(ids[b:b + 1], weight, positions=fairseq[b:b + 1], **kwargs)
                assert _same_bits(one, multiplied[b:b + 1]), ("make_positions, one sequence", b, offset)
    finally:
        torch.set_num_threads(previous_threads)


@pytest.mark.parametrize("isa", _isas(), indirect=True)
@pytest.mark.parametrize("shape", [(4, 40), (1, 60), (40, 3)], ids=lambda s: "x".join(map(str, s)))
def test_padding_zero_pe_has_its_positions_signs(isa, shape, seed):
    """A padding token's zero PE (zero_pe_at_padding) is the PE at its own position times +0: concat
    writes it, so every sign bit shows.  Against the float64 reference, on the position-major path (4 x 40)
    and the token-major one (one sequence; short sequences), with padding at padding_idx (make_positions),
    at the column's position (an offset) and at random positions: a row made at a wrong position, or made
    once and kept past a change of position, has other signs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 30, shape, generator=g)
    ids.view(-1)[::3] = 1
    weight = torch.randn(30, 8, generator=g)
    kwargs = dict(mode="concat", d_pos=10, padding_idx=1, zero_pe_at_padding=True)
    for placement in (dict(positions=make_positions(ids, 1, 3)), dict(offset=1000),
                      dict(positions=torch.randint(0, 2**40, shape, generator=g))):
        out = pf.sinusoidal_embedding(ids, weight, backend="cpu", **placement, **kwargs)
        exact = reference.sinusoidal_embedding(ids, weight.double(), **placement, **kwargs)
        padding = ids == 1
        assert torch.equal(torch.signbit(out[padding]), torch.signbit(exact[padding])), placement
        assert not out[padding][..., 8:].any()  # zeros


def _is_gcc(cxx: str) -> bool:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return "Free Software Foundation" in version and "clang" not in version.lower()


def _sin_cos_loop_line(kernels_source: str) -> int:
    """The line of ``sin_cos_row``'s loop over pair slots in csrc/cpu/cpu_kernels.cpp (1-based)."""
    with open(kernels_source, encoding="utf-8") as source:
        lines = source.read().splitlines()
    start = next(i for i, line in enumerate(lines) if "void sin_cos_row(" in line)
    return next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("for (")) + 1


@pytest.mark.slow  # compiles csrc/cpu/cpu_kernels.cpp once more: ~30 s on 2 cores
@pytest.mark.skipif("avx2" not in _isas() or _build.find_cxx() is None,
                    reason="needs a CPU that runs the AVX2 variant (the binding's own test of its flags) and a C++ compiler")
def test_avx2_angle_conversion_rounds_once(tmp_path):
    """The AVX2 variant's int64 -> float conversion (two exact 32-bit words; for fp32, past 2^34 the bits
    below 2^9 folded into a sticky bit, so that their sum is exact in double; then one rounding) equals
    the hardware's one rounding on every magnitude and at fp32 ties past 2^53, where random
    positions almost never land (tests/cpu_conversion_check.cpp), so the bitwise test above cannot
    see a wrong tie.  It is written to vectorise: a version that did not made the AVX2 forward 2x slower
    with the same bits, so with GCC the same compile also reports its vectorisation of the sin/cos loop
    (docs/cpu_backend.md, "Checking the vectorisation"): every instantiation must say "vectorized"."""
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_conversion_check.cpp")
    program = str(tmp_path / "cpu_conversion_check")
    cxx = _build.find_cxx()
    report = tmp_path / "vectorisation.txt"
    gcc = _is_gcc(cxx)
    flags = dict(_build.CPU_X86_VARIANTS)["isa_avx2"]
    subprocess.run([cxx, "-std=c++17", "-O3", *flags, "-DPOSENC_CPU_ISA=isa_avx2", f"-I{csrc}", source,
                    "-o", program] + ([f"-fopt-info-vec-all={report}"] if gcc else []), check=True)
    result = subprocess.run([program], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    if not gcc:
        return  # the conversion is checked; the report's wording is GCC's
    loop = f"cpu_kernels.cpp:{_sin_cos_loop_line(os.path.join(csrc, 'cpu', 'cpu_kernels.cpp'))}:"
    messages = [line for line in report.read_text().splitlines() if loop in line]
    vectorised = [line for line in messages if "optimized: loop vectorized using 32 byte vectors" in line]
    refused = [line for line in messages if "couldn't vectorize loop" in line]
    # 36 instantiations: element type (3) x math (2) x id type (2) x sin_cos_row's three call sites.
    assert len(vectorised) >= 36 and not refused, (len(vectorised), refused[:3])


# A direct call of a binding's weight_grad with one bad argument, and the ValueError it must raise.
_BAD_WEIGHT_GRAD_ARGUMENTS = [
    (dict(ids_code="FLOAT32"), "sorted_ids: dtype code 0 is not INT32 or INT64"),
    (dict(grad_code="INT64"), "grad_out: dtype code 4 is not FLOAT32, FLOAT16 or BFLOAT16"),
    (dict(weight_code=99), "grad_weight: dtype code 99 is not FLOAT32, FLOAT16 or BFLOAT16"),
    (dict(grad_code="FLOAT16", weight_code="BFLOAT16"), "grad_out must have the weight's dtype or FLOAT32"),
]


@pytest.mark.parametrize("bad,message", _BAD_WEIGHT_GRAD_ARGUMENTS, ids=[m.split(":")[0] for _, m in
                                                                         _BAD_WEIGHT_GRAD_ARGUMENTS])
def test_weight_gradient_binding_refuses_bad_arguments_before_reading_memory(bad, message):
    """``_cpu.weight_grad`` called directly checks its dtype codes and that the gradient is in the table's dtype
    or fp32, with a ValueError naming the argument, before any memory is read: the addresses below are never
    dereferenced."""
    module = cpu_backend.extension()
    codes = dict(dict(ids_code="INT64", grad_code="FLOAT32", weight_code="FLOAT32"), **bad)
    ids_code, grad_code, weight_code = (getattr(module, c) if isinstance(c, str) else c for c in codes.values())
    address = 256
    with pytest.raises(ValueError, match=re.escape(message)):
        module.weight_grad(address, ids_code, address, address, 8, grad_code, address, weight_code, 4, 10, 8, -1,
                           1.0, 0, 0, 1.0, 1)


@pytest.mark.parametrize("binding", ["cpu", "cuda host emulation"])
@pytest.mark.parametrize("token_width,pe_width,concat", [(0, 0, False), (0, 0, True), (0, 4, False), (-2, 1, True)])
def test_forward_binding_refuses_rows_without_columns(binding, token_width, pe_width, concat):
    """A ``ForwardLaunch`` made directly for rows with no output column is refused when it is made, with a
    ValueError naming the widths: the CUDA launch divides a row into units (the host emulation died of SIGFPE)."""
    if binding == "cpu":
        module = cpu_backend.extension()
    else:
        from cases import cuda_host_emulation_problem
        from posenc_fast.backends import cuda_backend

        problem = cuda_host_emulation_problem()
        if problem is not None:
            pytest.skip(problem)
        module = cuda_backend.extension()
    extra = (0,) if binding != "cpu" else ()  # the CUDA binding's device index
    with pytest.raises(ValueError, match=f"token_width {token_width} and pe_width {pe_width} give no output"):
        launch = module.ForwardLaunch(module.FLOAT32, 256, 0, 4, token_width, pe_width, concat, True, 0, 0, 1, 0, -1,
                                      1.0, 1.0, False, *extra)
        ids, weight, out = (torch.zeros(2, dtype=torch.int64), torch.zeros(4, 1), torch.zeros(2, 1))
        launch(ids.data_ptr(), module.INT64, weight.data_ptr(), 0, out.data_ptr(), 0, 2, 2, 1 - len(extra))


@pytest.fixture(params=["openmp", "pool"])
def threading(request):
    """Each way the kernels get their threads: the process's OpenMP runtime (torch's workers) and
    posenc_fast's own pool."""
    module = cpu_backend.extension()
    before = module.threading()
    try:
        module.set_threading(request.param)
    except ValueError as error:  # no OpenMP runtime loaded: a torch built without OpenMP
        pytest.skip(str(error))
    yield request.param
    module.set_threading("pool" if before == "pool" else "openmp")


def test_kernels_run_on_torchs_openmp_runtime():
    """With torch's OpenMP runtime loaded (torch's Linux wheels: libgomp), the kernels use it, so they
    share torch's worker threads instead of competing with them (docs/cpu_backend.md)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch is not built with OpenMP")
    module = cpu_backend.extension()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        loaded = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    name = module.threading()
    assert name.startswith("openmp:") and name[len("openmp:"):] in loaded, (name, loaded)


def test_threading_names_are_checked():
    with pytest.raises(ValueError, match="'openmp' or 'pool', got 'tbb'"):
        cpu_backend.extension().set_threading("tbb")


@pytest.mark.parametrize("threads", [2, 3])
def test_results_do_not_depend_on_where_threads_come_from(threading, threads, seed):
    """OpenMP team and own pool split the work the same way: bitwise the same forward and gradient
    as one thread, after a torch op has left torch's workers spinning."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 257), generator=g)
    weight = torch.randn(64, 200, generator=g)
    grad_out = torch.randn(4, 257, 200, generator=g)
    offset = torch.tensor([0, 3, 70000, 9], dtype=torch.int64)
    one = _run(ids, weight, grad_out, 1, offset=offset, embed_scale=2.0)
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))
    many = _run(ids, weight, grad_out, threads, offset=offset, embed_scale=2.0)
    assert torch.equal(many[0], one[0]) and torch.equal(many[1], one[1])


def test_a_forked_child_runs_the_kernels_on_threads_of_its_own(seed):
    """A child forked after the parent ran threaded (a multiprocessing fork) has no OpenMP team: libgomp's would
    hang it, as torch's own threaded ops hang there.  The kernels then run on the pool (``threading()`` says so)
    with the thread count torch reports, and give the parent's bits."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 257), generator=g)
    weight = torch.randn(64, 200, generator=g)
    grad_out = torch.randn(4, 257, 200, generator=g)
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))
    expected = _run(ids, weight, grad_out, 2, embed_scale=2.0)  # the parent's team and pool are running now
    module = cpu_backend.extension()
    pid = os.fork()
    if pid == 0:  # the child: only os._exit leaves it, with 0 (same bits on the pool), 1 or 2
        code = 2
        # torch's own ops stay small or single-threaded here: its threaded ones would hang the child.  So no
        # NaN fill of the outputs; every element is still compared with the parent's poisoned run.
        backends.POISON_OUTPUTS = False
        try:
            got = _run(ids, weight, grad_out, 2, embed_scale=2.0)
            torch.set_num_threads(1)
            same = torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
            code = 0 if same and module.threading() == "pool" else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's forward and backward did not finish within 120 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's results differ, or it did not run on the pool"
    assert module.threading().startswith("openmp:") or module.threading() == "pool"  # the parent's is unchanged


_FIRST_USE_IN_A_FORKED_CHILD = """
import os, sys, time, torch
import posenc_fast as pf
from posenc_fast.backends import cpu_backend
torch.set_num_threads(2)
g = torch.Generator().manual_seed(int(sys.argv[1]))
ids, weight = torch.randint(0, 64, (8, 512), generator=g), torch.randn(64, 256, generator=g)
torch.randn(4_000_000).exp()  # torch's own threaded op: the parent's OpenMP team runs; no kernel of ours yet
pid = os.fork()
if pid == 0:  # the extension's first use, in the child: it must not join the parent's team
    code = 2
    try:
        out = pf.sinusoidal_embedding(ids, weight, backend="cpu")
        code = 0 if cpu_backend.extension().threading() == "pool" else 1
        torch.set_num_threads(1)
        sys.stdout.write(repr(out.double().sum().item()) + "\\n")
        sys.stdout.flush()
    finally:
        os._exit(code)
deadline = time.monotonic() + 120
while os.waitpid(pid, os.WNOHANG)[0] == 0:
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        sys.exit("the child hung")
    time.sleep(0.05)
expected = pf.sinusoidal_embedding(ids, weight, backend="torch")  # (after the child: a threaded op)
print(repr(expected.double().sum().item()))
"""


def test_a_child_forked_before_the_extensions_first_use_runs_on_the_pool(seed):
    """A parent that ran only torch's threaded ops (its OpenMP team exists, the extension was never used), then
    forked: the child's first call of the kernels runs on the pool (libgomp's team would hang it) and gives the
    reference's result.  In a fresh interpreter, where the extension is not loaded yet."""
    import subprocess
    import sys

    if cpu_backend.extension() is None:
        pytest.skip(cpu_backend.extension_problem())
    done = subprocess.run([sys.executable, "-c", _FIRST_USE_IN_A_FORKED_CHILD, str(seed)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    child, parent = (float(line) for line in done.stdout.split())
    assert abs(child - parent) <= 1e-6 * 8 * 512 * 256, (child, parent)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_prepared_launch_checks_ids_through_the_bindings_scan(dtype, seed):
    """The binding's id range scan (one pass, no tensor allocated) agrees with torch.aminmax, extreme values
    included; a prepared launch that checks its ids names an out-of-range one, through the scan or, above its
    size, through torch."""
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    module = cpu_backend.extension()
    code = _extension.dtype_code(module, dtype, "cpu")
    for numel in (1, 2, 7, 4096):
        ids = torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
        for position, value in ((0, info.min), (numel - 1, info.max), (numel // 2, 0)):
            ids_case = ids.clone()
            ids_case[position] = value
            low, high = torch.aminmax(ids_case)
            assert module.id_range(ids_case.data_ptr(), code, numel) == (int(low), int(high))
    params = KernelParams(False, 4, 4, PEColumns(True, 0, 2, 1, 2), 1.0, 1.0, -1)
    launch = cpu_backend.prepare_forward(torch.float32, 10, torch.device("cpu"), torch.zeros(2, dtype=torch.int64),
                                         params).launch
    weight = torch.randn(10, 4, generator=g)
    for numel, bad in ((5, 10), (5, -1), (_extension.ID_RANGE_SERIAL_MAX + 1, 10)):
        ids = torch.randint(0, 10, (numel,), generator=g, dtype=dtype)
        ids[int(torch.randint(0, numel, (), generator=g))] = bad
        out = torch.full((numel, 4), float("nan"))
        with pytest.raises(IndexError, match=f"id {bad} is out of range for an embedding table of 10 rows"):
            launch(ids, weight, 4, out, 0, numel, numel, 1, True)
        assert out.isnan().all()  # nothing launched
