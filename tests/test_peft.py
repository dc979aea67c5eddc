"""Converted models with PEFT: default LoRA targets find converted layers, old checkpoints (MHLA
names) still load, adapters a `merge: false` run saves load with PeftModel, AutoPeftModelForCausalLM,
diffusers' LoRA loaders and `sample --adapter` to exactly the model a `merge: true` run saves (or the
trained one), and a foreign adapter, or one trained on another model of the same shapes, is refused in
one line unless forced."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import mhla_convert
from mhla_convert.cli import app
from mhla_convert.train import TrainError, parse_recipe
from mhla_convert.train.lora import add_lora, load_adapter, save_adapter
from mhla_convert.train.recipe import LoraSpec
from mhla_convert.train.trainer import train

QUIET = dict(log=lambda *_: None)


def _converted_llama(ratio: float):
    model = mhla_convert.tiny_model("tiny-qwen3")
    mhla_convert.convert(model, ratio=ratio, progress=False)
    return model


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_default_lora_targets_reach_converted_layers(ratio):
    from peft import LoraConfig, get_peft_model

    model = _converted_llama(ratio)
    converted = model.mhla_plan["layers"]
    peft_model = get_peft_model(model, LoraConfig(r=2))  # no target_modules: PEFT's default for the model type
    wrapped = {n.split(".self_attn.")[0].split(".")[-1] + "." + n.rsplit(".", 1)[1]
               for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and ".self_attn." in n}
    assert wrapped == {f"{i}.{p}" for i in range(4) for p in ("q_proj", "v_proj")}
    layers = mhla_convert.mhla_layers(peft_model)
    assert [int(n.split(".layers.")[1].split(".")[0]) for n, _ in layers] == converted
    assert all(hasattr(layer.to_q, "lora_A") and hasattr(layer.to_v, "lora_A") for _, layer in layers)


def test_converted_llama_keeps_the_hosts_keys_and_loads_old_names(tmp_path):
    model = _converted_llama(1.0)
    keys = set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.0.self_attn.q_norm.weight" in keys
    assert not any(".to_q." in k or ".norm_q." in k for k in keys)
    ids = torch.randint(0, 128, (2, 40))
    expected = model(input_ids=ids).logits
    saved = mhla_convert.save_pretrained(model, tmp_path / "ckpt")
    old_names = {".q_proj.": ".to_q.", ".k_proj.": ".to_k.", ".v_proj.": ".to_v.", ".o_proj.": ".to_out.",
                 ".q_norm.": ".norm_q.", ".k_norm.": ".norm_k."}
    for f in saved.glob("*.safetensors"):  # rewrite as a checkpoint of the MHLA-named layers
        state = load_file(str(f))
        renamed = {}
        for key, value in state.items():
            for new, old in old_names.items():
                key = key.replace(new, old) if ".self_attn." in key else key
            renamed[key] = value
        assert renamed.keys() != state.keys()
        save_file(renamed, str(f), metadata={"format": "pt"})
    reloaded = mhla_convert.from_pretrained(saved)
    assert torch.equal(reloaded(input_ids=ids).logits, expected)


TINY = """\
model: {{name: tiny-{family}}}
data: {{kind: synthetic, num_samples: 8, batch_size: 4}}
stages:
  - {{name: finetune, steps: 3, lr: 1.0e-2, train: lora, lora: {{r: 4, alpha: 8, merge: {merge}}}}}
checkpoint_every: 0
logging: {{trackers: []}}
"""


@pytest.fixture(scope="module", params=["sana", "llama"])
def lora_runs(request, tmp_path_factory):
    """The same LoRA run saving an adapter (kept/) and merging it (merged/)."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    for merge, name in ((False, "kept"), (True, "merged")):
        train(parse_recipe(TINY.format(family=request.param, merge=str(merge).lower())), root / name, **QUIET)
    return request.param, root


