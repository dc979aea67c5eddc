"""Evaluation: how close a converted model is to its original (`mhla-convert eval`)."""

from .api import evaluate
from .errors import EvalError

__all__ = ["EvalError", "evaluate"]
