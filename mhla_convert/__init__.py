"""mhla-convert: turn pretrained attention into Multi-Head Linear Attention (MHLA)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mhla-convert")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"

from .convert import ConversionReport, convert
from .evaluate import evaluate
from .hub import push_to_hub
from .io import from_pretrained, save_pretrained
from .layer import MHLAConfig, MHLAttention, mhla_layers
from .mixing import (
    clamp_mixing_,
    initial_mixing,
    locality_mixing,
    relative_causal_mixing,
    toeplitz_causal_mixing,
    uniform_mixing,
)
from .models import load_model, tiny_model
from .ops import mhla_attention

# Registers the converted LM classes with transformers' Auto classes and defines the converted diffusers
# transformer classes saved pipelines name: importing mhla_convert is what lets the libraries reload them.
from . import diffusers_models, transformers_models  # noqa: E402,F401  isort: skip

__all__ = [
    "ConversionReport", "MHLAConfig", "MHLAttention", "__version__", "clamp_mixing_", "convert", "evaluate",
    "from_pretrained", "initial_mixing", "load_model", "locality_mixing", "mhla_attention", "mhla_layers",
    "push_to_hub", "relative_causal_mixing", "save_pretrained", "tiny_model", "toeplitz_causal_mixing",
    "uniform_mixing",
]
