"""HunyuanVideo's joint attention: a converted layer keeps the host's projections, q/k norms, RoPE on the video tokens
and the padded text's mask exactly (checked where MHLA reduces to the host's softmax); the token refiner stays."""

from __future__ import annotations

import copy

import pytest
import torch

import mhla_convert
from mhla_convert.families import adapter_for_family


def test_video_rows_equal_the_host_where_every_block_is_exact(tiny):
    """With every video block in the exact region (the init: weight 1 on all of them and on the text), a video query's
    row is the host's softmax row over the unpadded tokens: video outputs equal the original layers' on the very
    inputs they got, in both block kinds, with the second example's text padded."""
    model, adapter = tiny("tiny-hunyuanvideo"), adapter_for_family("hunyuanvideo")
    original = copy.deepcopy(model)
    report = mhla_convert.convert(model, ratio=1.0, blocks=(2, 2, 3), exact_radius=8)
    assert report.converted == [0, 1, 2, 3]
    assert not mhla_convert.mhla_layers(model.context_embedder)  # the text's own refiner stays softmax
    calls = {}
    for i, layer in enumerate(adapter.attention_modules(model)):
        layer.register_forward_hook(lambda m, a, kw, out, i=i: calls.__setitem__(i, (a, kw, out)), with_kwargs=True)
    torch.manual_seed(0)
    inputs = adapter.example_inputs(model, (3, 4, 5), 2)
    assert not inputs["encoder_attention_mask"].all()
    with torch.no_grad():
        model(**inputs)
        for i, host in enumerate(adapter.attention_modules(original)):
            args, kwargs, (video, text) = calls[i]
            ref = host(*args, **kwargs)
            torch.testing.assert_close(video, ref[0], rtol=1e-5, atol=1e-5)
            assert not torch.allclose(text, ref[1])  # text queries read the video through the summaries
            unmasked = {**kwargs, "attention_mask": torch.ones_like(kwargs["attention_mask"])}
            layer = adapter.attention_modules(model)[i]
            assert not torch.allclose(layer(*args, **unmasked)[0][1], video[1])  # the padding is dropped
    assert len(calls) == 4


def test_mixing_has_a_text_block_and_a_foreign_mask_is_refused(tiny):
    model, adapter = tiny("tiny-hunyuanvideo"), adapter_for_family("hunyuanvideo")
    mhla_convert.convert(model, ratio=1.0)
    layer = mhla_convert.mhla_layers(model)[0][1]
    m = 11 * 5 * 5
    assert layer.mixing.shape == (m + 1, m + 1) and torch.equal(layer.mixing[:-1, -1], torch.ones(m))
    model(**adapter.example_inputs(model, (2, 3, 3), 1))  # captures the grid
    video, text = torch.randn(1, 18, 16), torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match=r"\(B, 1, 1, 22\) bool key mask"):
        layer(video, text, attention_mask=torch.zeros(1, 1, 22, 22))


def test_the_tiny_pipeline_encodes_each_caption_with_its_padding_mask(tiny):
    """Folder data is encoded by the pipeline's own encode_prompt; the tiny character-level Llama reads the bare
    caption (the default template would crop it away), padded to the prompt length with its mask."""
    from mhla_convert.train.components import pipeline

    model, adapter = tiny("tiny-hunyuanvideo"), adapter_for_family("hunyuanvideo")
    pipe = pipeline("hunyuanvideo", model, "tiny-hunyuanvideo")
    columns = adapter.encode_text(pipe, ["a red cube", "a blue ball on green grass"], 16)
    assert columns["prompt_embeds"].shape == (2, 16, 16) and columns["pooled_prompt_embeds"].shape == (2, 12)
    assert columns["prompt_attention_mask"].sum(1).tolist() == [10, 16]
    assert not torch.allclose(columns["prompt_embeds"][0, 2:10], columns["prompt_embeds"][1, 2:10])
