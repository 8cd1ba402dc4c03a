"""Explore: answers to common questions about sinusoidal positional encodings, in plots and numbers.

* ``geometry``   - R(k) with PE(t+k) = R(k) PE(t), <PE(t), PE(t+k)> against k, PE vs token norms;
* ``subspace``   - principal angles between token and PE subspaces, nearest-token recovery;
* ``experiment`` - the add-vs-concat training experiment (no PE / normalised index / add / concat);
* ``plots``      - the PNG figures (matplotlib, optional: ``pip install 'posenc_fast[plot]'``);
* ``cli``        - the ``plot`` and ``experiment`` commands of ``python -m posenc_fast``.

Importing this package never imports matplotlib; see docs/explore.md for the findings.
"""

from .geometry import dot_by_offset, dot_closed_form, norm_comparison, offset_rotation, rotation_error
from .subspace import dominant_subspace, nearest_token_recovery, orthonormal_basis, principal_angles, subspace_overlap

__all__ = [
    "dot_by_offset",
    "dot_closed_form",
    "norm_comparison",
    "offset_rotation",
    "rotation_error",
    "dominant_subspace",
    "nearest_token_recovery",
    "orthonormal_basis",
    "principal_angles",
    "subspace_overlap",
]
