"""``python -m posenc_fast bench``: time the fused layer against eager PyTorch and torch.compile.

One module per concern (``cases``, ``impls``, ``timing``, ``results``, ``report``, ``run``, ``cli``: each
docstring says what it owns); their public names are re-exported here.  How to run it and read its output:
bench/README.md; what each implementation and op times: docs/performance.md.
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


