"""Runtime switches: the host-side id range check, ``check_ids``.

Before a forward launch the ids are range-checked (one reduction and one device-to-host copy on GPU), so
that an out-of-range id raises ``IndexError`` naming it; the switch also covers the ``cu_seqlens`` check.
With it off the kernels still mask every access (docs/design.md, "torch integration").  Off:
``posenc_fast.set_id_check(False)``, the ``id_check(False)`` context manager, or ``POSENC_FAST_CHECK_IDS=0``.
The switch is process-wide, not per thread: threads that toggle it concurrently can see each other's setting.
"""

from __future__ import annotations

import contextlib
import os

# A module global, not state behind the functions: a prepared launch reads it directly on every launch.
check_ids = os.environ.get("POSENC_FAST_CHECK_IDS", "1") != "0"


def id_check_enabled() -> bool:
    return check_ids


def set_id_check(enabled: bool) -> None:
    """Turn the host-side id range check on or off (process-wide)."""
    global check_ids
    check_ids = bool(enabled)


@contextlib.contextmanager
def id_check(enabled: bool):
    """Context manager form of :func:`set_id_check`."""
    global check_ids
    previous, check_ids = check_ids, bool(enabled)
    try:
        yield
    finally:
        check_ids = previous
