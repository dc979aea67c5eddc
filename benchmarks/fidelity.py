"""Fidelity benchmark: how close a converted model stays to its original, on real data.

Two miniatures, each trained to convergence from scratch with the project's own recipe machinery
(a ratio-0 recipe is plain training of the original), then converted and fine-tuned with recipes:

- **lm**: a Llama-style byte-level LM (6 layers, 256 wide, GQA) on the Python source of the
  installed `transformers` package; every tenth file is held out.
- **dit**: a class-conditional DiT (6 layers, 256 wide, 8×8 pixel grid, patch 1) on scikit-learn's
  handwritten digits (1,797 8×8 images, 10 classes); every tenth image is held out.

Every variant runs the same budget: attention transfer, then fine-tuning of all weights, with the
held-out loss (fixed batches, fixed noise) at step 0, after transfer and every `--eval-every`
steps. The gap is (loss − original's loss) / original's loss on the same held-out batches.

    python benchmarks/fidelity.py --out out/fidelity                      # both, GPU: a few minutes
    python benchmarks/fidelity.py --out out/fidelity --kinds lm --quick   # CPU smoke run

Writes fidelity.json (every curve), fidelity.md (the table) and fidelity.png (the curves) to --out.
Needs scikit-learn for the digits and matplotlib for the plot (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from mhla_convert.families import adapter_for_family
from mhla_convert.train import parse_recipe
from mhla_convert.train.metrics import read_metrics
from mhla_convert.train.trainer import Trainer

# --- data ------------------------------------------------------------------------------------------


def lm_data(directory: Path, context: int, max_train_tokens: int) -> None:
    """Bytes of the installed transformers package's .py files, packed into rows of `context`."""
    import transformers

    files = sorted(Path(transformers.__file__).parent.rglob("*.py"))
    streams = {"train": bytearray(), "heldout": bytearray()}
    for i, path in enumerate(files):
        streams["heldout" if i % 10 == 0 else "train"] += path.read_bytes() + b"\0"
    caps = {"train": max_train_tokens, "heldout": 8 * 64 * context}  # the validation reads 8 batches of 64
    for split, data in streams.items():
        ids = torch.frombuffer(bytes(data[: caps[split] // context * context]), dtype=torch.uint8).long()
        ids = ids.view(-1, context)
        save_file({"input_ids": ids}, str(directory / f"{split}.safetensors"))


def dit_data(directory: Path) -> None:
    """scikit-learn's digits: 8×8 grey images scaled to [-1, 1], with their class labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).div(8.0).sub(1.0)[:, None]
    labels = torch.tensor(digits.target, dtype=torch.long)
    held = torch.arange(len(labels)) % 10 == 0
    for split, mask in (("train", ~held), ("heldout", held)):
        save_file({"latents": images[mask].contiguous(), "class_labels": labels[mask].contiguous()},
                  str(directory / f"{split}.safetensors"))


# --- the miniatures --------------------------------------------------------------------------------


@dataclass
class Miniature:
    family: str
    config: dict
    base_steps: int
    base_lr: float
    batch_size: int
    finetune_lr: float
    conversion: dict = field(default_factory=dict)  # options every converted variant shares


def miniatures(quick: bool) -> dict[str, Miniature]:
    from transformers import LlamaConfig

    width, layers = (64, 4) if quick else (256, 6)
    lm = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=width * 3, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     architectures=["LlamaForCausalLM"]).to_dict()
    dit = dict(num_attention_heads=4, attention_head_dim=width // 4, in_channels=1, out_channels=1, num_layers=layers,
               sample_size=8, patch_size=1, num_embeds_ada_norm=10, norm_num_groups=1)
    return {
        "lm": Miniature("llama", lm, base_steps=20 if quick else 2000, base_lr=1e-3, batch_size=8 if quick else 32,
                        finetune_lr=1e-4, conversion={"options": {"chunk_size": 64}}),
        "dit": Miniature("dit", dit, base_steps=20 if quick else 3000, base_lr=3e-4, batch_size=16 if quick else 128,
                         finetune_lr=5e-5, conversion={"blocks": "4x4"}),
    }


def save_random_base(mini: Miniature, directory: Path) -> None:
    torch.manual_seed(0)
    adapter = adapter_for_family(mini.family)
    adapter.build(mini.config).save_pretrained(str(directory))


# --- recipes ---------------------------------------------------------------------------------------


def recipe(
    model: str, data: Path, stages: list[dict], *, batch_size: int, lr: float, eval_every: int, conversion: dict | None,
    schedule: dict | None = None, precision: str = "no", keep_best: bool = False,
) -> dict:
    return {
        "model": {"name": model},
        "conversion": conversion or {"ratio": 0.0},
        "data": {"kind": "latents", "path": str(data / "train.safetensors"), "batch_size": batch_size},
        "validation": {"path": str(data / "heldout.safetensors"), "every": eval_every, "num_batches": 8,
                       "batch_size": 64, "keep_best": keep_best},
        "stages": stages,
        "optimizer": {"lr": lr, "grad_clip": 1.0},
        "schedule": schedule or {"name": "constant", "warmup_steps": 0},
        "precision": precision,
        "logging": {"every": 10, "trackers": []},
        "seed": 0,
    }


def run(spec: dict, out: Path) -> list[dict]:
    """Train a recipe afresh; its validation rows [{step, stage, validation_loss}]."""
    shutil.rmtree(out, ignore_errors=True)
    Trainer(parse_recipe(yaml.safe_dump(spec)), out, resume=False, log=lambda *_: None).run()
    return validation_rows(out)


def validation_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "validation_loss" in r]


VARIANTS = {  # name -> (label, conversion section, whether the run starts with attention transfer)
    "mhla": ("full MHLA", {"ratio": 1.0}, True),
    "linear": ("plain linear attention", {"ratio": 1.0, "attention": "linear"}, True),
    "hybrid-spread": ("hybrid 50% spread", {"ratio": 0.5, "strategy": "spread"}, True),
    "hybrid-auto": ("hybrid 50% auto", {"ratio": 0.5, "strategy": "auto"}, True),
    "mhla-no-exact": ("full MHLA, no exact chunks (LM)", {"ratio": 1.0, "options": {"exact_chunks": 0}}, True),
    "mhla-no-transfer": ("full MHLA, no transfer", {"ratio": 1.0}, False),
    "original": ("original, fine-tuned alike", {"ratio": 0.0}, False),
}

LM_ONLY = {"mhla-no-exact"}  # the paper's pure causal form; non-causal layers have no exact chunks


def variant_conversion(mini: Miniature, section: dict) -> dict:
    out = {**section}
    if section["ratio"] > 0:
        out.update({k: v for k, v in mini.conversion.items() if not (k == "blocks" and section.get("attention"))})
        out["options"] = {**mini.conversion.get("options", {}), **section.get("options", {})}
    return out


# --- training-free baseline: sliding window + attention sinks (LMs) ---------------------------------


def sink_window_loss(model_dir: Path, data: Path, window: int, sinks: int, device: str) -> float:
    """The original LM with each query restricted to the last `window` keys plus the first `sinks`
    (StreamingLLM), scored with the same held-out batches and objective as the variants."""
    from transformers import AttentionInterface

    from mhla_convert import load_model
    from mhla_convert.train.data import TensorData, load_shards
    from mhla_convert.train.recipe import ObjectiveSpec
    from mhla_convert.train.validation import HeldOut

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n, groups = query.shape[-2], query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        i = torch.arange(n, device=query.device)[:, None]
        j = torch.arange(key.shape[-2], device=query.device)[None]
        allowed = (j <= i) & ((i - j < window) | (j < sinks))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sink_window", attention)
    model = load_model(str(model_dir)).to(device)
    model.set_attn_implementation("sink_window")
    held = HeldOut(
        TensorData(load_shards(data / "heldout.safetensors")),
        adapter_for_family("llama").objective(ObjectiveSpec()),
        batch_size=64,
        num_batches=1000,
        seed=0,
    )
    return held.loss(model, device=device, dtype=torch.float32)


# --- the benchmark ---------------------------------------------------------------------------------


def gap(loss: float, reference: float) -> float:
    return (loss - reference) / reference


def bench(kind: str, mini: Miniature, args, root: Path) -> dict:
    data, base_dir = root / kind / "data", root / kind / "random-init"
    data.mkdir(parents=True, exist_ok=True)
    (lm_data(data, 512 if not args.quick else 64, 24_000_000 if not args.quick else 20_000) if kind == "lm"
     else dit_data(data))
    precision = "bf16" if torch.cuda.is_available() else "no"
    tic = time.perf_counter()
    if (root / kind / "base" / "best").is_dir():  # trained by an earlier run into the same --out
        base_curve = validation_rows(root / kind / "base")
    else:
        save_random_base(mini, base_dir)
        base_curve = run(recipe(str(base_dir), data, [{"name": "finetune", "steps": mini.base_steps, "train": "all"}],
                         batch_size=mini.batch_size, lr=mini.base_lr, eval_every=max(mini.base_steps // 10, 1),
                         conversion=None, precision=precision,
                         schedule={"name": "cosine", "warmup_steps": mini.base_steps // 20}, keep_best=True),
                         root / kind / "base")
    original = min(r["validation_loss"] for r in base_curve)  # the original is the best model by held-out loss
    result = {"original_loss": original, "base_training": base_curve, "variants": {},
              "base_seconds": time.perf_counter() - tic}
    print(f"[{kind}] original trained {mini.base_steps} steps ({result['base_seconds']:.0f} s): held-out loss "
          f"{original:.4f}", flush=True)
    trained = str(root / kind / "base" / "best")
    for name in args.variants:
        if kind != "lm" and name in LM_ONLY:
            continue
        label, section, transfer = VARIANTS[name]
        stages = ([{"name": "attention_transfer", "steps": args.transfer_steps, "lr": args.transfer_lr}]
                  if transfer else [])
        stages.append({"name": "finetune", "steps": args.finetune_steps + (0 if transfer else args.transfer_steps),
                       "train": "all", "lr": args.finetune_lr or mini.finetune_lr})
        tic = time.perf_counter()
        spec = recipe(trained, data, stages, batch_size=mini.batch_size, lr=args.finetune_lr or mini.finetune_lr,
                      eval_every=args.eval_every, conversion=variant_conversion(mini, section), precision=precision)
        curve = run(spec, root / kind / "variants" / name)
        saved = json.loads((root / kind / "variants" / name / "model" / "mhla_config.json").read_text())
        result["variants"][label] = {
            "conversion": spec["conversion"], "transfer": transfer, "seconds": time.perf_counter() - tic,
            "converted_layers": saved["plan"]["layers"], "sensitivity": saved["plan"].get("sensitivity"),
            "curve": [{**r, "gap": gap(r["validation_loss"], original)} for r in curve],
        }
        print(
            f"[{kind}] {label} ({time.perf_counter() - tic:.0f} s): "
            + ", ".join(f"{r['step']}: {gap(r['validation_loss'], original):+.1%}" for r in curve),
            flush=True,
        )
    if kind == "lm":
        loss = sink_window_loss(
            Path(trained), data, args.window, args.sinks, "cuda" if torch.cuda.is_available() else "cpu"
        )
        result["sink_window"] = {"window": args.window, "sinks": args.sinks, "loss": loss, "gap": gap(loss, original)}
        print(f"[lm] sliding window {args.window} + {args.sinks} sinks (no training): {gap(loss, original):+.1%}")
    return result


def point(curve: list[dict], step: int | None = None, stage: str | None = None) -> float | None:
    rows = [r for r in curve if (step is None or r["step"] == step) and (stage is None or r["stage"] == stage)]
    return rows[-1]["gap"] if rows else None


def table(results: dict, args) -> str:
    lines = []
    for kind, res in results.items():
        lines += [
            f"**{kind}** (original's held-out loss {res['original_loss']:.4f})",
            "",
            f"| variant | step 0 | after transfer | after {args.transfer_steps + args.finetune_steps} steps | best |",
            "|---|---|---|---|---|",
        ]
        for name, v in res["variants"].items():
            curve = v["curve"]
            cells = [
                point(curve, 0),
                point(curve, args.transfer_steps, "attention_transfer") if v["transfer"] else None,
                curve[-1]["gap"],
                min(r["gap"] for r in curve),
            ]
            lines.append(f"| {name} | " + " | ".join("—" if c is None else f"{c:+.1%}" for c in cells) + " |")
        if "sink_window" in res:
            s = res["sink_window"]
            lines.append(f"| sliding window {s['window']} + {s['sinks']} sink tokens (no training) | {s['gap']:+.1%} "
                         "| — | — | — |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (kind, res) in zip(axes[0], results.items()):
        for name, v in res["variants"].items():
            ax.plot([r["step"] for r in v["curve"]], [100 * r["gap"] for r in v["curve"]], marker=".", label=name)
        ax.set(title=f"{kind}: held-out loss gap to the original", xlabel="step", ylabel="gap (%)", yscale="symlog")
        ax.axhline(0, color="k", lw=0.5)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kinds", default="lm,dit")
    parser.add_argument("--transfer-steps", type=int, default=100)
    parser.add_argument("--transfer-lr", type=float, default=1e-3)
    parser.add_argument("--finetune-steps", type=int, default=400)
    parser.add_argument("--finetune-lr", type=float, help="default: per miniature")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--window", type=int, default=64, help="sliding-window baseline: keys per query")
    parser.add_argument("--sinks", type=int, default=4, help="sliding-window baseline: sink tokens")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--base-steps", type=int, help="steps of the originals' training (default: per miniature)")
    parser.add_argument("--chunk-size", type=int, help="LM: MHLA chunk size (default: 64)")
    parser.add_argument("--mixing-window", type=int, help="LM: chunk distances with their own mixing weight")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and steps: a CPU smoke run")
    args = parser.parse_args()
    if args.quick:
        args.transfer_steps, args.finetune_steps, args.eval_every = 4, 8, 4
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    minis = miniatures(args.quick)
    for mini in minis.values():
        mini.base_steps = args.base_steps or mini.base_steps
    minis["lm"].conversion["options"].update({k: v for k, v in (("chunk_size", args.chunk_size),
                                                               ("window", args.mixing_window)) if v})
    results = {kind: bench(kind, minis[kind], args, args.out) for kind in args.kinds.split(",")}
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "args": vars(args)}
    (args.out / "fidelity.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    (args.out / "fidelity.md").write_text(table(results, args))
    print(table(results, args))
    plot(results, args.out / "fidelity.png")


if __name__ == "__main__":
    main()
