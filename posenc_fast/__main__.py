"""``python -m posenc_fast <command>``; see ``posenc_fast.cli``."""

import os
import sys

import torch

# Without a GPU, let the Triton backend run through Triton's interpreter (it must be
# decided before the kernels are defined, i.e. before posenc_fast is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .cli import main  # noqa: E402

sys.exit(main())
