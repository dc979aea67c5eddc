"""FLUX.1's joint attention: a converted layer keeps the host's projections, q/k norms, text-first concat and RoPE
exactly (checked where MHLA reduces to the host's softmax), and refuses token layouts it cannot place on a grid."""

from __future__ import annotations

import copy

import pytest
import torch

import mhla_convert
from mhla_convert.families import adapter_for_family


def test_image_rows_equal_the_host_where_every_image_block_is_exact(tiny):
    """With every block in the exact region (weight 1 on all image blocks and the text, the init), an image query's
    row is the host's softmax row: image outputs equal the original layers' on the very inputs they got."""
    model, adapter = tiny("tiny-flux"), adapter_for_family("flux")
    original = copy.deepcopy(model)
    mhla_convert.convert(model, ratio=1.0, blocks=(2, 3), exact_radius=8)
    calls = {}
    for i, layer in enumerate(adapter.attention_modules(model)):
        layer.register_forward_hook(lambda m, a, kw, out, i=i: calls.__setitem__(i, (a, kw, out)), with_kwargs=True)
    torch.manual_seed(0)
    inputs = adapter.example_inputs(model, (5, 7), 2)
    text = inputs["encoder_hidden_states"].shape[1]
    with torch.no_grad():
        model(**inputs)
        for i, host in enumerate(adapter.attention_modules(original)):
            args, kwargs, out = calls[i]
            ref = host(*args, **kwargs)
            if isinstance(out, tuple):  # dual-stream: (image, text) outputs
                torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
            else:  # single-stream: text-first concatenation
                torch.testing.assert_close(out[:, text:], ref[:, text:], rtol=1e-5, atol=1e-5)
                assert not torch.allclose(out[:, :text], ref[:, :text])  # text queries read the image by summaries
    assert len(calls) == 6 and any(isinstance(c[2], tuple) for c in calls.values())


def test_mixing_has_a_text_block_and_an_off_grid_layout_is_refused(tiny):
    model, adapter = tiny("tiny-flux"), adapter_for_family("flux")
    mhla_convert.convert(model, ratio=1.0)
    layer = mhla_convert.mhla_layers(model)[0][1]
    assert layer.mixing.shape == (65, 65) and torch.equal(layer.mixing[:-1, -1], torch.ones(64))
    inputs = adapter.example_inputs(model, (4, 5), 1)
    inputs["img_ids"] = inputs["img_ids"].flip(0)
    with pytest.raises(ValueError, match="row-major token grid"):
        model(**inputs)
