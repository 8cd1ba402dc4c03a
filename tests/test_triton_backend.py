"""posenc_fast.backends.triton_launch: the prepared launch's kept compiled kernels (``KeptLaunches``).

On a GPU a prepared Triton launch calls a compiled kernel's own launch function with the arguments Triton's
JIT would pass it, and reuses a compiled kernel only for calls that Triton specialises the same way.  Both
halves are checked here without a GPU: the key against Triton's own specialization, the arguments against
the kernel's signature (a stand-in for the GPU kernel records what each path passes).  Triton's real
launcher runs too, onto a stand-in CUDA driver that records what it is handed (``fake_driver_launches.py``,
in its own process): the JIT and the kept kernel must hand it the same launch.  On a GPU, the last test runs
the real launcher across specializations against the JIT, bit for bit.
"""

import inspect
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

import posenc_fast as pf  # noqa: E402
from cases import assert_within, output_bound  # noqa: E402
from posenc_fast import reference  # noqa: E402
from posenc_fast._spec import MAX_ROW_WIDTH  # noqa: E402
from posenc_fast.backends import triton_backend, triton_launch  # noqa: E402


def _triton_specialization():
    """Triton's own specialization of one launch argument, (type, key), as its JIT computes it."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime import jit

    if hasattr(jit, "native_specialize_impl"):  # Triton 3.6 and later
        return lambda value: tuple(jit.native_specialize_impl(BaseBackend, value, False, True, True))
    specialize = jit.create_specialize_impl(BaseBackend.get_arg_specialization)  # Triton 3.5
    return lambda value: tuple(specialize(value, False, True, True))


INT_VALUES = sorted({v + d for v in (0, 1, 16, 2**31, -(2**31), 2**32, 2**63, -(2**63), 2**64 - 16, 48, -16)
                     for d in (-17, -16, -15, -1, 0, 1, 15, 16, 17)
                     if -(2**63) <= v + d < 2**64})


def test_int_key_is_as_fine_as_tritons():
    """Two ints with the same key must have the same specialization in Triton; else a kernel compiled for
    one (``offset == 1`` made a constant, a 32-bit type, a divisibility hint) would serve the other."""
    specialization = _triton_specialization()
    by_key = {}
    for value in INT_VALUES:
        by_key.setdefault(triton_launch.int_specialization(value), set()).add(specialization(value))
    merged = {key: specs for key, specs in by_key.items() if len(specs) > 1}
    assert not merged, merged
    assert len(by_key) >= 5  # 1; i32 with and without 16 | v; i64; u64: the classes are all reached


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16], ids=str)
def test_tritons_tensor_specialization_is_dtype_and_alignment(dtype):
    """What the key assumes of the installed Triton: a tensor argument is specialised on its dtype and on
    whether 16 divides its address, nothing else (every byte offset from a 64-byte-aligned start).  The
    launch's key holds the ids' dtype (the table's and output's are the prepared one) and the three
    alignments."""
    specialization = _triton_specialization()
    storage = torch.zeros(64, dtype=dtype)
    by_key = {}
    for start in range(16 // storage.element_size() * 2):
        view = storage[start:]
        by_key.setdefault(view.data_ptr() % 16 == 0, set()).add(specialization(view))
    assert all(len(specs) == 1 for specs in by_key.values()), by_key
    assert set(by_key) == ({True} if storage.element_size() >= 16 else {True, False})


class _RecordingCompiled(triton.compiler.CompiledKernel):
    """Stands in for a compiled kernel: its launcher records what it is given."""

    def __init__(self, launches, serial):  # (no binary: nothing of the base class's state)
        self.launches, self.serial = launches, serial
        self.function, self.packed_metadata = "function", "packed metadata"

    @property
    def run(self):
        def record(*arguments):
            self.launches.append(arguments)
            self.launched_serials.append(self.serial)
        return record

    def launch_metadata(self, grid, stream, *arguments):
        return "launch metadata"

    def __del__(self):
        pass


class _RecordingKernel:
    """Stands in for ``forward_kernel`` compiled for a GPU: records each JIT call and returns a compiled kernel."""

    run = triton.runtime.jit.JITFunction.run  # (never called: what a plain launch finds on a JIT function)

    def __init__(self, fn):
        self.fn = fn
        self.jit_calls = []
        self.launches = []
        self.pre_run_hooks = []
        self.launched_serials = []  # which JIT call's compiled kernel each launch used
        self.returns_compiled = True  # False: the JIT returns a stand-in for an asynchronous compile's future

    def __getitem__(self, grid):
        def call(*arguments, **keywords):
            self.jit_calls.append((grid, arguments, keywords))
            if not self.returns_compiled:
                return SimpleNamespace(result=None)
            compiled = _RecordingCompiled(self.launches, len(self.jit_calls) - 1)
            compiled.launched_serials = self.launched_serials
            return compiled
        return call


@pytest.fixture
def recording_gpu_launch(monkeypatch):
    """A prepared launch for a GPU whose kernel is a _RecordingKernel (no GPU needed), and that kernel."""
    real = triton_backend._load_kernels().forward_kernel
    kernel = _RecordingKernel(real.fn)
    monkeypatch.setattr(triton_backend._Kernels, "state", SimpleNamespace(forward_kernel=kernel))
    monkeypatch.setattr(triton_backend, "_kernels_interpreted", False)
    current_device = [0]  # what the stand-in for torch's current-device query answers
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current_device[0], raising=False)
    monkeypatch.setattr(sys.modules[__name__], "CURRENT_DEVICE", current_device, raising=False)
    layer = pf.SinusoidalEmbedding(50, 96)
    params = layer.spec.kernel_params(False)
    prepared = triton_backend.prepare_forward(torch.float32, 50, torch.device("cuda", 0), layer.spec.turns_tensor("cpu"),
                                              params)
    return prepared, kernel, layer.weight.detach()


def test_compiled_launch_passes_what_the_jit_passes(recording_gpu_launch):
    """A key's second call goes to the compiled kernel's launcher with the grid, the stream and every
    parameter in signature order (constexprs included; num_warps and the compile options not), as
    ``JITFunction.run`` passes them, but a tensor's address for the tensor; Triton's default hooks (empty
    chains) as None."""
    prepared, kernel, weight = recording_gpu_launch
    ids = torch.randint(0, 50, (2, 5))
    out = torch.empty(10, 96)
    for stream in (7, 8):
        prepared.launch(ids, weight, 96, out, 12345, 5, 10, stream, False)
    assert len(kernel.jit_calls) == 1 and len(kernel.launches) == 1
    grid, arguments, keywords = kernel.jit_calls[0]
    assert keywords.pop("num_warps") >= 1
    keywords.pop("enable_fp_fusion", None)  # a compile option (the next test)
    bound = inspect.signature(kernel.fn).bind(*arguments, **keywords)
    assert len(bound.arguments) == len(inspect.signature(kernel.fn).parameters)  # nothing left to its default
    launched = kernel.launches[0]
    assert launched[:9] == (grid[0], grid[1], 1, 8, "function", "packed metadata", None, None, None)
    assert len(launched[9:]) == len(bound.arguments)
    for name, want, got in zip(bound.arguments, bound.arguments.values(), launched[9:]):
        if isinstance(want, torch.Tensor):  # the launcher is given its address
            assert got == want.data_ptr() and type(got) is int, name
        else:
            assert got is want or got == want, name


@pytest.mark.parametrize("replaced", ["__call__", "class"])
def test_a_launcher_replaced_before_the_launch_is_prepared_is_called(recording_gpu_launch, monkeypatch, replaced):
    """A tool that replaced Triton's launcher (its ``__call__``, or the class) before the launch was prepared:
    no launch takes the direct launch function, every one goes through the JIT, which calls the tool's."""
    from triton.backends.nvidia import driver

    _, kernel, weight = recording_gpu_launch
    if replaced == "__call__":
        monkeypatch.setattr(driver.CudaLauncher, "__call__", lambda self, *args: None)
    else:
        monkeypatch.setattr(driver, "CudaLauncher", type("CudaLauncher", (driver.CudaLauncher,), {}))
    assert triton_launch._nvidia_launcher()[1] is None
    layer = pf.SinusoidalEmbedding(50, 96)
    prepared = triton_backend.prepare_forward(torch.float32, 50, torch.device("cuda", 0),
                                              layer.spec.turns_tensor("cpu"), layer.spec.kernel_params(False))
    ids, out = torch.randint(0, 50, (4,)), torch.empty(4, 96)
    for _ in range(3):
        prepared.launch(ids, weight, 96, out, 0, 4, 4, 3, False)
    assert len(kernel.jit_calls) == 3 and not kernel.launches


