"""Run in its own process by tests/test_triton_backend.py: the ``triton`` backend's prepared launch compiled for
an H100 and launched through Triton's real launcher onto the stand-in CUDA driver (bench/fake_cuda_driver.py),
which records each launch.  For each call (across Triton's specializations of the varying arguments and
across shapes) the launch that the JIT makes and the one the kept kernel makes (``triton_launch.KeptLaunches``)
must hand the driver the same grid, block, shared memory and parameters (the scratch pointers included), with
the call's own tensors' addresses among them; so must the kept kernel for the call moved to other values of
its specialization.

Prints one JSON object: {"triton": version, "calls": [{"call", "jit", "compiled", "moved", "moved_jit"...}...],
"hooked": the first call again with a launch hook set, "capped": the first call twice after the kept kernels'
cap, "compile_warnings": [what the first launches warned], "fma_contraction": {kernel: [each compiled kernel's
enable_fp_fusion]}}.  Its own process, because the stand-in replaces Triton's driver and the kernels are
compiled, not interpreted."""

from __future__ import annotations

import json
import os
import sys
import warnings

WIDTH = 2048  # two programs across a row (Triton's grid is 2-D here)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels (the tests' process interprets them)
# Triton's settings that would change what is checked: the package's own compile options (FMA contraction),
# and plain launches (debug and an instrumentation mode send every launch through the JIT).
for setting in ("TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION", "TRITON_DEBUG",
                "TRITON_INSTRUMENTATION_MODE"):
    os.environ.pop(setting, None)

import fake_cuda_driver  # noqa: E402
import torch  # noqa: E402

# The width in bytes of each kind of kernel parameter, as Triton's signature names it.
_PARAMETER_BYTES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2, "i32": 4, "u32": 4,
                    "fp32": 4, "f32": 4, "i64": 8, "u64": 8, "fp64": 8}


def parameter_bytes(compiled) -> list:
    """The kernel's parameters' widths, in order: its arguments less the constexprs, then the global and profile
    scratch pointers that Triton's launcher appends (Triton 3.5 to 3.9)."""
    sizes = []
    for kind in compiled.src.signature.values():
        if kind == "constexpr":
            continue
        sizes.append(8 if kind.startswith("*") else _PARAMETER_BYTES[kind])
    return sizes + [8, 8]


