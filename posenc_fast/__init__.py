"""posenc_fast: fused token embedding + sinusoidal positional encoding (add or concat).

    from posenc_fast import sinusoidal_embedding, SinusoidalEmbedding

``posenc_fast.reference`` is the pure-PyTorch definition every backend is tested against.  The package's
layers, and the path of one call: docs/architecture.md.
"""

from . import presets, reference
from .config import id_check, id_check_enabled, set_id_check
from .functional import add_sinusoidal, sinusoidal_embedding
from .module import SinusoidalEmbedding, SinusoidalPositionalEncoding
from .positions import make_positions, packed_positions


def patch_model(model, *, ignore_table_values: bool = False):
    """Make a Hugging Face transformers model compute its sinusoidal PE with posenc_fast, in place; returns ``model``.

    See :func:`posenc_fast.integrations.transformers.patch_model` (imported on first use, so
    posenc_fast does not import transformers).
    """
    from .integrations.transformers import patch_model as _patch_model

    return _patch_model(model, ignore_table_values=ignore_table_values)


__version__ = "0.1.0"

__all__ = [
    "sinusoidal_embedding",
    "SinusoidalEmbedding",
    "add_sinusoidal",
    "SinusoidalPositionalEncoding",
    "patch_model",
    "reference",
    "presets",
    "make_positions",
    "packed_positions",
    "set_id_check",
    "id_check",
    "id_check_enabled",
    "__version__",
]
