"""mhla-convert: turn pretrained attention into Multi-Head Linear Attention (MHLA)."""

from importlib.metadata import PackageNotFoundError, version

from .layer import MHLAConfig, MHLAttention, mhla_layers
from .mixing import clamp_mixing_, initial_mixing, locality_mixing, relative_causal_mixing, toeplitz_causal_mixing, uniform_mixing
from .ops import mhla_attention

try:
    __version__ = version("mhla-convert")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"

__all__ = [
    "MHLAConfig", "MHLAttention", "__version__", "clamp_mixing_", "initial_mixing", "locality_mixing",
    "mhla_attention", "mhla_layers", "relative_causal_mixing", "toeplitz_causal_mixing", "uniform_mixing",
]