def main() -> None:
    restore = fake_cuda_driver.install()
    import triton

    import posenc_fast as pf
    from posenc_fast.backends import triton_backend, triton_launch

    triton_backend._load_kernels()
    assert triton_backend._kernels_interpreted is False
    torch._C._cuda_getDevice = lambda: 0  # the prepared device is current (CPU torch has no CUDA state)
    served = []
    real_launch = triton_launch.KeptLaunches.launch
    jit_only = [False]

    def counting_launch(self, *args):
        took = False if jit_only[0] else real_launch(self, *args)
        served.append(took)
        return took

    triton_launch.KeptLaunches.launch = counting_launch
    generator = torch.Generator().manual_seed(int(os.environ.get("POSENC_FAST_TEST_SEED", "0")))
    layer = pf.SinusoidalEmbedding(1000, WIDTH, embed_scale=3.0)
    params = layer.spec.kernel_params(False)
    device = torch.device("cuda", 0)
    turns = layer.spec.turns_tensor("cpu")
    weight = torch.randn(1000, WIDTH, generator=generator)
    prepared = triton_backend.prepare_forward(torch.float32, 1000, device, turns, params)
    kept = next(cell.cell_contents for cell in prepared.launch.__closure__
                if isinstance(cell.cell_contents, triton_launch.KeptLaunches))
    ids = torch.randint(0, 1000, (64,), generator=generator)
    table = torch.empty(weight.numel() + 8)
    table[1:1 + weight.numel()] = weight.view(-1)
    out = torch.empty(64 * WIDTH + 8)
    positions = torch.randint(-(2**40), 2**40, (17,), generator=generator)
    usual = dict(ids=ids[:16], weight=weight, offset=9, num_tokens=16, seq_len=5, output_start=0, positions=None)
    # Each call differs from the usual one in one thing that Triton specialises on, or in its shape.
    variants = [("usual", {}), ("offset 1", dict(offset=1)), ("offset 16 | value", dict(offset=32)),
                ("64-bit offset", dict(offset=2**40 + 3)), ("length 1", dict(seq_len=1)),
                ("length 16 | value", dict(seq_len=48)), ("misaligned ids", dict(ids=ids[1:17])),
                ("int32 ids", dict(ids=ids[:16].int())),
                ("misaligned table", dict(weight=table[1:1 + weight.numel()].view(1000, WIDTH))),
                ("misaligned output", dict(output_start=1)), ("positions", dict(positions=positions[:16], offset=0)),
                ("misaligned positions", dict(positions=positions[1:], offset=0)),
                ("4 tokens", dict(ids=ids[:4], num_tokens=4)),
                ("40 tokens", dict(ids=ids[:40], num_tokens=40)),
                ("300-row table", dict(ids=ids[:16] % 300, weight=weight[:300]))]
    calls = []
    for name, change in variants:
        call = dict(usual, **change)
        start = call["output_start"]
        call["out"] = out[start:start + call["num_tokens"] * WIDTH].view(call["num_tokens"], WIDTH)
        calls.append((name, call))

    def moved(call):
        """``call`` with other values that Triton specialises the same way: ids and output in new buffers at the
        same address modulo 16, offset and length 16 on (1, a constant, stays 1)."""
        def same_alignment(like, values):  # (CPU allocations start 64-byte aligned)
            start, count = like.data_ptr() % 16 // like.element_size(), like.numel()
            fresh = torch.empty(count + 16, dtype=like.dtype)
            fresh[start:start + count] = values.reshape(-1)
            return fresh[start:start + count].view(like.shape)
        positions = call["positions"]
        return dict(call, ids=same_alignment(call["ids"], call["ids"].flip(0)),
                    out=same_alignment(call["out"], call["out"]),
                    positions=None if positions is None else same_alignment(positions, positions.flip(0) + 1),
                    offset=call["offset"] if call["offset"] == 1 else call["offset"] + 16,
                    seq_len=call["seq_len"] if call["seq_len"] == 1 else call["seq_len"] + 16)

    def launch(call):
        prepared.launch(call["ids"], call["weight"], WIDTH, call["out"], call["offset"], call["seq_len"],
                        call["num_tokens"], 0, False, call["positions"])
        return fake_cuda_driver.last_launch()

    # First every call once: each compiles a new specialization (or shape), which is kept.
    kept_for = {}
    compile_warnings = []
    for name, call in calls:
        keys_before = set(kept._kernels)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            launch(call)
        compile_warnings += [str(warning.message) for warning in caught]
        new_keys = set(kept._kernels) - keys_before
        assert len(new_keys) == 1, f"{name}: no new key, yet Triton specialises it apart from the calls before"
        kept_for[name] = kept._kernels[new_keys.pop()]
    # Then each through the JIT, then each through the compiled path: a kernel kept for another call under a
    # key too coarse would show here.
    through_jit = {}
    jit_only[0] = True
    for name, call in calls:
        fake_cuda_driver.record_parameters(parameter_bytes(kept_for[name].compiled))
        through_jit[name] = launch(call)
    jit_only[0] = False
    results = []
    for name, call in calls:
        fake_cuda_driver.record_parameters(parameter_bytes(kept_for[name].compiled))
        served_before = served.count(True)
        through_compiled = launch(call)
        results.append({
            "call": name, "jit": through_jit[name], "compiled": through_compiled,
            "served_by_compiled": served.count(True) - served_before,
            "launch_function": kept_for[name].launch.__name__ == "launch",  # (not the launcher's Python frame)
            "addresses": [call["ids"].data_ptr(), call["weight"].data_ptr(), call["out"].data_ptr()],
        })
    # Then each call moved to other values of its specialization (other addresses with the same alignment,
    # offset and length 16 on), which the kept kernel holds none of: through the JIT, then the kept kernel.
    for (name, call), result in zip(calls, results):
        fake_cuda_driver.record_parameters(parameter_bytes(kept_for[name].compiled))
        moved_call = moved(call)
        jit_only[0] = True
        result["moved_jit"] = launch(moved_call)
        jit_only[0] = False
        served_before = served.count(True)
        launches_before = fake_cuda_driver.last_launch()["launches"]
        result["moved"] = launch(moved_call)
        result["moved_launches"] = result["moved"]["launches"] - launches_before
        result["moved_served_by_compiled"] = served.count(True) - served_before
        result["moved_addresses"] = [moved_tensor.data_ptr() for moved_tensor in (moved_call["ids"],
                                                                                   moved_call["weight"],
                                                                                   moved_call["out"])]
    # With a launch hook (a profiler's), the compiled path gives it the metadata and launches the same.
    seen_by_hook = []
    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(seen_by_hook.append)
    try:
        name, call = calls[0]
        fake_cuda_driver.record_parameters(parameter_bytes(kept_for[name].compiled))
        served_before = served.count(True)
        hooked = {"call": name, "jit": through_jit[name], "compiled": launch(call),
                  "served_by_compiled": served.count(True) - served_before,
                  "metadata": [{key: str(value) for key, value in dict(metadata.get()).items()}
                               for metadata in seen_by_hook]}
    finally:
        hooks.remove(seen_by_hook.append)
    # The kept kernels at their cap: a new key's keep drops them all, so the first call's next launch goes
    # through the JIT, which keeps it again, and the one after through the kept kernel.
    capped = {"kept_before": len(kept._kernels)}
    kept._KEPT = len(kept._kernels)
    try:
        launch(dict(calls[0][1], ids=ids[:24], num_tokens=24, out=out[:24 * WIDTH].view(24, WIDTH)))  # a new key
        capped["kept_after_new_key"] = len(kept._kernels)
        name, call = calls[0]
        for which in ("first", "second"):
            served_before = served.count(True)
            fake_cuda_driver.record_parameters(parameter_bytes(kept_for[name].compiled))
            launches_before = fake_cuda_driver.last_launch()["launches"]
            capped[which] = launch(call)
            capped[which + "_launches"] = capped[which]["launches"] - launches_before
            capped[which + "_served_by_compiled"] = served.count(True) - served_before
    finally:
        del kept._KEPT
    capped["jit"] = through_jit[name]
    # The general path's forward and the weight gradient's kernels too: every kernel compiled here, by
    # kernel, with the FMA contraction it was compiled with.  (Nothing recorded: the parameter widths set
    # above are the forward kernel's.)
    fake_cuda_driver.record_parameters([])
    triton_backend.forward(ids[:16], weight, turns, None, None, 3, 16, params, None)  # (outputs not read)
    triton_backend.backward(torch.randn(16, WIDTH, generator=generator), ids[:16], 1000, WIDTH, 3.0, -1,
                            torch.float32, None)
    fma_contraction = {}
    for kernel_name in ("forward_kernel", "grad_chunk_kernel", "grad_carry_kernel"):
        jit_function = getattr(triton_backend._Kernels.state, kernel_name)
        fma_contraction[kernel_name] = [compiled.metadata.enable_fp_fusion
                                        for caches in jit_function.device_caches.values()
                                        for compiled in caches[0].values()]
    restore()
    print(json.dumps({"triton": triton.__version__, "calls": results, "hooked": hooked, "capped": capped, "compile_warnings": compile_warnings,
                      "fma_contraction": fma_contraction}))


if __name__ == "__main__":
    main()
