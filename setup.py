"""Build and install posenc_fast.

``pip install .`` works on any machine with Python and torch (the Triton kernels
are plain Python; Triton itself comes with torch's CUDA wheels, or via the
``[triton]`` extra).
"""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


setup(
    name="posenc_fast",
    version="0.1.0",
    description="Fused token embedding + sinusoidal positional encoding kernels (Triton, PyTorch)",
    long_description=read("README.md"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["posenc_fast", "posenc_fast.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    extras_require={
        "triton": ["triton>=3.0"],
        "plot": ["matplotlib"],
        "test": ["pytest", "pytest-benchmark", "matplotlib"],
    },
    entry_points={"console_scripts": ["posenc-fast=posenc_fast.cli:main"]},
    license="BSD-3-Clause",
)
