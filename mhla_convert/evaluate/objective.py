"""The training objective a family is scored on: the single place evaluation looks it up."""

from __future__ import annotations

from ..train.objectives import objective_for
from ..train.recipe import ObjectiveSpec


def training_objective(family: str, spec: ObjectiveSpec | None = None):
    """The family's own training objective (flow matching, ε-prediction or next-token)."""
    return objective_for(family, spec or ObjectiveSpec())
