"""``python -m posenc_fast <command>``; see ``posenc_fast.cli``."""

import sys

from .cli import main

sys.exit(main())
