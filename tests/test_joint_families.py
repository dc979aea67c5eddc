"""The MM-DiT families' joint attention (FLUX.1, Qwen-Image, HunyuanVideo): a converted layer keeps the host's
projections, q/k norms, RoPE, text-first order and text padding mask exactly (checked where MHLA reduces to the
host's softmax: every image block in the exact region), its mixing has a text block, and it refuses token layouts
it cannot place on one grid."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import mhla_convert
from mhla_convert.families import adapter_for_family

# tiny model -> family, blocks, token grid of the example inputs
CASES = {
    "tiny-flux": ("flux", (2, 3), (5, 7)),
    "tiny-qwen-image": ("qwen-image", (2, 3), (5, 7)),
    "tiny-hunyuanvideo": ("hunyuanvideo", (2, 2, 3), (3, 4, 5)),
}


def _exact_everywhere(tiny, name):
    """The tiny model converted with every image block exact, its original, and each layer's (args, kwargs, output)
    on a batch of 2 (later samples' text padded where the family pads)."""
    family, blocks, grid = CASES[name]
    model, adapter = tiny(name), adapter_for_family(family)
    original = copy.deepcopy(model)
    mhla_convert.convert(model, ratio=1.0, blocks=blocks, exact_radius=8)
    calls = {}
    for i, layer in enumerate(adapter.attention_modules(model)):
        layer.register_forward_hook(lambda m, a, kw, out, i=i: calls.__setitem__(i, (a, kw, out)), with_kwargs=True)
    torch.manual_seed(0)
    inputs = adapter.example_inputs(model, grid, 2)
    with torch.no_grad():
        model(**inputs)
    return model, adapter, original, calls, inputs


def _image_and_text(out, text: int):
    """(image, text) outputs: dual-stream layers return both, FLUX's single-stream ones the text-first concat."""
    return out if isinstance(out, tuple) else (out[:, text:], out[:, :text])


@pytest.mark.parametrize("name", CASES)
def test_image_rows_equal_the_host_where_every_image_block_is_exact(tiny, name):
    """An image query's row is then the host's softmax row over the unpadded text and the image: image outputs equal
    the original layers' on the very inputs they got; text queries read the image by summaries, so theirs differ."""
    model, adapter, original, calls, inputs = _exact_everywhere(tiny, name)
    text = inputs["encoder_hidden_states"].shape[1]
    with torch.no_grad():
        for i, host in enumerate(adapter.attention_modules(original)):
            args, kwargs, out = calls[i]
            (image, text_out), (ref_image, ref_text) = (_image_and_text(o, text) for o in (out, host(*args, **kwargs)))
            torch.testing.assert_close(image, ref_image, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(text_out, ref_text)
    assert len(calls) == len(adapter.attention_modules(model)) > 0


def test_qwen_image_padded_text_is_read_by_no_query(tiny):
    model, adapter, _, calls, inputs = _exact_everywhere(tiny, "tiny-qwen-image")
    assert not inputs["encoder_hidden_states_mask"].all()
    with torch.no_grad():
        for i, layer in enumerate(adapter.attention_modules(model)):
            args, kwargs, (image, _) = calls[i]
            padded = dict(kwargs, encoder_hidden_states=kwargs["encoder_hidden_states"].clone())
            padded["encoder_hidden_states"][~kwargs["encoder_hidden_states_mask"]] = 7.0
            torch.testing.assert_close(image, layer(*args, **padded)[0])


def test_hunyuanvideo_drops_the_padding_and_keeps_its_refiner(tiny):
    model, adapter, _, calls, inputs = _exact_everywhere(tiny, "tiny-hunyuanvideo")
    assert not inputs["encoder_attention_mask"].all()
    assert not mhla_convert.mhla_layers(model.context_embedder)  # the text's own refiner stays softmax
    with torch.no_grad():
        for i, layer in enumerate(adapter.attention_modules(model)):
            args, kwargs, (video, _) = calls[i]
            unmasked = {**kwargs, "attention_mask": torch.ones_like(kwargs["attention_mask"])}
            assert not torch.allclose(layer(*args, **unmasked)[0][1], video[1])


def _mixing_with_a_text_block(tiny, name):
    model, adapter = tiny(name), adapter_for_family(CASES[name][0])
    mhla_convert.convert(model, ratio=1.0)
    layer = mhla_convert.mhla_layers(model)[0][1]
    m = layer.mixing.shape[-1] - 1
    assert torch.equal(layer.mixing[:-1, -1], torch.ones(m))  # every image query reads the text at weight 1
    return model, adapter, layer, m


def test_flux_refuses_an_off_grid_layout(tiny):
    model, adapter, _, m = _mixing_with_a_text_block(tiny, "tiny-flux")
    assert m == 64
    inputs = adapter.example_inputs(model, (4, 5), 1)
    inputs["img_ids"] = inputs["img_ids"].flip(0)
    with pytest.raises(ValueError, match="row-major token grid"):
        model(**inputs)


def test_qwen_image_refuses_img_shapes_off_the_tokens(tiny):
    model, adapter, _, m = _mixing_with_a_text_block(tiny, "tiny-qwen-image")
    assert m == 64
    inputs = adapter.example_inputs(model, (4, 5), 1)
    inputs["img_shapes"] = [[(1, 4, 5), (1, 2, 2)]]  # an edit model's reference image after the target
    with pytest.raises(ValueError, match="one \\(1, H, W\\) image"):
        model(**inputs)
    inputs["img_shapes"] = [[(1, 4, 4)]]  # 16 of the 20 image tokens
    with pytest.raises(ValueError, match="got 20 tokens but the model's last forward captured grid \\(4, 4\\)"):
        model(**inputs)


def test_hunyuanvideo_refuses_a_foreign_mask(tiny):
    model, adapter, layer, m = _mixing_with_a_text_block(tiny, "tiny-hunyuanvideo")
    assert m == 11 * 5 * 5
    model(**adapter.example_inputs(model, (2, 3, 3), 1))  # captures the grid
    video, text = torch.randn(1, 18, 16), torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match=r"\(B, 1, 1, 22\) bool key mask"):
        layer(video, text, attention_mask=torch.zeros(1, 1, 22, 22))


def test_the_tiny_hunyuanvideo_pipeline_encodes_each_caption_with_its_padding_mask(tiny):
    """Folder data is encoded by the pipeline's own encode_prompt; the tiny character-level Llama reads the bare
    caption (the default template would crop it away), padded to the prompt length with its mask."""
    from mhla_convert.train.components import pipeline

    model, adapter = tiny("tiny-hunyuanvideo"), adapter_for_family("hunyuanvideo")
    pipe = pipeline("hunyuanvideo", model, "tiny-hunyuanvideo")
    columns = adapter.encode_text(pipe, ["a red cube", "a blue ball on green grass"], 16)
    assert columns["prompt_embeds"].shape == (2, 16, 16) and columns["pooled_prompt_embeds"].shape == (2, 12)
    assert columns["prompt_attention_mask"].sum(1).tolist() == [10, 16]
    assert not torch.allclose(columns["prompt_embeds"][0, 2:10], columns["prompt_embeds"][1, 2:10])


@pytest.mark.parametrize("name", CASES)
def test_an_attention_with_another_processor_is_refused_before_anything_changes(tiny, name):
    """A processor other than the family's (an IP-Adapter's, a user's) computes something the joint MHLA layer would
    not reproduce: conversion names the layer, its processor and the one it takes, and leaves the model as it was."""
    family, blocks, _ = CASES[name]
    model, adapter = tiny(name), adapter_for_family(family)

    class OtherProcessor:
        pass

    last = adapter.attention_modules(model)[-1]  # the layers before it would convert
    expected = type(last.processor).__name__
    last.processor = OtherProcessor()
    with pytest.raises(mhla_convert.families.base.UnsupportedModelError,
                       match=f"uses OtherProcessor; an MHLA layer reproduces {expected} only"):
        mhla_convert.convert(model, ratio=1.0, blocks=blocks)
    assert not mhla_convert.mhla_layers(model)


@pytest.mark.parametrize("name", CASES)
def test_text_through_its_summary_converts_and_reloads(tiny, run_model, tmp_path, name):
    """text_exact=False (the design the default is measured against) changes what every query reads of the text,
    keeps the (M + 1, M + 1) mixing, and reloads bitwise."""
    family, blocks, grid = CASES[name]
    exact, summary = tiny(name), tiny(name)
    mhla_convert.convert(exact, ratio=1.0, blocks=blocks)
    mhla_convert.convert(summary, ratio=1.0, blocks=blocks, text_exact=False)
    layers = [layer for _, layer in mhla_convert.mhla_layers(summary)]
    assert layers and all(not layer.config.text_exact and layer.mixing.shape[-1] == math.prod(blocks) + 1
                          for layer in layers)
    torch.manual_seed(0)
    inputs = adapter_for_family(family).example_inputs(summary, grid, 2)
    out = run_model(summary, inputs)
    assert torch.isfinite(out).all() and not torch.allclose(out, run_model(exact, inputs))
    reloaded = mhla_convert.from_pretrained(mhla_convert.save_pretrained(summary, tmp_path / "ckpt"))
    assert torch.equal(run_model(reloaded, inputs), out)
