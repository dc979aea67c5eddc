"""What importing mhla_convert and starting the CLI load, and every loader of a converted model in a fresh process
whatever was imported first (registration.py). Speed itself is measured by benchmarks/startup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from mhla_convert import convert, mhla_layers, save_pretrained
from mhla_convert.train.components import pipeline

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "diffusers", "peft", "torch._dynamo")


def _run(code: str, tmp_path: Path) -> dict:
    """`code` in a fresh interpreter; what it prints after RESULT, as JSON."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and "RESULT" in result.stdout, result.stdout + result.stderr
    return json.loads(result.stdout.split("RESULT", 1)[1])


def test_importing_the_package_and_the_cli_help_and_list_load_no_library(tmp_path):
    loaded = _run(f"""
        import json, sys
        import mhla_convert
        loaded = [[m for m in {HEAVY!r} if m in sys.modules]]
        from mhla_convert.cli import main
        for command in ("--help", "list"):
            sys.argv = ["mhla-convert", command]
            try:
                main()
            except SystemExit as done:
                assert not done.code, (command, done.code)
            loaded.append([m for m in {HEAVY!r} if m in sys.modules])
        print("RESULT", json.dumps(loaded))
    """, tmp_path)
    assert loaded == [[], [], []]


def test_every_loader_finds_the_converted_classes_in_a_fresh_process(tiny, tmp_path):
    lm = tiny("tiny-llama")
    convert(lm, layers=[1, 3])
    lm_dir = save_pretrained(lm, tmp_path / "lm")
    ids = torch.randint(0, lm.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    dit = tiny("tiny-dit")
    convert(dit, ratio=0.5)
    pipeline("dit", dit, "tiny-dit").save_pretrained(tmp_path / "pipe")
    with torch.no_grad():
        torch.save({"ids": ids, "logits": lm(ids).logits}, tmp_path / "expected.pt")
    check = f"""
        import json, sys, torch
        expected = torch.load({str(tmp_path / "expected.pt")!r})

        def same(model):
            with torch.no_grad():
                return torch.equal(model(expected["ids"]).logits, expected["logits"])
    """
    # the first transformers module imported is imported from inside another (the model class's): the converted
    # model types still register
    nested = _run("""
        import mhla_convert
        from transformers import LlamaForCausalLM, AutoConfig, AutoModelForCausalLM
    """ + check + f"""
        built = AutoConfig.for_model("mhla_llama", hidden_size=32)
        config = AutoConfig.from_pretrained({str(lm_dir)!r})
        model = AutoModelForCausalLM.from_pretrained({str(lm_dir)!r})
        print("RESULT", json.dumps([type(config).__name__, type(model).__name__, same(model), type(built).__name__]))
    """, tmp_path)
    assert nested == ["MHLALlamaConfig", "MHLALlamaForCausalLM", True, "MHLALlamaConfig"]
    # without importing mhla_convert: the checkpoint's own loader module, which needs none of diffusers and PEFT
    trusted = _run(check + f"""
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(lm_dir)!r}, trust_remote_code=True)
        print("RESULT", json.dumps([type(model).__name__, same(model), "diffusers" in sys.modules,
                                    "peft" in sys.modules]))
    """, tmp_path)
    assert trusted == ["MHLALlamaForCausalLM", True, False, False]
    ours = _run(check + f"""
        import mhla_convert
        model = mhla_convert.from_pretrained({str(lm_dir)!r})
        print("RESULT", json.dumps([type(model).__name__, same(model), "diffusers" in sys.modules]))
    """, tmp_path)
    assert ours == ["MHLALlamaForCausalLM", True, False]
    # diffusers imported before mhla_convert: its component libraries still list diffusers_models
    pipe = _run(f"""
        import json
        import diffusers
        import mhla_convert
        pipe = diffusers.DiffusionPipeline.from_pretrained({str(tmp_path / "pipe")!r})
        print("RESULT", json.dumps([type(pipe.transformer).__name__, len(mhla_convert.mhla_layers(pipe.transformer))]))
    """, tmp_path)
    assert pipe == [type(dit).__name__, len(mhla_layers(dit))]


def test_after_import_alone_a_base_class_refuses_a_converted_checkpoint(tiny, tmp_path):
    """`import mhla_convert` is all it takes: the library's modeling module loading installs the refusal, though
    no converted class has been built in the process."""
    lm = tiny("tiny-llama")
    convert(lm, layers=[1, 3])
    dit = tiny("tiny-dit")
    convert(dit, ratio=0.5)
    checkpoints = {"LlamaForCausalLM": save_pretrained(lm, tmp_path / "lm"),
                   "DiTTransformer2DModel": save_pretrained(dit, tmp_path / "dit")}
    for name, path in checkpoints.items():
        library = "transformers" if name.endswith("CausalLM") else "diffusers"
        refused = _run(f"""
            import json, sys
            import mhla_convert
            from {library} import {name}
            built = [m for m in sys.modules if m.startswith(("mhla_convert.transformers_models",
                                                             "mhla_convert.diffusers_models"))]
            try:
                {name}.from_pretrained({str(path)!r})
                error = None
            except OSError as refusal:
                error = str(refusal)
            print("RESULT", json.dumps([built, error]))
        """, tmp_path)
        assert refused[0] == [] and "\n" not in refused[1], refused
        assert refused[1].startswith(f"{path} is an MHLA checkpoint (converted by mhla-convert), which {name}'s own "
                                     f"loader would not load as converted: load it with "), refused
        assert f"MHLA{name}.from_pretrained" in refused[1], refused


def test_peft_gets_the_converted_lm_types_default_targets(tmp_path):
    targets = _run("""
        import json
        import mhla_convert
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table
        print("RESULT", json.dumps([table.get("mhla_qwen2"), table.get("qwen2")]))
    """, tmp_path)
    assert targets[0] == targets[1] and targets[0]
