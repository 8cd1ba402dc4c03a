"""Kept Triton kernels: a prepared launch's repeated calls on a GPU launch the compiled kernel that Triton's
JIT returned for the same specialization, through that kernel's own launch function (docs/design.md, "Hostile
input", the prepared launches: why, which launches take this path, and how the tests check it).  The key of a call
(``int_specialization`` and the prepared launch's alignment flags) must be at least as fine as Triton's own
specialization."""

from __future__ import annotations

import inspect
import os
import threading
from typing import Callable, NamedTuple, Optional

import torch

# The Triton releases whose JITFunction.run launches a compiled kernel as KeptLaunches does (read in their
# sources); on others every call takes the JIT.
TESTED_TRITON = ((3, 5), (3, 10))


def int_specialization(value: int):
    """What Triton's JIT specialises an int argument on (``specialize_impl`` in triton.runtime.jit, Triton 3.5
    to 3.9): 1 is made a constant; otherwise its type by range (i32, u64 or i64) and whether 16 divides it.
    Returns -1 for the constant 1, True or False for an i32 that 16 divides or not (one comparison and one
    mask, the common case), else the pair (16 | value, u64).  Tensors' dtype and alignment are in the
    caller's key."""
    if -2147483648 <= value <= 2147483647:
        return -1 if value == 1 else value & 15 == 0
    return (value % 16 == 0, value >= 2**63)


class KeptLaunches:
    """One JIT kernel's compiled kernels, kept per key by a prepared launch, and their launches.  A key's first
    call goes through the JIT, which compiles or finds the kernel and returns it (``keep``); later calls launch
    it with the same grid and the arguments that the key fixes (``launch``)."""

    # Kernels kept (a decoding loop needs one or two); at the cap all are dropped and kept again as called.
    _KEPT = 64

    def __init__(self, kernel, device_index: Optional[int]):
        self._device_index = device_index
        self._kernel = kernel
        self._kernels = {}
        self._constexpr_names = []
        self._keeping = threading.Lock()  # keep's clear and insert as one step
        import triton

        low, high = TESTED_TRITON
        version = tuple(int(part) for part in triton.__version__.split(".")[:2])
        self._enabled = device_index is not None and torch.version.hip is None and low <= version < high
        if self._enabled:
            # (As Triton tells a constexpr parameter: by its annotation.)
            self._constexpr_names = [param.name for param in inspect.signature(kernel.fn).parameters.values()
                                     if "constexpr" in str(param.annotation)]
            from triton import knobs
            from triton.compiler import CompiledKernel
            from triton.runtime.jit import JITFunction

            self._runtime, self._compilation = knobs.runtime, knobs.compilation
            self._compiled_type = CompiledKernel
            self._jit_run = JITFunction.run
            self._launcher_type, self._launcher_call = _nvidia_launcher()
            # (torch.cuda.current_device less its lazy-init check: a prepared launch runs after CUDA's use)
            self._current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

    def constexpr_values(self, constexprs: dict) -> tuple:
        """The constexpr arguments, in signature order, that the launcher takes after the others."""
        return tuple(constexprs[name] for name in self._constexpr_names)

    def _plain(self) -> bool:
        """Whether the JIT would launch the kept kernel now as it did: on the prepared device, with no
        per-call setting of the JIT's in force (docs/design.md)."""
        runtime = self._runtime
        return (self._current_device() == self._device_index and not runtime.debug
                and not getattr(self._compilation, "instrumentation_mode", "")
                and getattr(runtime, "add_stages_inspection_hook", None) is None
                and not self._kernel.pre_run_hooks and type(self._kernel).run is self._jit_run
                and (self._launcher_type is None or self._launcher_type.__call__ is self._launcher_call))

    def launch(self, key, stream: int, varying: tuple) -> bool:
        """Launch the kernel kept for ``key``, ``varying`` its leading arguments (the kept kernel holds the
        rest); False where none is kept or the launch is not plain, and the caller goes through the JIT."""
        kept = self._kernels.get(key)
        if kept is None or not self._plain():
            return False
        runtime = self._runtime
        enter_hook, exit_hook = runtime.launch_enter_hook, runtime.launch_exit_hook
        # _hooks_to_call inline for the usual case: no hook, or an empty chain (Triton's default).
        if ((enter_hook is None or not getattr(enter_hook, "calls", True))
                and (exit_hook is None or not getattr(exit_hook, "calls", True))):
            # None for both: nothing would be called anyway, and the launcher skips two calls into Python
            # and the metadata.
            kept.launch(stream, varying)
        else:
            # The hooks (a profiler's) that call something get metadata made as the JIT makes it.
            enter_hook, exit_hook = (hook if _hooks_to_call(hook) else None for hook in (enter_hook, exit_hook))
            kept.launch(stream, varying, enter_hook, exit_hook)
        return True

    def keep(self, key, compiled, grid, arguments_after: tuple) -> None:
        """Keep what the JIT's plain launch returned: a compiled kernel, launched and so loaded on the
        current device (not a hook's None or an asynchronous compile's future), with its grid and the
        arguments after the varying ones."""
        if not self._enabled or not isinstance(compiled, self._compiled_type) or not self._plain():
            return
        kept = _KeptKernel(compiled, _launch_function(compiled, self._launcher_type, grid, arguments_after))
        with self._keeping:
            if len(self._kernels) >= self._KEPT:
                self._kernels.clear()
            self._kernels[key] = kept