def _inputs(model, family):
    adapter = mhla_convert.families.adapter_for_model(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return adapter.example_inputs(model, grid=(40,) if family == "llama" else None, batch_size=2)


def _output(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return (out.logits if hasattr(out, "logits") else out.sample).detach()


def test_saved_adapter_reloads_as_the_merged_model(lora_runs):
    from peft import PeftModel

    family, root = lora_runs
    base = mhla_convert.from_pretrained(root / "kept" / "model")
    merged = mhla_convert.from_pretrained(root / "merged" / "model")
    inputs = _inputs(base, family)
    before, expected = _output(base, inputs), _output(merged, inputs)
    assert not torch.equal(before, expected)
    config = json.loads((root / "kept" / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(root / "kept" / "model")
    assert config["task_type"] == ("CAUSAL_LM" if family == "llama" else None)
    with_adapter = PeftModel.from_pretrained(base, root / "kept" / "adapter")
    torch.testing.assert_close(_output(with_adapter, inputs), expected)  # unmerged: x·W + x·A·B, other rounding
    assert torch.equal(_output(with_adapter.merge_and_unload(), inputs), expected)
    assert torch.equal(_output(load_adapter(mhla_convert.from_pretrained(root / "kept" / "model"),
                                            root / "kept" / "adapter"), inputs), expected)


def test_saved_adapter_loads_with_the_diffusers_pipeline(lora_runs):
    from mhla_convert.train.components import pipeline

    family, root = lora_runs
    if family != "sana":
        pytest.skip("diffusers' LoRA loader is for the diffusion pipelines")
    base = mhla_convert.from_pretrained(root / "kept" / "model")
    merged = mhla_convert.from_pretrained(root / "merged" / "model")
    inputs = _inputs(base, family)
    transformer = mhla_convert.from_pretrained(root / "kept" / "model")
    transformer.load_lora_adapter(root / "kept" / "adapter", weight_name="pytorch_lora_weights.safetensors")
    transformer.fuse_lora()
    assert torch.equal(_output(transformer, inputs), _output(merged, inputs))
    pipe = pipeline("sana", base, "tiny-sana")
    pipe.load_lora_weights(root / "kept" / "adapter")
    torch.testing.assert_close(_output(pipe.transformer, inputs), _output(merged, inputs))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    assert torch.equal(_output(pipe.transformer, inputs), _output(merged, inputs))


def test_sample_takes_an_adapter_and_refuses_a_foreign_one(lora_runs, tmp_path):
    family, root = lora_runs
    if family != "llama":
        pytest.skip("one family is enough for the command line")
    runner = CliRunner()
    adapter = str(root / "kept" / "adapter")
    args = ["sample", str(root / "kept"), "--subfolder", "model", "--prompt", "abc", "--max-new-tokens", "4",
            "--device", "cpu", "--out"]
    result = runner.invoke(app, [*args, str(tmp_path / "a.txt"), "--adapter", adapter])
    assert result.exit_code == 0, result.output
    other = mhla_convert.tiny_model("tiny-qwen3")
    mhla_convert.convert(other, progress=False)
    other_dir = mhla_convert.save_pretrained(other, tmp_path / "other")
    result = runner.invoke(app, ["sample", str(other_dir), *args[4:], str(tmp_path / "b.txt"), "--adapter", adapter])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "does not fit this model" in result.stderr
    with pytest.raises(TrainError, match="is not a PEFT adapter"):
        load_adapter(other, tmp_path)


def _trained_lora(seed: int):
    """A converted tiny Qwen3 with LoRA layers whose weights are not PEFT's zero start."""
    torch.manual_seed(seed)
    model = mhla_convert.tiny_model("tiny-qwen3")
    with torch.no_grad():  # another model of the same shapes per seed
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    mhla_convert.convert(model, progress=False)
    return model


def test_adapter_loads_with_auto_peft_and_is_refused_on_another_base(tmp_path):
    from huggingface_hub import ModelCard
    from peft import AutoPeftModelForCausalLM, PeftModel

    model = _trained_lora(0)
    base = mhla_convert.save_pretrained(model, tmp_path / "model")
    add_lora(model, LoraSpec(r=4, alpha=8))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    model.eval()
    ids = torch.randint(0, 128, (2, 24))
    trained = _output(model, {"input_ids": ids})
    save_adapter(model, tmp_path / "adapter", base=str(base))
    assert torch.equal(_output(model, {"input_ids": ids}), trained)  # saving leaves the model as it was
    card = ModelCard.load(tmp_path / "adapter" / "README.md").data.to_dict()
    assert card["library_name"] == "peft" and "mhla-convert" in card["tags"] and "base_model" not in card
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    assert torch.equal(_output(loaded, {"input_ids": ids}), trained)
    assert torch.equal(_output(load_adapter(mhla_convert.from_pretrained(base), tmp_path / "adapter"),
                               {"input_ids": ids}), _output(loaded.merge_and_unload(), {"input_ids": ids}))

    other = _trained_lora(1)
    with pytest.raises(TrainError, match="trained on another model than this one.*force=True") as refused:
        load_adapter(other, tmp_path / "adapter")
    assert "\n" not in str(refused.value)
    expected = _output(PeftModel.from_pretrained(_trained_lora(1), tmp_path / "adapter").merge_and_unload(),
                       {"input_ids": ids})
    assert torch.equal(_output(load_adapter(other, tmp_path / "adapter", force=True), {"input_ids": ids}), expected)
