"""Run in its own process by tests/test_triton_backend.py: the host extension's launch of a kept kernel
(csrc/driver_launch.h) on the stand-in CUDA driver (bench/fake_cuda_driver.py), without Triton's JIT.

A handmade kernel description with every parameter type the launch packs: each call must hand the driver
the kept function, grid, block, shared memory and stream, the fixed parameters packed once and the five
slots written per call (only the addresses where the offset and length are the constant 1); a call that
Triton would specialise apart (each part of the key) launches nothing; arguments that do not convert
launch nothing and leave no error set; refusals, a thread without a context,
a driver error, the cap on kept kernels and the reference to the compiled kernel behave as documented.
Exits non-zero with the first failed check; its own process, because the stand-in replaces the process's
libcuda."""

from __future__ import annotations

import gc
import os
import struct
import sys
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))

import fake_cuda_driver  # noqa: E402
import torch  # noqa: E402

from posenc_fast.backends import cpu_backend  # noqa: E402

# A kernel's parameters as Triton's signature types them: the three pointer slots, fixed parameters of every
# kind the launch packs, the offset (i32) and length (i64) slots, a scratch pointer.
PARAMETERS = [("*i64", None), ("*fp32", None), ("*fp32", None), ("*i64", 0x1234560), ("i32", -7),
              ("u32", 2**32 - 1), ("i64", -(2**40)), ("u64", 2**64 - 1), ("fp32", 1 / 3), ("fp64", 1 / 3),
              ("i32", 0), ("i64", 0), ("*i8", None)]
SLOTS = [0, 1, 2, 10, 11]
WIDTHS = [8, 8, 8, 8, 4, 4, 8, 8, 4, 8, 4, 8, 8]
# The call the kernel is kept for (launch's arguments after the stream): ids' dtype, ids, weight and out
# addresses, offset (an i32 that 16 does not divide), length (an i64), tokens, table rows, row stride.
KEPT_CALL = (torch.int64, 0x1000, 0x2000, 0x3000, 9, 2**40 + 3, 16, 1000, 64)
FUNCTION, GRID, BLOCK, SHARED = 0xABC0, (3, 2), 128, 1024


def check(condition, what):
    if not condition:
        raise SystemExit(f"driver_launch_cases: {what}")


def expected_parameters(ids, weight, out, offset, seq_len):
    fixed = [0x1234560, (-7) & 0xFFFFFFFF, 2**32 - 1, (-(2**40)) & (2**64 - 1), 2**64 - 1,
             struct.unpack("<I", struct.pack("<f", 1 / 3))[0], struct.unpack("<Q", struct.pack("<d", 1 / 3))[0]]
    return (ids, weight, out, *fixed, offset & 0xFFFFFFFF, seq_len, 0)