def test_the_launches_ask_for_fma_contraction_unless_the_user_chose(recording_gpu_launch, monkeypatch):
    """Every launch asks Triton for FMA contraction (what the kernels were checked with), unless the user set
    Triton's default (TRITON_DEFAULT_FP_FUSION), which Triton then applies."""
    _, kernel, weight = recording_gpu_launch
    ids, out = torch.randint(0, 50, (4,)), torch.empty(4, 96)
    layer = pf.SinusoidalEmbedding(50, 96)
    for users_default, asked in ((None, {"enable_fp_fusion": True}), ("0", {}), ("1", {})):
        if users_default is None:
            monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
        else:
            monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", users_default)
        assert triton_backend.compile_options() == asked
        prepared = triton_backend.prepare_forward(torch.float32, 50, torch.device("cuda", 0),
                                                  layer.spec.turns_tensor("cpu"), layer.spec.kernel_params(False))
        prepared.launch(ids, weight, 96, out, 0, 4, 4, 3, False)
        assert kernel.jit_calls[-1][2].get("enable_fp_fusion") == asked.get("enable_fp_fusion"), users_default


def _launch(prepared, call):
    prepared.launch(call["ids"], call["weight"], 96, call["out"], call["offset"], call["seq_len"], call["ids"].numel(), 3,
                    False)


