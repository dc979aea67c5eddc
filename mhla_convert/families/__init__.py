"""One adapter module per model family; see base.py for the contract."""

from .base import (
    FamilyAdapter,
    UnsupportedModelError,
    adapter_for_config,
    adapter_for_family,
    adapter_for_model,
    families,
    register,
)

__all__ = [
    "FamilyAdapter", "UnsupportedModelError", "adapter_for_config", "adapter_for_family", "adapter_for_model",
    "families", "register",
]
