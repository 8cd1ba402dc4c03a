"""Setup of the pytest-benchmark suite in bench/ (kept apart from tests/: ``python -m pytest tests``
never collects it).

Makes the source checkout importable for a plain ``pytest bench/`` when posenc_fast is not
installed, and keeps Triton in its interpreter on machines without a GPU (as tests/conftest.py
does), before anything imports posenc_fast.
"""

import importlib.util
import os
import sys

import torch

if importlib.util.find_spec("posenc_fast") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return [f"posenc_fast bench: {device}; torch {torch.__version__}; posenc_fast timed with the id range check off"]
