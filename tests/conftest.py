"""Shared fixtures. Every test runs offline: the hub client is put in offline mode, so any
accidental download fails at once instead of reaching the network."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter. It must be chosen before anything
# (diffusers, the kernels) imports triton, so set it here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def poisoned_kernel_buffers(monkeypatch):
    """Every buffer the Triton kernels write (`mhla_triton._new`, imported by the other kernel modules) starts as
    NaN, so an element a kernel leaves unwritten fails the comparison; buffers asked for as zeros stay zeros."""
    from mhla_convert.kernels import exact_blocks_triton, exact_triton, joint_triton, mhla_triton

    real = mhla_triton._new

    def nan_filled(*shape, device, dtype, zero=False):
        out = real(*shape, device=device, dtype=dtype, zero=zero)
        return out if zero else out.fill_(float("nan"))

    for module in (mhla_triton, exact_triton, exact_blocks_triton, joint_triton):
        monkeypatch.setattr(module, "_new", nan_filled)


@pytest.fixture
def tiny():
    """tiny("tiny-wan", torch_dtype=...) -> a fresh built-in tiny model with fixed random weights."""
    from mhla_convert.models import tiny_model

    return tiny_model


@pytest.fixture
def run_model():
    """run_model(model, inputs) -> the model's main output tensor, without autograd."""
    import torch

    def run(model, inputs):
        with torch.no_grad():
            out = model(**inputs)
        return out.sample if hasattr(out, "sample") else out.logits

    return run