def _hooks_to_call(hook) -> bool:
    """Whether a launch hook calls anything: not None, nor an empty chain (``knobs.HookChain``)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class _KeptKernel(NamedTuple):
    compiled: object  # triton.compiler.CompiledKernel
    launch: Callable  # (stream, varying arguments[, enter_hook, exit_hook]) -> None


def _nvidia_launcher():
    """Triton's NVIDIA launcher class and its ``__call__``, whose launch ``_launch_function`` reproduces;
    (None, None) without an NVIDIA backend.  Where the class or the method is not Triton's own (a tool
    replaced one), the method is None: no launch is plain (``KeptLaunches._plain``), and the JIT calls
    the tool's."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None, None
    launcher_type = driver.CudaLauncher
    call = launcher_type.__call__
    code = getattr(call, "__code__", None)
    tritons_own = (launcher_type.__module__ == driver.__name__ and launcher_type.__qualname__ == "CudaLauncher"
                   and code is not None and code.co_name == "__call__"
                   and os.path.realpath(code.co_filename) == os.path.realpath(driver.__file__))
    return launcher_type, call if tritons_own else None


_BUILTIN_FUNCTION = type(len)


def _launch_function(compiled, launcher_type, grid, arguments_after: tuple) -> Callable:
    """``compiled``'s launch on ``grid`` with the arguments ``varying + arguments_after``, as a function of the
    stream, ``varying`` and the hooks when some are to be called (then with launch metadata made as the JIT
    makes it; addresses in place of tensors change nothing, as only a kernel's own launch_metadata function
    reads the arguments, and these kernels define none).

    Calls the launcher's C launch function as ``CudaLauncher.__call__`` does (Triton 3.5 to 3.9) where the
    launcher adds nothing else (no scratch memory, sanitizer or tensor descriptors); otherwise the launcher
    itself, which allocates the scratch.  ``launcher_type``: ``_nvidia_launcher``'s class, or None."""
    launcher = compiled.run
    function, packed_metadata = compiled.function, compiled.packed_metadata
    grid_x, grid_y = grid[0], grid[1]
    launch_metadata = compiled.launch_metadata
    launch_c = getattr(launcher, "launch", None)
    if (launcher_type is None or type(launcher) is not launcher_type or launcher.global_scratch_size
            or launcher.profile_scratch_size or getattr(launcher, "gsan_enabled", False)
            or not isinstance(launch_c, _BUILTIN_FUNCTION)):
        def through_launcher(stream, varying, enter_hook=None, exit_hook=None):
            arguments = varying + arguments_after
            metadata = None if enter_hook is None and exit_hook is None else launch_metadata(grid, stream, *arguments)
            launcher(grid_x, grid_y, 1, stream, function, packed_metadata, metadata, enter_hook, exit_hook, *arguments)
        return through_launcher
    cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    if hasattr(launcher, "arg_annotations"):
        # Triton 3.7 on: one launch function for every kernel, given the kernel's signature and the arguments
        # as a tuple; the scratch pointers (None: no scratch) after the hooks.
        annotations, signature = launcher.arg_annotations, launcher.kernel_signature

        def launch(stream, varying, enter_hook=None, exit_hook=None):
            arguments = varying + arguments_after
            metadata = None if enter_hook is None and exit_hook is None else launch_metadata(grid, stream, *arguments)
            launch_c(grid_x, grid_y, 1, stream, function, cooperative, pdl, packed_metadata, metadata, enter_hook,
                     exit_hook, None, None, annotations, signature, arguments)
    else:
        # Triton 3.5 and 3.6: a launch function made for the kernel's signature; the scratch pointers before
        # the metadata, the arguments spread.
        def launch(stream, varying, enter_hook=None, exit_hook=None):
            arguments = varying + arguments_after
            metadata = None if enter_hook is None and exit_hook is None else launch_metadata(grid, stream, *arguments)
            launch_c(grid_x, grid_y, 1, stream, function, cooperative, pdl, None, None, packed_metadata, metadata,
                     enter_hook, exit_hook, *arguments)
    return launch
