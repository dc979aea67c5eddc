"""The training objective a family is scored on: the single place evaluation looks it up."""

from __future__ import annotations

from ..families import adapter_for_family
from ..train.recipe import ObjectiveSpec


def training_objective(family: str, spec: ObjectiveSpec | None = None):
    """The family's own training objective (flow matching, ε-prediction or next-token)."""
    return adapter_for_family(family).objective(spec or ObjectiveSpec())
