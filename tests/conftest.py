"""Test session setup.

Without a GPU, the Triton kernels run through Triton's interpreter: the
environment variable must be set before the kernels are first defined, i.e.
before anything imports posenc_fast.  With a GPU they run natively.

Inputs are drawn fresh each session from a seed printed in the header;
rerun a failure with POSENC_FAST_TEST_SEED=<seed>.

Slow tests carry ``pytest.mark.slow(reason=why)`` where they are defined: a whole file by its
``pytestmark``, a test by its decorator, one parametrization (the triton-interpreter target, a case on
it) by ``pytest.param(..., marks=...)``, mostly through ``cases.targets(slow_on_interpreter=why)`` and
``cases.cases_on_targets``.  Slow means long on a 2-core CPU machine (measured with --durations).  What
a test slow only through the interpreter covers stays covered in the default run by the same cases on
the native backends (CPU kernels, the CUDA kernels' host build) and the other cases through the
interpreter.  The default run deselects slow tests (pyproject.toml: addopts -m 'not slow'); ``-m slow``
runs them.  Those slow only through the interpreter are marked ``interpreter`` too: .ci/run runs
``-m "slow and not interpreter"``, and a GPU run covers them natively.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SESSION_SEED = int(os.environ.get("POSENC_FAST_TEST_SEED", random.SystemRandom().randrange(1 << 31)))


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
