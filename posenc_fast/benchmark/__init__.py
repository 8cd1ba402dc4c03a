"""``python -m posenc_fast bench``: time the fused layer against eager PyTorch and torch.compile.

One concern per module:

- ``cases``: the cases, implementations and ops, and the byte model (``bytes_moved``);
- ``impls``: the implementations built over one case's random inputs, and the callables timed;
- ``timing``: how each op is timed, the copy bandwidth, a step's peak memory;
- ``results``: the JSON results file (schema, validation, writing, merging);
- ``report``: speedups, targets, the printed table and the PNG plot;
- ``run``: the run itself, case by case; ``cli``: ``python -m posenc_fast bench``.

The names below are re-exported here (``from posenc_fast import benchmark as bench``).
``bench/test_bench.py`` runs the same cases through pytest-benchmark; ``bench/README.md`` says
how to read the results and ``docs/performance.md`` the predictions against the measurements.

Implementations (``IMPLS``):

- ``eager``: ``baselines.EagerSinusoidalEmbedding`` (nn.Embedding + a registered fp32 sinusoid
  table, embed scale, add or torch.cat, cast), the usual PyTorch layer.
- ``compile`` / ``compile-max-autotune``: ``torch.compile`` of that same module (default mode /
  ``mode="max-autotune-no-cudagraphs"``), ``dynamic=False``, compiled afresh for every case.
- ``triton`` / ``cuda`` / ``cpu``: ``SinusoidalEmbedding(backend=...)`` (``cpu``: the native CPU
  kernels, on the ``cpu`` cases), timed with the host-side id range check off
  (``posenc_fast.id_check(False)``); the headline forward with the check on is printed as an extra
  line (the JSON's ``impl`` enum has no slot for it).
- ``torch``: the float64 reference backend; timed only when named, printed but never written to
  the JSON (not in its ``impl`` enum).

Ops: ``forward`` (under ``torch.no_grad()``, as inference and decoding run it), ``backward``
(``torch.autograd.grad`` of one retained forward graph: the weight gradient alone) and ``step``
(``weight.grad = None``, forward, ``backward(grad_out)``).  How each is timed: ``timing``; the
inputs: ``impls``.
"""

from .cases import (  # noqa: F401
    OPS, IMPLS, JSON_IMPLS, FUSED_IMPLS, COMPILE_IMPLS, GPU_DEFAULT_IMPLS, CPU_DEFAULT_IMPLS, ID_BYTES, D_POS,
    RESULT_KEYS, DOCUMENT_KEYS, TARGETS, CPU_TARGETS, DECODE_TARGET_X_EAGER, Case, CASES, CPU_CASES, QUICK_CASES,
    CPU_QUICK_CASES, HEADLINE, CASE_BY_NAME, select_cases,
    for_device, bytes_moved, floor_ms,
)
from .impls import (  # noqa: F401
    rotation_sets, CaseInputs, Runner, impl_unavailable, build_runner, forward_fn, backward_fn, step_fn,
    relative_error, agreement_bar,
)
from .timing import (  # noqa: F401
    sync, Timing, time_op, copy_bandwidth_GBps, gather_bandwidth_GBps, step_peak_bytes,
)
from .results import (  # noqa: F401
    Measurement, cpu_model, device_name, device_slug, make_document, MergeError, rows_to_merge, validate_document,
    write_document, _key,
)
from .report import (  # noqa: F401
    speedups, target_report, format_table, plot_results,
)
from .run import (  # noqa: F401
    RunReport, _free_memory, _reset_compiler, run_benchmark,
)
from .cli import (  # noqa: F401
    add_subcommand, summarize, run_command,
)


