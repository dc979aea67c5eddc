"""save_pretrained / from_pretrained / push_to_hub, offline."""

from __future__ import annotations

import json

import pytest
import torch

from mhla_convert import convert, from_pretrained, push_to_hub, save_pretrained
from mhla_convert.families import adapter_for_model
from mhla_convert.models import load_model, tiny_models

GRIDS = {
    "tiny-sana": (7, 9),
    "tiny-wan": (5, 6, 7),
    "tiny-wan-i2v": (3, 4, 5),
    "tiny-dit": (6, 6),
    "tiny-pixart": (7, 9),
}


def _inputs(model, name):
    torch.manual_seed(0)
    return adapter_for_model(model).example_inputs(model, GRIDS[name], 2)


@pytest.mark.parametrize("name", list(tiny_models()))
def test_reload_is_bitwise_identical_at_batch_sizes_1_and_2(tiny, run_model, tmp_path, name):
    """Loaded tensors get their own aligned storage: views into the file buffer would send CPU
    matmuls down other code paths and change the outputs in the last bits."""
    model = tiny(name)
    convert(model, ratio=0.5)
    reloaded = from_pretrained(save_pretrained(model, tmp_path / "ckpt"))
    for batch_size in (1, 2):
        torch.manual_seed(0)
        inputs = adapter_for_model(model).example_inputs(model, GRIDS.get(name, (16,)), batch_size)
        assert torch.equal(run_model(reloaded, inputs), run_model(model, inputs)), f"batch size {batch_size}"


def test_sharded_checkpoint_and_bf16(tiny, run_model, tmp_path):
    model = tiny("tiny-wan", torch_dtype=torch.bfloat16)
    convert(model, ratio=0.5, blocks="2x2x2")
    inputs = _inputs(model, "tiny-wan")
    before = run_model(model, inputs)
    path = save_pretrained(model, tmp_path / "ckpt", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("model-*.safetensors"))) > 1
    reloaded = from_pretrained(path)
    assert reloaded.blocks[1].attn1.mixing.dtype == torch.float32  # kept in float32 (placement.py)
    assert torch.equal(run_model(reloaded, inputs), before)


def test_reload_in_another_dtype_keeps_fp32_modules(tiny, tmp_path):
    model = tiny("tiny-wan")
    convert(model, ratio=0.5)
    reloaded = from_pretrained(save_pretrained(model, tmp_path / "ckpt"), torch_dtype="bf16")
    assert reloaded.blocks[1].attn1.to_q.weight.dtype == torch.bfloat16
    assert reloaded.scale_shift_table.dtype == torch.float32  # Wan's _keep_in_fp32_modules


def test_resaving_replaces_a_checkpoint(tiny, tmp_path):
    first, second = tiny("tiny-dit"), tiny("tiny-dit")
    convert(first, layers=[0])
    convert(second, layers=[2, 3])
    save_pretrained(first, tmp_path / "ckpt")
    save_pretrained(second, tmp_path / "ckpt")
    assert from_pretrained(tmp_path / "ckpt").mhla_plan["layers"] == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left behind


def test_interrupted_save_leaves_nothing_loadable(tiny, tmp_path, monkeypatch):
    import mhla_convert.io as io

    model = tiny("tiny-dit")
    convert(model, ratio=0.5)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C while the weights are being written

    monkeypatch.setattr(io, "save_torch_state_dict", crash)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(model, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="not a directory"):
        from_pretrained(tmp_path / "ckpt")


def test_interrupted_resave_keeps_the_previous_checkpoint(tiny, tmp_path, monkeypatch):
    import mhla_convert.io as io

    model = tiny("tiny-dit")
    convert(model, layers=[1])
    save_pretrained(model, tmp_path / "ckpt")
    monkeypatch.setattr(io, "save_torch_state_dict", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "ckpt")
    assert from_pretrained(tmp_path / "ckpt").mhla_plan["layers"] == [1]


def test_from_pretrained_on_a_base_model_directory(tiny, tmp_path):
    tiny("tiny-dit").save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="no mhla_config.json"):
        from_pretrained(tmp_path / "base")