def main() -> None:
    fake_cuda_driver.load()
    fake_cuda_driver.record_parameters(WIDTHS)
    host = cpu_backend.extension()
    check(host is not None and hasattr(host, "kept_launches"), "the host extension has no kept_launches")
    owner, launch = host.kept_launches()

    class Compiled:  # stands for Triton's compiled kernel, which the kept entry must keep alive
        pass

    compiled = Compiled()
    compiled_alive = weakref.ref(compiled)
    host.keep_launch(owner, *KEPT_CALL, compiled, FUNCTION, *GRID, BLOCK, SHARED, PARAMETERS, SLOTS)
    del compiled
    gc.collect()
    check(compiled_alive() is not None, "the kept entry does not hold the compiled kernel")

    def launches():
        return fake_cuda_driver.last_launch()["launches"]

    # Other values of the kept specialization: new addresses with the same alignments, offset and length 16 on.
    before = launches()
    check(launch(0x77, torch.int64, 0x1010, 0x2020, 0x3030, 25, 2**40 + 19, 16, 1000, 64) is True, "a kept call")
    last = fake_cuda_driver.last_launch()
    check(last["launches"] == before + 1, "one launch per call")
    check((last["function"], last["stream"], last["grid"], last["block"], last["shared_bytes"])
          == (FUNCTION, 0x77, (*GRID, 1), (BLOCK, 1, 1), SHARED), f"the launch's configuration: {last}")
    check(last["params"] == expected_parameters(0x1010, 0x2020, 0x3030, 25, 2**40 + 19), f"parameters: {last}")
    check(launch(0, torch.int64, 0x1000, 0x2000, 0x3000, -7, 2**40 + 3, 16, 1000, 64) is True, "a negative offset")
    check(fake_cuda_driver.last_launch()["params"] == expected_parameters(0x1000, 0x2000, 0x3000, -7, 2**40 + 3),
          "a negative offset's parameters")

    # Calls that Triton specialises apart from the kept one: nothing launched.
    base = dict(zip(("ids_dtype", "ids", "weight", "out", "offset", "seq_len", "num_tokens", "table_rows",
                     "row_stride"), KEPT_CALL))
    others = [dict(offset=1), dict(offset=32), dict(offset=2**40 + 3), dict(seq_len=1), dict(seq_len=5),
              dict(seq_len=2**40 + 16), dict(ids=0x1008), dict(weight=0x2004), dict(out=0x3002),
              dict(ids_dtype=torch.int32), dict(num_tokens=17), dict(table_rows=999), dict(row_stride=128)]
    for change in others:
        before = launches()
        check(launch(0, *dict(base, **change).values()) is False and launches() == before, f"key part {change}")

    # Arguments that do not convert: False, nothing launched, no error left set (else Python raises SystemError).
    for bad in (dict(offset=2**63), dict(ids=-1), dict(ids=1.5), dict(num_tokens="16")):
        before = launches()
        check(launch(0, *dict(base, **bad).values()) is False and launches() == before, f"argument {bad}")
    check(launch(-1, *KEPT_CALL) is False, "a negative stream")
    try:
        launch(0, *KEPT_CALL[:-1])
        check(False, "a call with nine arguments")
    except TypeError:
        pass

    # Descriptions the launch refuses, with a ValueError (the triton backend then keeps Triton's launch).
    refused = [([*PARAMETERS[:4], ("bf16", 1.0), *PARAMETERS[5:]], SLOTS, "a type it does not pack"),
               (PARAMETERS, [0, 1, 2, 10, 13], "a slot past the parameters"),
               (PARAMETERS, [4, 1, 2, 10, 11], "a pointer slot on an int"),
               (PARAMETERS, [0, 1, 2, 11, 10], "int slots of the wrong widths for the key")]
    for parameters, slots, what in refused:
        try:
            host.keep_launch(owner, *KEPT_CALL, Compiled(), FUNCTION, *GRID, BLOCK, SHARED, parameters, slots)
            check(False, f"keep_launch took {what}")
        except ValueError:
            pass

    # No current context: nothing launched.  A driver error: a RuntimeError naming it.
    fake_cuda_driver.set_no_context(True)
    before = launches()
    check(launch(0, *KEPT_CALL) is False and launches() == before, "a thread without a current context")
    fake_cuda_driver.set_no_context(False)
    fake_cuda_driver.set_launch_result(700)
    try:
        launch(0, *KEPT_CALL)
        check(False, "a driver error raised nothing")
    except RuntimeError as error:
        check("700" in str(error), f"the driver error's message: {error}")
    finally:
        fake_cuda_driver.set_launch_result(0)

    # An offset and a length of 1 are constants, not parameters (slots -1): a kernel kept for them gets only
    # the addresses written.
    constant_parameters = [PARAMETERS[index] for index in range(len(PARAMETERS)) if index not in (10, 11)]
    constant_call = (*KEPT_CALL[:4], 1, 1, *KEPT_CALL[6:])
    host.keep_launch(owner, *constant_call, Compiled(), FUNCTION + 16, *GRID, BLOCK, SHARED, constant_parameters,
                     [0, 1, 2, -1, -1])
    fake_cuda_driver.record_parameters([width for index, width in enumerate(WIDTHS) if index not in (10, 11)])
    check(launch(0, torch.int64, 0x1010, 0x2020, 0x3030, 1, 1, *KEPT_CALL[6:]) is True, "offset and length 1")
    last = fake_cuda_driver.last_launch()
    wanted = expected_parameters(0x1010, 0x2020, 0x3030, 0, 0)
    check(last["function"] == FUNCTION + 16 and last["params"] == wanted[:10] + wanted[12:],
          f"offset and length 1: {last}")
    fake_cuda_driver.record_parameters(WIDTHS)

    # At most 64 kept, then all cleared: with the two above, 62 more fit; the next clears them.
    check(host.MAX_KEPT_LAUNCHES == 64, f"the module says it keeps {host.MAX_KEPT_LAUNCHES}")
    for rows in range(2000, 2062):
        call = (*KEPT_CALL[:7], rows, KEPT_CALL[8])
        host.keep_launch(owner, *call, Compiled(), FUNCTION, *GRID, BLOCK, SHARED, PARAMETERS, SLOTS)
    check(launch(0, *KEPT_CALL) is True and launch(0, *KEPT_CALL[:7], 2000, KEPT_CALL[8]) is True,
          "64 kept kernels, the first and the third still there")
    host.keep_launch(owner, *KEPT_CALL[:7], 2062, KEPT_CALL[8], Compiled(), FUNCTION, *GRID, BLOCK, SHARED,
                     PARAMETERS, SLOTS)
    check(launch(0, *KEPT_CALL) is False and launch(0, *KEPT_CALL[:7], 2000, KEPT_CALL[8]) is False,
          "a 65th kept kernel did not clear the others")
    check(launch(0, *KEPT_CALL[:7], 2062, KEPT_CALL[8]) is True, "the last kept kernel")
    check(compiled_alive() is None, "a cleared entry still holds its compiled kernel")
    del owner, launch
    print("driver_launch_cases: all checks hold")


if __name__ == "__main__":
    main()
