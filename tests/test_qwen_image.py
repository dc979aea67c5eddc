"""Qwen-Image's joint attention: a converted layer keeps the host's two streams' projections, q/k norms, per-stream
RoPE and text padding mask exactly (checked where MHLA reduces to the host's softmax), and refuses token layouts it
cannot place on one grid."""

from __future__ import annotations

import copy

import pytest
import torch

import mhla_convert
from mhla_convert.families import adapter_for_family


def test_image_rows_equal_the_host_where_every_image_block_is_exact(tiny):
    """With every block in the exact region (the init), an image query's row is the host's softmax row over the
    unpadded text and the image: image outputs equal the original layers' on the very inputs they got, the second
    sample's padded text included; padding is read by no query."""
    model, adapter = tiny("tiny-qwen-image"), adapter_for_family("qwen-image")
    original = copy.deepcopy(model)
    mhla_convert.convert(model, ratio=1.0, blocks=(2, 3), exact_radius=8)
    calls = {}
    for i, layer in enumerate(adapter.attention_modules(model)):
        layer.register_forward_hook(lambda m, a, kw, out, i=i: calls.__setitem__(i, (a, kw, out)), with_kwargs=True)
    torch.manual_seed(0)
    inputs = adapter.example_inputs(model, (5, 7), 2)
    assert not inputs["encoder_hidden_states_mask"].all()
    with torch.no_grad():
        model(**inputs)
        for i, host in enumerate(adapter.attention_modules(original)):
            args, kwargs, (image, text) = calls[i]
            ref_image, ref_text = host(*args, **kwargs)
            torch.testing.assert_close(image, ref_image, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(text, ref_text)  # text queries read the image by summaries
            # the padded text keys are read by no query: changing them changes nothing
            padded = dict(kwargs, encoder_hidden_states=kwargs["encoder_hidden_states"].clone())
            padded["encoder_hidden_states"][~kwargs["encoder_hidden_states_mask"]] = 7.0
            torch.testing.assert_close(calls[i][2][0], adapter.attention_modules(model)[i](*args, **padded)[0])
    assert len(calls) == len(model.transformer_blocks)


def test_mixing_has_a_text_block_and_img_shapes_off_the_tokens_are_refused(tiny):
    model, adapter = tiny("tiny-qwen-image"), adapter_for_family("qwen-image")
    mhla_convert.convert(model, ratio=1.0)
    layer = mhla_convert.mhla_layers(model)[0][1]
    assert layer.mixing.shape == (65, 65) and torch.equal(layer.mixing[:-1, -1], torch.ones(64))
    inputs = adapter.example_inputs(model, (4, 5), 1)
    inputs["img_shapes"] = [[(1, 4, 5), (1, 2, 2)]]  # an edit model's reference image after the target
    with pytest.raises(ValueError, match="one \\(1, H, W\\) image"):
        model(**inputs)
    inputs["img_shapes"] = [[(1, 4, 4)]]  # 16 of the 20 image tokens
    with pytest.raises(ValueError, match="got 20 tokens but the model's last forward captured grid \\(4, 4\\)"):
        model(**inputs)