def test_a_new_specialization_goes_through_the_jit(recording_gpu_launch):
    """A call goes through the JIT exactly when its shape (tokens, table rows) or Triton's own specialization
    of its varying arguments (ids, table, output, offset, length) is one no earlier call had: offset or
    length 1, 16 | value, 64-bit values, the alignment of ids, table or output, the ids' dtype.  Each call
    is made twice: the second always takes the compiled kernel."""
    prepared, kernel, weight = recording_gpu_launch
    specialization = _triton_specialization()
    ids = torch.randint(0, 30, (41,))
    out = torch.empty(41 * 96 + 8)
    table = torch.empty(weight.numel() + 4)

    def output(tokens, start=0):
        return out[start:start + tokens * 96].view(tokens, 96)

    variants = {
        "offset": [5, 1, 32, 2**40, 2**63 + 3, -7, 6],
        "seq_len": [5, 1, 48, 7],
        "ids": [ids[1:11], ids[:10], ids[4:14], ids[:10].int(), ids[1:11].int()],
        "weight": [weight, table[1:1 + weight.numel()].view(50, 96), table[4:4 + weight.numel()].view(50, 96),
                   weight[:30]],
        "out": [output(10), output(10, 1), output(10, 8)],
        "tokens": [10, 4, 40, 16],
    }
    usual = {name: values[0] for name, values in variants.items()}
    seen = set()
    for name, values in variants.items():
        for value in values:
            call = dict(usual, **{name: value})
            if name == "tokens":
                call.update(ids=ids[1:1 + value], out=output(value))
            key = (call["ids"].numel(), call["weight"].shape[0],
                   *(specialization(call[n]) for n in ("ids", "weight", "out", "offset", "seq_len")))
            for repeat in range(2):
                jit_before, launches_before = len(kernel.jit_calls), len(kernel.launches)
                _launch(prepared, call)
                took_jit = len(kernel.jit_calls) - jit_before
                assert took_jit + len(kernel.launches) - launches_before == 1
                assert took_jit == (repeat == 0 and key not in seen), (name, value, repeat)
                seen.add(key)
            grid = kernel.jit_calls[-1][0] if took_jit else kernel.launches[-1][:2]
            assert grid[0] == -(-call["ids"].numel() // kernel.jit_calls[-1][2]["BLOCK_T"])
    assert len(kernel.jit_calls) == len(seen) >= 13


@pytest.mark.parametrize("setting", ["another device", "debug", "instrumentation", "stages hook", "pre-run hook",
                                     "JITFunction.run replaced", "CudaLauncher.__call__ replaced"])
def test_launches_that_are_not_plain_go_through_the_jit(recording_gpu_launch, monkeypatch, setting):
    """While the current device is another than the prepared one, or a setting the JIT reads per call is in
    force, every call goes through the JIT, and what it compiles then is not kept; once that is over, the
    kernel kept before serves the calls again."""
    prepared, kernel, weight = recording_gpu_launch
    call = dict(ids=torch.randint(0, 50, (8,)), weight=weight, out=torch.empty(8, 96), offset=3, seq_len=8)
    for _ in range(2):
        _launch(prepared, call)
    assert len(kernel.jit_calls) == 1 and kernel.launched_serials == [0]
    with monkeypatch.context() as change:
        if setting == "another device":
            CURRENT_DEVICE[0] = 1
        elif setting == "debug":
            change.setattr(triton.knobs.runtime, "debug", True)
        elif setting == "instrumentation":
            if not hasattr(triton.knobs.compilation, "instrumentation_mode"):
                pytest.skip("this Triton has no instrumentation mode")
            change.setattr(triton.knobs.compilation, "instrumentation_mode", "consan")
        elif setting == "stages hook":
            if not hasattr(triton.knobs.runtime, "add_stages_inspection_hook"):
                pytest.skip("this Triton has no stages-inspection hook")
            change.setattr(triton.knobs.runtime, "add_stages_inspection_hook", lambda: ("key", "hash"))
        elif setting == "pre-run hook":
            change.setattr(kernel, "pre_run_hooks", [lambda *args, **kwargs: None])
        elif setting == "CudaLauncher.__call__ replaced":  # (a tool's wrapper: the direct launch would skip it)
            from triton.backends.nvidia.driver import CudaLauncher
            change.setattr(CudaLauncher, "__call__", lambda self, *args: None)
        else:
            change.setattr(_RecordingKernel, "run", lambda self, *args, **kwargs: None)
        for _ in range(3):
            _launch(prepared, call)
        assert len(kernel.jit_calls) == 4 and kernel.launched_serials == [0]
    CURRENT_DEVICE[0] = 0
    for _ in range(2):
        _launch(prepared, call)
    assert len(kernel.jit_calls) == 4 and kernel.launched_serials == [0, 0, 0]


def test_only_a_compiled_kernel_is_kept(recording_gpu_launch, monkeypatch):
    """What the JIT returns is kept only if it is a compiled kernel (not a cache hook's None or an
    asynchronous compile's future)."""
    prepared, kernel, weight = recording_gpu_launch
    call = dict(ids=torch.randint(0, 50, (8,)), weight=weight, out=torch.empty(8, 96), offset=3, seq_len=8)
    with monkeypatch.context() as change:
        change.setattr(kernel, "returns_compiled", False)
        for _ in range(3):
            _launch(prepared, call)
    assert len(kernel.jit_calls) == 3 and not kernel.launches
    for _ in range(3):
        _launch(prepared, call)
    assert len(kernel.jit_calls) == 4 and kernel.launched_serials == [3, 3]


@pytest.mark.parametrize("hooked", ["enter", "exit", "both"])
def test_a_launch_hook_gets_its_metadata(recording_gpu_launch, monkeypatch, hooked):
    """With a launch hook set (a profiler's: on entry, exit or both), the compiled path makes the launch
    metadata and passes the hooks, as the JIT does; with none (None or an empty chain) it makes no metadata
    and passes None for each."""
    prepared, kernel, weight = recording_gpu_launch
    ids, out = torch.randint(0, 50, (4,)), torch.empty(4, 96)
    prepared.launch(ids, weight, 96, out, 0, 4, 4, 3, False)
    prepared.launch(ids, weight, 96, out, 0, 4, 4, 3, False)
    assert kernel.launches[-1][6:9] == (None, None, None)

    def hook(metadata):
        pass

    for name in ("launch_enter_hook", "launch_exit_hook"):
        if hooked not in (name.split("_")[1], "both"):
            continue
        chain = getattr(triton.knobs.runtime, name)
        if hasattr(chain, "calls"):  # a chain of hooks (newer Tritons): this one in it, for this test only
            monkeypatch.setattr(chain, "calls", [hook])
        else:
            monkeypatch.setattr(triton.knobs.runtime, name, hook)
    prepared.launch(ids, weight, 96, out, 0, 4, 4, 3, False)
    assert len(kernel.launches) == 2
    hooks = triton.knobs.runtime
    assert kernel.launches[-1][6:9] == (
        "launch metadata",
        hooks.launch_enter_hook if hooked in ("enter", "both") else None,
        hooks.launch_exit_hook if hooked in ("exit", "both") else None)


def _fake_driver_unavailable():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import fake_cuda_driver
    finally:
        sys.path.pop(0)
    return fake_cuda_driver.unavailable()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the next test runs the real driver")
def test_the_driver_gets_the_same_launch_from_every_path():
    """The prepared launch compiled for an H100 by Triton, launched by Triton's own launcher onto a stand-in
    driver (no GPU): for each call across specializations (explicit positions among them) and shapes, the
    JIT's launch and the kept kernel's (Triton's launch function called directly, with the kernel kept for the
    call's key) hand the driver the same kernel (each call's own: no key merges two of Triton's
    specializations), grid, block, shared memory and parameters, the call's own ids, table and output first,
    the scratch pointers null last; so does the kept kernel for the call moved to other values of its
    specialization; with a launch hook set too, which gets the metadata; and at the kept kernels' cap.  Every
    kernel is compiled with FMA contraction."""
    why = _fake_driver_unavailable()
    if why is not None:
        pytest.skip(why)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tests", "fake_driver_launches.py")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))  # this checkout's
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["calls"]) == 15
    for call in report["calls"]:
        jit, compiled = call["jit"], call["compiled"]
        assert compiled["launches"] > jit["launches"], call["call"]
        assert call["served_by_compiled"] == 1 and call["launch_function"], call["call"]
        assert call["moved_served_by_compiled"] == 1 and call["moved_launches"] == 1, call["call"]
        for field in ("function", "grid", "block", "shared_bytes", "params"):
            assert compiled[field] == jit[field], (call["call"], field)
            assert call["moved"][field] == call["moved_jit"][field], (call["call"], field)
        assert call["moved"]["function"] == jit["function"], call["call"]  # the same kernel, kept once
        assert jit["params"][:3] == call["addresses"], call["call"]
        assert call["moved_jit"]["params"][:3] == call["moved_addresses"], call["call"]
        assert call["moved"]["params"] != jit["params"], call["call"]  # other values, not the kept ones
        assert jit["params"][-2:] == [0, 0], call["call"]  # no scratch memory
        assert jit["block"][0] >= 32
    hooked = report["hooked"]  # the first call again, with a launch hook set
    assert hooked["served_by_compiled"] == 1 and hooked["compiled"]["params"] == hooked["jit"]["params"]
    assert [metadata["name"] for metadata in hooked["metadata"]] == ["forward_kernel"], hooked
    # At the kept kernels' cap all are dropped: the first call's launch goes through the JIT once (no kept kernel
    # serves it), then through its kept kernel again, the same launch both times.
    capped = report["capped"]
    assert capped["kept_before"] == 15 and capped["kept_after_new_key"] == 1, capped
    assert capped["first_launches"] == 1 and capped["second_launches"] == 1, capped
    assert capped["first_served_by_compiled"] == 0 and capped["second_served_by_compiled"] == 1, capped
    for which in ("first", "second"):
        for field in ("function", "grid", "block", "shared_bytes", "params"):
            assert capped[which][field] == capped["jit"][field], (which, field)
    # Every kernel compiled (the prepared and general forwards, the weight gradient's two) with FMA
    # contraction, and without Triton 3.9's warning where a launch leaves that to the default.
    assert all(report["fma_contraction"][name] for name in ("forward_kernel", "grad_chunk_kernel", "grad_carry_kernel"))
    assert all(all(flags) for flags in report["fma_contraction"].values()), report["fma_contraction"]
    assert not [message for message in report["compile_warnings"] if "FP_FUSION" in message], report
    # The twelve calls that differ from the usual one in a specialization (the first twelve) ran twelve kernels.
    assert len({call["jit"]["function"] for call in report["calls"][:12]}) == 12
    grids = {tuple(call["jit"]["grid"]) for call in report["calls"]}
    assert any(x > 1 and y > 1 for x, y, _ in grids), grids  # both grid dimensions told apart


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels' launcher needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_launches_match_the_jit_path_on_a_gpu(dtype, seed, monkeypatch):
    """The real launcher: calls across Triton's specializations (offsets 1, 16 | value, 64-bit; length 1;
    misaligned ids, table and output; int32 ids; explicit positions, aligned or not) and shapes (tokens, table
    rows), each made twice (the second through the kept kernel), into poisoned outputs, bit for bit against
    the JIT path (``_forward``)."""
    served = []

    def counting(self, *args, _real=triton_launch.KeptLaunches.launch):
        took = _real(self, *args)
        served.append(took)
        return took

    monkeypatch.setattr(triton_launch.KeptLaunches, "launch", counting)
    g = torch.Generator().manual_seed(seed)
    layer = pf.SinusoidalEmbedding(1000, 96, embed_scale=3.0)
    params = layer.spec.kernel_params(False)
    device = torch.device("cuda", torch.cuda.current_device())
    turns = layer.spec.turns_tensor(device)
    weight = torch.randn(1000, 96, generator=g).to(device=device, dtype=dtype)
    prepared = triton_backend.prepare_forward(dtype, 1000, device, turns, params)
    ids = torch.randint(0, 1000, (64,), generator=g).to(device)
    table = torch.empty(weight.numel() + 8, dtype=dtype, device=device)
    table[1:1 + weight.numel()] = weight.view(-1)
    out = torch.empty(64 * 96 + 8, dtype=dtype, device=device)
    calls = [(ids[:16], weight, 0, 16, 4), (ids[:16], weight, 1, 16, 4), (ids[:16], weight, 32, 16, 1),
             (ids[1:17], weight, 2**40 + 3, 16, 16), (ids[:16].int(), weight, -7, 16, 2),
             (ids[:16], table[1:1 + weight.numel()].view(1000, 96), 2**62, 16, 16), (ids[:16], weight, 9, 16, 16),
             (ids[:4], weight, 9, 4, 4), (ids[:40], weight, 9, 40, 8), (ids[:16] % 300, weight[:300], 9, 16, 16)]
    calls = [call + (None,) for call in calls]
    positions = torch.randint(-(2**40), 2**40, (17,), generator=g).to(device)
    calls += [(ids[:16], weight, 0, 16, 16, positions[:16]), (ids[:16], weight, 0, 16, 16, positions[1:])]
    for call_ids, call_weight, offset, num_tokens, seq_len, call_positions in calls:
        want = triton_backend.forward(call_ids, call_weight, turns, call_positions, None, offset, seq_len, params,
                                      None)
        for output_start in (0, 1):
            got = out[output_start:output_start + num_tokens * 96].view(num_tokens, 96)
            for _ in range(2):
                got.fill_(float("nan"))
                prepared.launch(call_ids, call_weight, 96, got, offset, seq_len, num_tokens,
                                prepared.last_argument(), False, call_positions)
                torch.cuda.synchronize()
                assert torch.equal(_bits(got), _bits(want)), (offset, seq_len, output_start)
    assert served.count(True) >= len(calls) * 2, served  # the kept kernels served the repeats


