"""The training objective a family is scored on: the single place evaluation looks it up."""

from __future__ import annotations

from ..families import FamilyAdapter
from ..train.recipe import ObjectiveSpec


def training_objective(adapter: FamilyAdapter, spec: ObjectiveSpec | None = None):
    """The family's own training objective (flow matching, ε-prediction or next-token)."""
    return adapter.objective(spec or ObjectiveSpec())
