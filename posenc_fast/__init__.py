"""posenc_fast: fused token embedding + sinusoidal positional encoding (add or concat).

    from posenc_fast import sinusoidal_embedding, SinusoidalEmbedding

``posenc_fast.reference`` is the pure-PyTorch definition every backend is tested against.
"""

from . import presets, reference
from .config import id_check, id_check_enabled, set_id_check
from .functional import sinusoidal_embedding
from .module import SinusoidalEmbedding
from .positions import make_positions, packed_positions

__version__ = "0.1.0"

__all__ = [
    "sinusoidal_embedding",
    "SinusoidalEmbedding",
    "reference",
    "presets",
    "make_positions",
    "packed_positions",
    "set_id_check",
    "id_check",
    "id_check_enabled",
    "__version__",
]
