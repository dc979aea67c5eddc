"""attention="linear": plain linear attention (M = 1), the baseline MHLA is compared with."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import mhla_convert
from mhla_convert.families import adapter_for_model


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def plain_linear_attention(q, k, v, *, causal, eps=1e-6):
    """out_t = φ(q_t)·Σ_s φ(k_s)ᵀ v_s / (φ(q_t)·Σ_s φ(k_s) + eps), s over all tokens or s ≤ t; φ = relu,
    q scaled by 1/√d; (B, N, H, D) tensors, key/value heads repeated for grouped queries."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    fq, fk = F.relu(q) * q.shape[-1] ** -0.5, F.relu(k)
    kv, z = torch.einsum("bshd,bshe->bshde", fk, v), fk
    if causal:
        kv, z = kv.cumsum(1), z.cumsum(1)
        num, den = torch.einsum("bthd,bthde->bthe", fq, kv), torch.einsum("bthd,bthd->bth", fq, z)
    else:
        num, den = torch.einsum("bthd,bhde->bthe", fq, kv.sum(1)), torch.einsum("bthd,bhd->bth", fq, z.sum(1))
    return num / (den[..., None] + eps)


def capture(layer):
    """Record the hidden states, RoPE tables and output of `layer`'s next call."""
    seen = {}

    def hook(module, args, kwargs, output):
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["rope"] = kwargs.get("position_embeddings")
        seen["out"] = output[0] if isinstance(output, tuple) else output

    return seen, layer.register_forward_hook(hook, with_kwargs=True)


def lm_direct(attn, x, rope):
    cos, sin = (t.unsqueeze(2) for t in rope)
    q, k, v = (proj(x).unflatten(-1, (-1, attn.head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    return attn.to_out(plain_linear_attention(q, k, v, causal=True).flatten(-2))


def dit_direct(attn, x, rope):
    q, k, v = (proj(x).unflatten(-1, (-1, attn.head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    return attn.to_out(plain_linear_attention(q, k, v, causal=False).flatten(-2))


CASES = {
    # chunk 8 on 40 tokens: five chunks, so MHLA's window differs from linear attention's single weight
    "tiny-llama": (lambda m: m.model.layers[1].self_attn, lm_direct, {"chunk_size": 8}),
    "tiny-dit": (lambda m: m.transformer_blocks[1].attn1, dit_direct, {}),
}


def inputs_for(model):
    torch.manual_seed(0)
    if adapter_for_model(model).causal:
        return {"input_ids": torch.randint(0, 128, (2, 40))}
    return adapter_for_model(model).example_inputs(model, batch_size=2)


def main_output(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.sample


@pytest.mark.parametrize("name", list(CASES))
def test_linear_conversion_is_plain_linear_attention(tiny, name):
    layer_of, direct, options = CASES[name]
    model = tiny(name).eval()
    report = mhla_convert.convert(model, attention="linear", **options)
    assert report.attention == "linear" and model.mhla_plan["attention"] == "linear"
    attn = layer_of(model)
    assert attn.mixing.numel() == 1
    seen, handle = capture(attn)
    inputs = inputs_for(model)
    linear_out = main_output(model, inputs)
    handle.remove()
    with torch.no_grad():
        expected = direct(attn, seen["x"], seen["rope"])
    torch.testing.assert_close(seen["out"], expected, rtol=1e-4, atol=1e-5)

    mhla = tiny(name).eval()
    mhla_convert.convert(mhla, **options)
    assert not torch.allclose(main_output(mhla, inputs), linear_out, atol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_linear_conversion_reloads_as_saved(tiny, name, tmp_path):
    model = tiny(name).eval()
    mhla_convert.convert(model, ratio=0.5, attention="linear", **CASES[name][2])
    mhla_convert.save_pretrained(model, tmp_path / "linear")
    assert json.loads((tmp_path / "linear" / "mhla_config.json").read_text())["plan"]["attention"] == "linear"
    reloaded = mhla_convert.from_pretrained(tmp_path / "linear")
    assert reloaded.mhla_plan["attention"] == "linear"
    inputs = inputs_for(model)
    assert torch.equal(main_output(reloaded, inputs), main_output(model, inputs))


def test_contradicting_options_are_refused(tiny):
    with pytest.raises(ValueError, match="one block"):
        mhla_convert.convert(tiny("tiny-dit"), attention="linear", blocks="4x4")
    with pytest.raises(ValueError, match="window 1"):
        mhla_convert.convert(tiny("tiny-llama"), attention="linear", window=4)
    with pytest.raises(ValueError, match="attention must be one of"):
        mhla_convert.convert(tiny("tiny-llama"), attention="softmax")


def test_linear_from_a_recipe():
    from mhla_convert.train import parse_recipe
    from mhla_convert.train.build import build_model

    recipe = parse_recipe("model: {name: tiny-dit}\nconversion: {attention: linear}\ndata: {kind: synthetic}\n"
                          "stages: [{name: finetune, steps: 1}]\n", "r.yaml")
    built = build_model(recipe, teachers=False)
    assert built.model.mhla_plan["attention"] == "linear" and built.model.mhla_plan["mhla_config"]["blocks"] == [1, 1]


def test_linear_from_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from mhla_convert.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["tiny-dit", "--attention", "linear", "--ratio", "0.5", "--out", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert "-> linear" in result.output
    assert json.loads((tmp_path / "d" / "mhla_config.json").read_text())["mhla"]["blocks"] == [1, 1]
    refused = runner.invoke(app, ["tiny-dit", "--attention", "linear", "--blocks", "4x4", "--out", str(tmp_path / "e")])
    assert refused.exit_code == 2 and "one block" in refused.output
