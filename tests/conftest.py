"""Test session setup.

Without a GPU, the Triton kernels run through Triton's interpreter: the
environment variable must be set before the kernels are first defined, i.e.
before anything imports posenc_fast.  With a GPU they run natively.

Inputs are drawn fresh each session from a seed printed in the header;
rerun a failure with POSENC_FAST_TEST_SEED=<seed>.

Slow cases (SLOW_CASES below, and tests decorated with @pytest.mark.slow) are deselected by the
default run (pyproject.toml: addopts -m 'not slow'); ``-m slow`` runs them, and .ci/run does.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SESSION_SEED = int(os.environ.get("POSENC_FAST_TEST_SEED", random.SystemRandom().randrange(1 << 31)))


# Test ids that take long on a 2-core CPU machine (measured with --durations), marked slow here so
# that the list is in one place: every part of each id must occur in the test's node id.  The
# code they exercise stays covered in the default run by the same cases on the native backends
# (CPU kernels, the CUDA kernels' host build) and the other cases through the interpreter.
SLOW_CASES = [
    (("long_sequence", "triton-interpreter"), "the longest case through Triton's interpreter: 5 to 40 s each"),
    (("hot_id_padding", "triton-interpreter"), "a hot-id case through the interpreter: 4 to 9 s each"),
    (("test_keep_rate_and_scale", "triton-interpreter"), "a large dropout sample through the interpreter: ~25 s"),
    (("test_train_tiny_lm_runs", "-triton]"), "a training run through the interpreter: ~20 s"),
    (("test_properties.py", "triton-interpreter"), "hypothesis examples through the interpreter: ~10 s"),
    (("test_weight_gradient_with_dropout", "triton-interpreter"), "dropout gradients through the interpreter: 1.5 to 9 s "
     "each, ~60 s in all"),
    (("test_per_sample_gradients_with_vmap", "triton-interpreter"), "vmap runs the interpreter once per sample: ~4 s "
     "each"),
    (("test_threads_share_one_module", "triton-interpreter"), "eight threads through the interpreter, whose launches "
     "are serialised: ~7 s"),
    (("test_jacfwd_equals_jacrev_and_hessian", "triton-interpreter"), "a full Jacobian and Hessian through the "
     "interpreter: 40 to 75 s"),
    (("test_sass_report.py",), "compiles every kernel variant to SASS: ~55 s"),
    (("test_triton_native_compile.py",), "native Triton compiles for sm_80/sm_90: ~70 s"),
    (("test_cuda_build.py::test_kernels_compile_without_spills",), "an nvcc build for ptxas' report: ~70 s"),
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        for parts, why in SLOW_CASES:
            if all(part in item.nodeid for part in parts):
                item.add_marker(pytest.mark.slow(reason=why))
                break


def pytest_report_header(config):
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (Triton interpreter on CPU)"
    return [f"posenc_fast: seed POSENC_FAST_TEST_SEED={SESSION_SEED}; device: {device}; torch {torch.__version__}"]


@pytest.fixture(autouse=True)
def poison_kernel_outputs():
    """Every buffer a kernel is meant to fill starts as NaN, so an unwritten element fails the comparison."""
    from posenc_fast import backends

    backends.POISON_OUTPUTS = True
    yield
    backends.POISON_OUTPUTS = False


@pytest.fixture
def seed(request):
    """A per-test seed derived from the session seed and the test id."""
    return (SESSION_SEED * 1000003 + sum(map(ord, request.node.nodeid))) % (1 << 31)