def test_unconverted_model_and_foreign_directory_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="not converted"):
        save_pretrained(tiny("tiny-dit"), tmp_path / "x")
    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        save_pretrained(model, tmp_path / "mine")


def test_tampered_checkpoint_fails_strictly(tiny, tmp_path):
    model = tiny("tiny-dit")
    convert(model, layers=[1])
    path = save_pretrained(model, tmp_path / "ckpt")
    meta = json.loads((path / "mhla_config.json").read_text())
    meta["plan"]["layers"] = [1, 2]  # the weights hold no mixing for layer 2
    (path / "mhla_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not match its plan"):
        from_pretrained(path)


def test_hub_id_while_offline_suggests_a_local_path():
    with pytest.raises(OSError, match="pass a local directory"):
        from_pretrained("someone/not-cached-mhla-model")
    with pytest.raises(OSError, match="pass a local directory"):
        load_model("wan2.1")


def test_push_to_hub_creates_repo_and_uploads_checkpoint_and_card_in_one_commit(tiny, tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    calls = {}
    monkeypatch.setattr(
        HfApi,
        "create_repo",
        lambda self, repo_id, **kw: calls.setdefault("create", (repo_id, kw)) and f"https://huggingface.co/{repo_id}",
    )
    monkeypatch.setattr(HfApi, "create_commit", lambda self, repo_id, operations, **kw: calls.update(
        commit=(repo_id, {op.path_in_repo: op.path_or_fileobj for op in operations}, kw)))
    model = tiny("tiny-wan")
    convert(model, ratio=0.67)
    model.mhla_source["base_model"] = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    path = save_pretrained(model, tmp_path / "ckpt")
    (path / "README.md").write_text("an older card")  # replaced on the Hub, left alone here
    (tmp_path / "latents").mkdir()
    (path / "eval.json").write_text(json.dumps({"model": {"loss": 0.5}, "meta": {
        "model": str(path), "reference": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "data": {"kind": "latents", "path": str(tmp_path / "latents")}}}))
    url = push_to_hub(path, "me/wan-mhla", private=True)
    assert url == "https://huggingface.co/me/wan-mhla"
    assert calls["create"] == ("me/wan-mhla", {"private": True, "exist_ok": True, "repo_type": "model"})
    repo_id, files, options = calls["commit"]
    assert repo_id == "me/wan-mhla" and options["repo_type"] == "model"
    assert sorted(files) == ["README.md", "config.json", "eval.json", "mhla_config.json", "model.safetensors"]
    assert files["model.safetensors"] == str(path / "model.safetensors")
    card = files["README.md"].decode()
    assert "base_model: Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in card and "library_name: mhla-convert" in card
    uploaded_eval = json.loads(files["eval.json"])
    assert str(tmp_path) not in files["eval.json"].decode()
    assert uploaded_eval["meta"]["model"] == "ckpt" and uploaded_eval["meta"]["data"]["path"] == "latents"
    assert uploaded_eval["meta"]["reference"] == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert 'mhla_convert.from_pretrained("me/wan-mhla")' in card and "| converted layers | `1, 2, 4, 5` |" in card
    assert (path / "README.md").read_text() == "an older card"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(tiny_models()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reload_on_the_gpu_is_bitwise_identical(tiny, run_model, tmp_path, name, dtype):
    """Saved on the GPU, reloaded straight onto it (and through the library's own loader): same outputs, bit
    for bit, with the Triton kernels where they apply."""
    model = tiny(name, torch_dtype=dtype).cuda()
    convert(model, ratio=0.5)
    path = save_pretrained(model, tmp_path / "ckpt")
    torch.manual_seed(0)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v
              for k, v in adapter_for_model(model).example_inputs(model, GRIDS.get(name, (16,)), 2).items()}
    expected = run_model(model, inputs)
    assert torch.equal(run_model(from_pretrained(path, device="cuda"), inputs), expected)
    assert torch.equal(run_model(type(model).from_pretrained(path).cuda(), inputs), expected)