@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_concat_grid_stays_within_cudas_limit(layout, seed, monkeypatch):
    """Concat mode copies the token part in column blocks 2 * BLOCK_P wide: beside a PE of 1 to 4 columns, the
    widest row (``MAX_ROW_WIDTH``) made 10^6 blocks, beyond the 65535 that CUDA allows on the grid's second
    axis.  Such a token part takes wider tiles; at a small bound on the copy blocks, those tiles (BLOCK_P
    beyond the PE's pairs) compute the layer as the float64 reference does."""
    for d_pos in (1, 2, 3, 4, 64, 300):
        spec = pf.SinusoidalEmbedding(1, MAX_ROW_WIDTH, mode="concat", d_pos=d_pos, layout=layout, device="meta").spec
        params = spec.kernel_params(False)
        grid, copy_blocks = triton_backend._forward_grid(params, triton_backend._forward_tiles(params, 1, 4), 1)
        assert copy_blocks <= triton_backend.MAX_COPY_BLOCKS and grid[1] <= 65535, (d_pos, grid)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setattr(triton_backend, "MAX_COPY_BLOCKS", 3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (2, 5), generator=g)
    weight = torch.randn(50, 64, generator=g)
    spec = pf.SinusoidalEmbedding(50, 66, mode="concat", d_pos=2, layout=layout, device="meta").spec
    params = spec.kernel_params(False)
    assert triton_backend._forward_tiles(params, ids.numel(), 4).block_p == 16  # (1 pair: 1 without the bound)
    out = triton_backend.forward(ids.reshape(-1).to(device), weight.to(device), spec.turns_tensor(device), None, None,
                                 7, 5, params, None)
    exact = reference.sinusoidal_embedding(ids, weight.double(), mode="concat", d_pos=2, layout=layout, offset=7)
    assert_within(out.reshape(2, 5, 66), exact, output_bound(exact, torch.float32), f"concat, d_pos 2, {layout}")
