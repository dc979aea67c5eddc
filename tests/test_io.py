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
    "tiny-wan2.2-ti2v": (3, 4, 5),
    "tiny-hunyuanvideo": (3, 4, 5),
    "tiny-flux": (5, 7),
    "tiny-qwen-image": (5, 7),
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
    assert "base_model: Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in card and "library_name: diffusers" in card
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


# --- the libraries' loader options ---------------------------------------------------------------------

SHA = "0123456789abcdef0123456789abcdef01234567"


def _in_hub_cache(folder, cache, repo_id: str) -> str:
    """`folder` as the cached snapshot of hub repo `repo_id` (its main branch) under `cache`: what
    huggingface_hub and the libraries read with local_files_only."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return SHA


def _lm_ids(model):
    return torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


def test_from_pretrained_takes_the_libraries_option_names(tiny, run_model, tmp_path):
    model = tiny("tiny-llama")
    convert(model, ratio=0.5)
    path = save_pretrained(model, tmp_path / "ckpt")
    ids = {"input_ids": _lm_ids(model)}
    half = run_model(from_pretrained(path, torch_dtype="bf16"), ids)
    for options in (dict(dtype=torch.bfloat16), dict(dtype="bf16", torch_dtype=torch.bfloat16),
                    dict(dtype=torch.bfloat16, device_map="cpu"), dict(dtype="bf16", device_map={"": "cpu"}),
                    dict(dtype="bf16", device="cpu", device_map=torch.device("cpu"))):
        loaded = from_pretrained(path, **options)
        assert loaded.lm_head.weight.dtype == torch.bfloat16, options
        assert torch.equal(run_model(loaded, ids), half), options
    assert torch.equal(run_model(from_pretrained(path, dtype="auto"), ids), run_model(model, ids))  # as saved
    for options, message in ((dict(dtype="bf16", torch_dtype="fp16"), "disagree; give one"),
                             (dict(dtype="int8"), "dtype must be one of"),
                             (dict(device_map="auto"), "loads onto one device; got device_map='auto'"),
                             (dict(device_map={"model": "cpu", "lm_head": "cpu"}), "loads onto one device"),
                             (dict(device="cpu", device_map="meta"), "device='cpu' and device_map='meta' disagree")):
        with pytest.raises(ValueError, match=message):
            from_pretrained(path, **options)


def test_a_converted_transformer_class_takes_dtype(tiny, run_model, tmp_path):
    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    path = save_pretrained(model, tmp_path / "ckpt")
    loaded = type(model).from_pretrained(path, dtype=torch.bfloat16, device_map="cpu", token=None,
                                         local_files_only=True)
    assert loaded.pos_embed.proj.weight.dtype == torch.bfloat16 and type(loaded) is type(model)
    assert torch.equal(run_model(loaded, _inputs(loaded, "tiny-dit")),
                       run_model(from_pretrained(path, torch_dtype=torch.bfloat16), _inputs(loaded, "tiny-dit")))


def test_hub_options_reach_the_libraries_loaders(tiny, run_model, tmp_path, monkeypatch):
    """Offline, from a hub cache: `revision`, `token`, `local_files_only` and `cache_dir` are passed on."""
    import transformers

    cache = tmp_path / "cache"
    base = tiny("tiny-llama")
    base.save_pretrained(tmp_path / "base")
    sha = _in_hub_cache(tmp_path / "base", cache, "me/tiny-base")
    converted = tiny("tiny-llama")
    convert(converted, ratio=0.5)
    _in_hub_cache(save_pretrained(converted, tmp_path / "ckpt"), cache, "me/tiny-mhla")
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    hub = dict(token="hf_not_sent", local_files_only=True, cache_dir=cache)
    loaded = load_model("me/tiny-base", dtype="bf16", revision="main", **hub)
    assert seen == [dict(revision=sha, dtype=torch.bfloat16, **hub)]
    assert loaded.lm_head.weight.dtype == torch.bfloat16 and loaded.mhla_source["base_model"] == "me/tiny-base"
    ids = {"input_ids": _lm_ids(converted)}
    expected = run_model(converted, ids)
    for load in (from_pretrained, load_model):
        assert torch.equal(run_model(load("me/tiny-mhla", revision=sha, **hub), ids), expected), load
    with pytest.raises(OSError, match="me/elsewhere"):  # not in the cache: nothing is fetched
        load_model("me/elsewhere", **hub)


def test_a_diffusers_model_from_a_hub_cache_keeps_its_stored_dtype(tiny, tmp_path):
    cache = tmp_path / "cache"
    tiny("tiny-dit", torch_dtype=torch.bfloat16).save_pretrained(tmp_path / "base")
    _in_hub_cache(tmp_path / "base", cache, "me/tiny-dit")
    loaded = load_model("me/tiny-dit", local_files_only=True, cache_dir=cache)  # its dtype from the cached header
    assert loaded.pos_embed.proj.weight.dtype == torch.bfloat16
    assert load_model("me/tiny-dit", dtype="float32", local_files_only=True, cache_dir=cache).dtype == torch.float32
