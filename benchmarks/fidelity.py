"""Fidelity benchmark: how close a converted model stays to its original, on real data, against the controls.

Miniatures, each trained from scratch with the project's own recipe machinery (a ratio-0 recipe is plain training
of the original), then converted and fine-tuned with recipes:

- **lm**: a Llama-style byte-level LM (6 layers, 256 wide, GQA) on the Python source of the installed
  `transformers` package in rows of 1,024 bytes; every tenth file is held out.
- **dit**: a class-conditional DiT (6 layers, 256 wide, patch 1) on scikit-learn's handwritten digits upsampled to
  16×16 pixels, so 256 tokens in 4×4 blocks of 4×4 tokens; every tenth image is held out.
- **joint** (`--kinds joint`, not run by default): a FLUX-style MM-DiT (2 dual-stream and 4 single-stream blocks,
  256 wide) on the same digits at 32×32 latents in FLUX's 2×2 packing, so 256 image tokens in 4×4 blocks beside 8
  text tokens that carry the class (a fixed random embedding per class; the pooled embedding is the same for every
  class, so the class reaches the image only through joint attention): joint text–image attention, as FLUX.1 and
  Qwen-Image convert, with the text read exactly (the default) or through its summary (`text_exact: false`).

Every variant runs the same budget: attention transfer, then fine-tuning of all weights (the original fine-tuned
alike takes the transfer's steps as fine-tuning), with the held-out loss (fixed batches, fixed noise) at step 0,
after transfer and every `--eval-every` steps. The gap is (loss − original's loss) / original's loss on the same
held-out batches. The controls:

- `softmax`: the original, fine-tuned alike;
- `local` (the LM's sliding window): the original's softmax attention cut to the exact region of the shipped
  conversion (`attention: local`), fine-tuned alike; its step 0 is the truncation every variant with that region
  must start at or below;
- `linear`: plain linear attention.

Then: the DiT's held-out gap by noise level (final models), and the LM's long-range recall: 256 held-out bytes
followed by the same bytes again, bits per byte on the second copy, where every byte was first seen 256 positions
earlier (outside the exact region).

    python benchmarks/fidelity.py --out out/fidelity --jobs 8           # both, GPU: a few minutes
    python benchmarks/fidelity.py --out out/fidelity --kinds lm --quick   # CPU smoke run
    python benchmarks/fidelity.py --out out/joint --kinds joint --width 64 --layers 3 --batch-size 32 \
        --base-steps 2000 --jobs 2                                       # the joint miniature, CPU-sized: ~40 min

Writes fidelity.json (every curve), fidelity.md (the tables), fidelity.png (the curves) and fidelity_summary.json
(the gaps at step 0, after transfer and at the end, the truncation beside them, the recall) to --out. `--jobs N`
trains N variants at once, each in its own process on the same GPU (the miniatures leave most of it idle).
Needs scikit-learn for the digits (`--quick` draws random images instead; a run that has it keeps them in
--out/digits.safetensors, from which a run into the same --out without it reads them) and matplotlib for the plot
(`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import platform
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from mhla_convert.families import adapter_for_family
from mhla_convert.train import parse_recipe
from mhla_convert.train.metrics import read_metrics
from mhla_convert.train.trainer import Trainer

# --- data ------------------------------------------------------------------------------------------

RECALL_SPAN = 256  # bytes: beyond the LM's exact region (at most 128 bytes with 2 chunks of 64)


def lm_data(directory: Path, context: int, max_train_tokens: int, copy_rows: float = 0.0, seed: int = 0) -> None:
    """Bytes of the installed transformers package's .py files, packed into rows of `context`; every 10th file
    (from the `seed % 10`-th) is held out, and that stream also gives the recall probes. `copy_rows`: that fraction
    of the training rows (a seeded draw) repeats a span of RECALL_SPAN bytes right after itself, so the original
    learns to copy from beyond the exact region."""
    import transformers

    files = sorted(Path(transformers.__file__).parent.rglob("*.py"))
    streams = {"train": bytearray(), "heldout": bytearray()}
    for i, path in enumerate(files):
        streams["heldout" if i % 10 == seed % 10 else "train"] += path.read_bytes() + b"\0"
    heldout_rows = 8 * 64 * context  # the validation reads 8 batches of 64
    caps = {"train": max_train_tokens, "heldout": heldout_rows}
    for split, data in streams.items():
        ids = torch.frombuffer(bytearray(data[: caps[split] // context * context]), dtype=torch.uint8).long()
        ids = ids.view(-1, context)
        if split == "train" and copy_rows and context >= 2 * RECALL_SPAN:
            g = torch.Generator().manual_seed(seed + 1)
            rows = torch.randperm(len(ids), generator=g)[: int(copy_rows * len(ids))]
            starts = torch.randint(0, context - 2 * RECALL_SPAN + 1, (len(rows),), generator=g)
            for row, start in zip(rows.tolist(), starts.tolist()):
                ids[row, start + RECALL_SPAN : start + 2 * RECALL_SPAN] = ids[row, start : start + RECALL_SPAN]
        save_file({"input_ids": ids.contiguous()}, str(directory / f"{split}.safetensors"))
    # recall probes from held-out text the validation does not read: a span, then the same span again
    rest = torch.frombuffer(streams["heldout"][heldout_rows:], dtype=torch.uint8).long()
    starts = torch.randperm(len(rest) - RECALL_SPAN, generator=torch.Generator().manual_seed(seed))[:64]
    spans = torch.stack([rest[s : s + RECALL_SPAN] for s in starts.tolist()])
    save_file({"input_ids": torch.cat([spans, spans], 1)}, str(directory / "recall.safetensors"))


def digits(quick: bool, size: int, seed: int, copy: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits upsampled to (N, 1, size, size), in [-1, 1], and their class labels (`quick`: random
    images, no scikit-learn). The 8×8 originals are kept in `copy`, from which a machine without scikit-learn reads
    them."""
    if quick:
        g = torch.Generator().manual_seed(seed)
        images, labels = torch.rand(200, 1, 8, 8, generator=g) * 16, torch.randint(0, 10, (200,), generator=g)
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            if copy is None or not copy.exists():
                kept = "" if copy is None else f" or {copy} from a run that had it"
                raise SystemExit(f"the digits need scikit-learn (pip install scikit-learn){kept}") from None
            loaded = load_file(str(copy))
            images, labels = loaded["images"], loaded["labels"]
        else:
            loaded = load_digits()
            images, labels = torch.tensor(loaded.images, dtype=torch.float32)[:, None], torch.tensor(loaded.target)
            if copy is not None:
                save_file({"images": images, "labels": labels}, str(copy))
    return torch.nn.functional.interpolate(images.div(8.0).sub(1.0), size=(size, size), mode="bilinear"), labels


DIGITS = "digits.safetensors"  # scikit-learn's digits, kept in --out (`digits`)


def save_splits(directory: Path, columns: dict[str, torch.Tensor], seed: int) -> None:
    """train.safetensors and heldout.safetensors: every 10th row (from the `seed % 10`-th) held out."""
    held = torch.arange(len(next(iter(columns.values())))) % 10 == seed % 10
    for split, mask in (("train", ~held), ("heldout", held)):
        save_file({k: v[mask].contiguous() for k, v in columns.items()}, str(directory / f"{split}.safetensors"))


def dit_data(directory: Path, quick: bool, size: int, seed: int = 0, copy: Path | None = None) -> None:
    """The digits at size × size with their class labels (`digits`, kept in `copy`)."""
    images, labels = digits(quick, size, seed, copy)
    save_splits(directory, {"latents": images, "class_labels": labels.long()}, seed)


def joint_data(directory: Path, quick: bool, config: dict, size: int, seed: int = 0, text: int = 8,
               copy: Path | None = None) -> None:
    """The digits (`digits`, kept in `copy`) as (C, size, size) latents (each channel the image), for an MM-DiT of
    `config`: the class as `text` prompt-embedding tokens, a fixed random draw per class. The pooled embedding is one
    draw for every class, so the class reaches the image only through joint attention to the text."""
    images, labels = digits(quick, size, seed, copy)
    g = torch.Generator().manual_seed(seed + 2)
    prompts = torch.randn(10, text, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(1, config["pooled_projection_dim"], generator=g).expand(10, -1)
    latents = images.expand(-1, config["in_channels"] // 4, -1, -1)  # (FLUX packs 2×2 patches of C channels)
    save_splits(directory, {"latents": latents, "prompt_embeds": prompts[labels],
                            "pooled_prompt_embeds": pooled[labels]}, seed)


def write_data(kind: str, mini: Miniature, root: Path, args) -> None:
    """The data of miniature `kind` in root/kind/data (the same files on every call with the same args)."""
    directory = root / kind / "data"
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "lm":
        lm_data(directory, 64 if args.quick else 1024, 20_000 if args.quick else 24_000_000, args.copy_rows,
                args.seed)
    elif kind == "joint":
        joint_data(directory, args.quick, mini.config, mini.latent_size, args.seed, copy=root / DIGITS)
    else:
        dit_data(directory, args.quick, mini.config["sample_size"], args.seed, copy=root / DIGITS)


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
    variants: dict = field(default_factory=dict)  # name -> (label, conversion section, transfer, objective)
    latent_size: int = 0  # the joint miniature's latent side (its image tokens: half that on each axis)


def miniatures(quick: bool, lm_heads: tuple[int, int] = (4, 2), width: int | None = None,
               layers: int | None = None) -> dict[str, Miniature]:
    """The miniatures and their variants; `lm_heads`: the LM's query and key heads; `width` and `layers` in place of
    the default sizes (256 and 6; `quick`: 64 and 2)."""
    from transformers import LlamaConfig

    width, layers = width or (64 if quick else 256), layers or (2 if quick else 6)
    lm = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=width * 3, num_hidden_layers=layers,
                     num_attention_heads=lm_heads[0], num_key_value_heads=lm_heads[1], max_position_embeddings=4096,
                     architectures=["LlamaForCausalLM"]).to_dict()
    dit = dict(num_attention_heads=4, attention_head_dim=width // 4, in_channels=1, out_channels=1, num_layers=layers,
               sample_size=16, patch_size=1, num_embeds_ada_norm=10, norm_num_groups=1)
    shared = {
        "full": ("full MHLA (shipped defaults)", {"ratio": 1.0}, True, {}),
        "local": ("{local}: softmax cut to the exact region, fine-tuned", {"ratio": 1.0, "attention": "local"}, True,
                  {}),
        "linear": ("plain linear attention", {"ratio": 1.0, "attention": "linear"}, True, {}),
        "hybrid-auto": ("hybrid 50% auto", {"ratio": 0.5, "strategy": "auto"}, True, {}),
        "full-distill": ("full MHLA, fine-tuned by distillation", {"ratio": 1.0}, True, {"distill": 1.0}),
        "softmax": ("original, fine-tuned alike", {"ratio": 0.0}, False, {}),
    }
    hedgehog = {"feature_map": "hedgehog"}
    retrieval = {"retrieval_heads": [0]}  # the query heads of key head 0 keep softmax over every earlier token
    chunk = 16 if quick else 64
    # the same exact span (up to 2 default chunks) and mixing reach in chunks of a half and a quarter of the default
    half = {"chunk_size": chunk // 2, "exact_chunks": 4, "window": 16}
    quarter = {"chunk_size": chunk // 4, "exact_chunks": 8, "window": 32}
    lm_variants = {
        **shared,
        "full-no-exact": ("full MHLA, no exact chunks (the paper's form)",
                          {"ratio": 1.0, "options": {"exact_chunks": 0}}, True, {}),
        "full-hedgehog": ("full MHLA, learned Hedgehog feature map", {"ratio": 1.0, "options": hedgehog}, True, {}),
        "full-hedgehog-heads": ("full MHLA, Hedgehog, mixing per head",
                                {"ratio": 1.0, "options": {**hedgehog, "per_head_mixing": True}}, True, {}),
        "full-hedgehog-distill": ("full MHLA, Hedgehog, fine-tuned by distillation",
                                  {"ratio": 1.0, "options": hedgehog}, True, {"distill": 1.0}),
        "local-half": ("sliding window of 4 half chunks, fine-tuned", {"ratio": 1.0, "attention": "local",
                                                                       "options": half}, True, {}),
        "full-half": ("full MHLA, half chunks", {"ratio": 1.0, "options": half}, True, {}),
        "full-half-hedgehog-distill": ("full MHLA, half chunks, Hedgehog, distilled",
                                       {"ratio": 1.0, "options": {**half, **hedgehog}}, True, {"distill": 1.0}),
        "full-quarter": ("full MHLA, quarter chunks", {"ratio": 1.0, "options": quarter}, True, {}),
        "local-quarter": ("sliding window of 8 quarter chunks, fine-tuned", {"ratio": 1.0, "attention": "local",
                                                                             "options": quarter}, True, {}),
        "full-quarter-hedgehog-distill": ("full MHLA, quarter chunks, Hedgehog, distilled",
                                          {"ratio": 1.0, "options": {**quarter, **hedgehog}}, True, {"distill": 1.0}),
        "local-retrieval": ("sliding window, one retrieval key head, fine-tuned",
                            {"ratio": 1.0, "attention": "local", "options": retrieval}, True, {}),
        "full-retrieval": ("full MHLA, one retrieval key head", {"ratio": 1.0, "options": retrieval}, True, {}),
        "full-hedgehog-distill-retrieval": ("full MHLA, Hedgehog, distilled, one retrieval key head",
                                            {"ratio": 1.0, "options": {**hedgehog, **retrieval}}, True,
                                            {"distill": 1.0}),
        # an eighth of the key heads, those reaching furthest beyond the exact chunks on calibration data
        "local-retrieval-auto": ("sliding window, retrieval heads chosen on data, fine-tuned",
                                 {"ratio": 1.0, "attention": "local", "retrieval_share": 0.125}, True, {}),
        "full-retrieval-auto": ("full MHLA, retrieval heads chosen on data", {"ratio": 1.0, "retrieval_share": 0.125},
                                True, {}),
        "full-hedgehog-distill-retrieval-auto": ("full MHLA, Hedgehog, distilled, retrieval heads chosen on data",
                                                 {"ratio": 1.0, "retrieval_share": 0.125, "options": hedgehog}, True,
                                                 {"distill": 1.0}),
        # one softmax layer: the layer hybrid whose KV cache is nearest an eighth of the key heads
        "hybrid-auto-one": ("hybrid, one softmax layer (auto)", {"ratio": 1 - 1 / layers, "strategy": "auto"}, True,
                            {}),
    }
    dit_variants = {
        **shared,
        "full-own-block": ("full MHLA, exact own block only", {"ratio": 1.0, "options": {"exact_radius": 0}}, True,
                           {}),
        "full-no-exact": ("full MHLA, no exact region (the paper's form)",
                          {"ratio": 1.0, "options": {"exact_radius": None}}, True, {}),
    }
    joint_variants = {
        **dit_variants,
        "linear": ("linear attention over the image, the text exact", {"ratio": 1.0, "attention": "linear"}, True, {}),
        "full-text-summary": ("full MHLA, text read through its summary",
                              {"ratio": 1.0, "options": {"text_exact": False}}, True, {}),
        "linear-text-summary": ("plain linear attention, the text too",
                                {"ratio": 1.0, "attention": "linear", "options": {"text_exact": False}}, True, {}),
    }
    head = width // 4
    dual = max(1, layers // 3)
    first = max(2, 2 * (head // 16))  # FLUX's split of the head into RoPE axes: 16, 56, 56 of 128
    rope = (first, 2 * ((head - first) // 4))
    joint = dict(patch_size=1, in_channels=16, num_layers=dual, num_single_layers=layers - dual,
                 attention_head_dim=head, num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=64,
                 guidance_embeds=False, axes_dims_rope=(*rope, head - sum(rope)))
    return {
        "lm": Miniature("llama", lm, base_steps=20 if quick else 2000, base_lr=1e-3, batch_size=8 if quick else 32,
                        finetune_lr=1e-4, conversion={"options": {"chunk_size": chunk}},
                        variants=lm_variants),
        "dit": Miniature("dit", dit, base_steps=20 if quick else 3000, base_lr=3e-4, batch_size=16 if quick else 128,
                         finetune_lr=5e-5, conversion={"blocks": "4x4"}, variants=dit_variants),
        "joint": Miniature("flux", joint, base_steps=20 if quick else 3000, base_lr=3e-4,
                           batch_size=16 if quick else 128, finetune_lr=5e-5, conversion={"blocks": "4x4"},
                           variants=joint_variants, latent_size=16 if quick else 32),
    }


def save_random_base(mini: Miniature, directory: Path, seed: int) -> None:
    torch.manual_seed(seed)
    adapter_for_family(mini.family).build(mini.config).save_pretrained(str(directory))


# --- recipes ---------------------------------------------------------------------------------------


def recipe(
    model: str, data: Path, stages: list[dict], *, batch_size: int, lr: float, eval_every: int, conversion: dict | None,
    schedule: dict | None = None, precision: str = "no", keep_best: bool = False, objective: dict | None = None,
    seed: int = 0,
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
        "objective": objective or {},
        "precision": precision,
        "logging": {"every": 10, "trackers": []},
        "seed": seed,
    }


def run(spec: dict, out: Path) -> list[dict]:
    """Train a recipe afresh; its validation rows [{step, stage, validation_loss}]."""
    torch.set_num_threads(1)  # (--jobs processes share the host's cores; the work is on the GPU)
    shutil.rmtree(out, ignore_errors=True)
    Trainer(parse_recipe(yaml.safe_dump(spec)), out, resume=False, log=lambda *_: None).run()
    return [r for r in read_metrics(out / "metrics.jsonl") if "validation_loss" in r]


def variant_spec(mini: Miniature, name: str, trained: str, data: Path, args) -> tuple[dict, bool]:
    """The recipe of variant `name` and whether it starts with attention transfer."""
    _, section, transfer, objective = mini.variants[name]
    conversion = {**section}
    if section["ratio"] > 0:
        linear = section.get("attention") == "linear"  # (one block: no blocks option)
        shared = {k: v for k, v in mini.conversion.items() if not (k == "blocks" and linear)}
        conversion.update(shared)
        conversion["options"] = {**mini.conversion.get("options", {}), **section.get("options", {})}
    lr = args.finetune_lr or mini.finetune_lr
    stages = [{"name": "attention_transfer", "steps": args.transfer_steps, "lr": args.transfer_lr}] if transfer else []
    stages.append({"name": "finetune", "steps": args.finetune_steps + (0 if transfer else args.transfer_steps),
                   "train": "all", "lr": lr})
    return recipe(trained, data, stages, batch_size=mini.batch_size, lr=lr, eval_every=args.eval_every,
                  conversion=conversion, precision=args.precision, objective=objective, seed=args.seed), transfer


def train_base(kind: str, mini: Miniature, root: Path, args) -> list[dict]:
    """The original, trained from scratch (or reused from an earlier run into the same --out)."""
    base = root / kind / "base"
    if (base / "best").is_dir():
        return [r for r in read_metrics(base / "metrics.jsonl") if "validation_loss" in r]
    save_random_base(mini, root / kind / "random-init", args.seed)
    spec = recipe(str(root / kind / "random-init"), root / kind / "data",
                  [{"name": "finetune", "steps": mini.base_steps, "train": "all"}], batch_size=mini.batch_size,
                  lr=mini.base_lr, eval_every=max(mini.base_steps // 10, 1), conversion=None, precision=args.precision,
                  schedule={"name": "cosine", "warmup_steps": mini.base_steps // 20}, keep_best=True, seed=args.seed)
    return run(spec, base)


def train_variant(kind: str, name: str, mini: Miniature, root: Path, args) -> dict:
    tic = time.perf_counter()
    out = root / kind / "variants" / name
    spec, transfer = variant_spec(mini, name, str(root / kind / "base" / "best"), root / kind / "data", args)
    curve = run(spec, out)
    saved = json.loads((out / "model" / "mhla_config.json").read_text())
    result = {"conversion": spec["conversion"], "objective": spec["objective"], "transfer": transfer,
              "seconds": time.perf_counter() - tic, "converted_layers": saved["plan"]["layers"],
              "sensitivity": saved["plan"].get("sensitivity"), "retrieval_heads": saved["mhla"].get("retrieval_heads"),
              "curve": curve}
    (root / f"{kind}-{name}.json").write_text(json.dumps(result, default=str))  # (read if the run is cut short)
    return result


# --- what the final models do: noise levels (DiT), recall (LM) ---------------------------------------

NOISE_LEVELS = (50, 150, 300, 450, 700, 900)


def _load(path: Path, device: str):
    from mhla_convert import load_model

    return load_model(str(path)).to(device).eval()


@torch.no_grad()
def loss_by_noise_level(path: Path, data: Path, device: str) -> dict[int, float]:
    """ε-prediction MSE on the held-out images at fixed timesteps (the same noise for every model)."""
    from mhla_convert.train.recipe import ObjectiveSpec

    model, objective = _load(path, device), adapter_for_family("dit").objective(ObjectiveSpec())
    held = {k: v.to(device) for k, v in load_file(str(data / "heldout.safetensors")).items()}
    noise = torch.randn(held["latents"].shape, generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for t in NOISE_LEVELS:
        steps = torch.full((len(noise),), t, dtype=torch.long)
        pred, target = objective.prediction(model, held, steps, noise)
        out[t] = float(torch.nn.functional.mse_loss(pred, target))
    return out


@torch.no_grad()
def recall_bits(path: Path, data: Path, device: str) -> float:
    """Bits per byte on the second copy of each recall probe."""
    model = _load(path, device)
    ids = load_file(str(data / "recall.safetensors"))["input_ids"].to(device)
    logits = model(input_ids=ids, use_cache=False).logits[:, RECALL_SPAN - 1 : -1].float()
    nats = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, RECALL_SPAN:].flatten())
    return float(nats) / math.log(2)


# --- the benchmark ---------------------------------------------------------------------------------


def gap(loss: float, reference: float) -> float:
    return (loss - reference) / reference


def point(curve: list[dict], step: int | None = None, stage: str | None = None) -> float | None:
    rows = [r for r in curve if (step is None or r["step"] == step) and (stage is None or r["stage"] == stage)]
    return rows[-1]["gap"] if rows else None


REGION_OPTIONS = ("chunk_size", "exact_chunks", "exact_radius", "retrieval_heads")


def truncation_of(name: str, mini: Miniature) -> str | None:
    """The control whose step 0 is variant `name`'s truncation: the `local` variant cutting every layer to the
    same exact region (same chunking and span), if the variant converts every layer with one."""
    def region(section: dict) -> tuple:  # ("default": the option left to the family, unlike an explicit None)
        options = section.get("options", {})
        return (*(options.get(k, "default") for k in REGION_OPTIONS), section.get("retrieval_share"))

    _, section, _, _ = mini.variants[name]
    if section["ratio"] != 1 or section.get("attention", "mhla") not in ("mhla", "local"):
        return None
    return next((other for other, (_, s, _, _) in mini.variants.items()
                 if s.get("attention") == "local" and region(s) == region(section)), None)


def summarise(results: dict, minis: dict[str, Miniature], args) -> dict:
    """The summary the docs and issue tracker read: gaps at step 0, after transfer, at the end; truncation."""
    summary = {}
    for kind, res in results.items():
        curves = {name: v["curve"] for name, v in res["variants"].items()}
        variants = {}
        for name, curve in curves.items():
            key = "window" if (kind == "lm" and name == "local") else name
            control = truncation_of(name, minis[kind])
            variants[key] = {
                "step0": point(curve, 0),
                "truncation": point(curves[control], 0) if control in curves else None,
                "transfer": point(curve, args.transfer_steps, "attention_transfer"),
                "final": curve[-1]["gap"],
                "best": min(r["gap"] for r in curve),
            }
        summary[kind] = {"variants": variants}
        if kind == "dit":
            summary[kind]["tokens"] = minis[kind].config["sample_size"] ** 2
            summary[kind]["by_noise_level"] = res.get("by_noise_level")
        if kind == "joint":
            summary[kind]["tokens"] = (minis[kind].latent_size // 2) ** 2
        if kind == "lm":
            summary[kind]["recall"] = res.get("recall")
    return summary


def table(results: dict, summary: dict, args) -> str:
    lines = []
    for kind, res in results.items():
        steps = args.transfer_steps + args.finetune_steps
        lines += [f"**{kind}** (original's held-out loss {res['original_loss']:.4f})", "",
                  f"| variant | step 0 | truncation | after transfer | after {steps} steps | best |",
                  "|---|---|---|---|---|---|"]
        for name, v in res["variants"].items():
            s = summary[kind]["variants"]["window" if (kind == "lm" and name == "local") else name]
            cells = [s["step0"], s["truncation"], s["transfer"], s["final"], s["best"]]
            lines.append(f"| {v['label']} | " + " | ".join("—" if c is None else f"{c:+.1%}" for c in cells) + " |")
        lines.append("")
        levels = summary[kind].get("by_noise_level")
        if levels:
            lines += ["Held-out gap by noise level (final models):", "",
                      "| variant | " + " | ".join(f"t = {t}" for t in NOISE_LEVELS) + " |",
                      "|---|" + "---|" * len(NOISE_LEVELS)]
            for name, row in levels.items():
                if name != "original":
                    lines.append(f"| {name} | " + " | ".join(f"{row[str(t)]:+.1%}" for t in NOISE_LEVELS) + " |")
            lines.append("")
        recall = summary[kind].get("recall")
        if recall:
            lines += ["Long-range recall (bits per byte on the second copy of a 256-byte span):", "",
                      "| model | bits per byte |", "|---|---|"]
            lines += [f"| {name} | {bits:.3f} |" for name, bits in recall.items()]
            lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (kind, res) in zip(axes[0], results.items()):
        for v in res["variants"].values():
            ax.plot([r["step"] for r in v["curve"]], [100 * r["gap"] for r in v["curve"]], marker=".", label=v["label"])
        ax.set(title=f"{kind}: held-out loss gap to the original", xlabel="step", ylabel="gap (%)", yscale="symlog")
        ax.axhline(0, color="k", lw=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _run_all(jobs: list[tuple], workers: int) -> list:
    """fn(*args) for each (fn, *args), in `workers` processes at once (1: here, one after the other)."""
    if workers <= 1:
        return [fn(*a) for fn, *a in jobs]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [f.result() for f in [pool.submit(fn, *a) for fn, *a in jobs]]


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The miniatures, their data and the budget of every variant, --jobs and --quick (frontier.py trains with the
    same)."""
    parser.add_argument("--kinds", default="lm,dit", help="comma-separated miniatures: lm, dit, joint")
    parser.add_argument("--width", type=int, help="the miniatures' width (default 256; --quick 64)")
    parser.add_argument("--layers", type=int, help="the miniatures' layers (default 6; --quick 2)")
    parser.add_argument("--batch-size", type=int, help="training batch size (default: per miniature)")
    parser.add_argument("--transfer-steps", type=int, default=100)
    parser.add_argument("--transfer-lr", type=float, default=1e-3)
    parser.add_argument("--finetune-steps", type=int, default=400)
    parser.add_argument("--finetune-lr", type=float, help="default: per miniature")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--base-steps", type=int, help="steps of the originals' training (default: per miniature)")
    parser.add_argument("--jobs", type=int, default=1, help="variants trained at once, one process each")
    parser.add_argument("--copy-rows", type=float, default=0.0,
                        help="LM: fraction of training rows that repeat a 256-byte span, so that the original learns "
                             "long-range copying and the recall probe separates the designs")
    parser.add_argument("--lm-heads", default="4/2", help="LM: query / key heads per layer, e.g. 8/8 (default 4/2)")
    parser.add_argument("--seed", type=int, default=0,
                        help="another miniature: which tenth of the data is held out, the originals' initialisation "
                             "and the training order (default 0)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and steps: a CPU smoke run")


def settle_training(args: argparse.Namespace) -> argparse.Namespace:
    """--quick's tiny budget, and the training precision of the device."""
    if args.quick:
        args.transfer_steps, args.finetune_steps, args.eval_every = 2, 4, 2
    heads = args.lm_heads.split("/")
    if len(heads) != 2 or not all(h.isdigit() and int(h) > 0 for h in heads) or int(heads[0]) % int(heads[1]):
        raise SystemExit(f"--lm-heads must be QUERY/KEY heads, a multiple over a whole number, e.g. 8/8; "
                         f"got {args.lm_heads!r}")
    args.lm_heads = (int(heads[0]), int(heads[1]))
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not args.kinds or set(args.kinds) - {"lm", "dit", "joint"}:
        raise SystemExit(f"--kinds must name some of lm, dit, joint; got {','.join(args.kinds)!r}")
    args.precision = "bf16" if torch.cuda.is_available() else "no"
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", help="comma-separated (default: every variant of each kind)")
    add_training_arguments(parser)
    args = settle_training(parser.parse_args(argv))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    minis = {kind: mini for kind, mini in miniatures(args.quick, args.lm_heads, args.width, args.layers).items()
             if kind in args.kinds}
    chosen = None if args.variants is None else [v.strip() for v in args.variants.split(",")]
    known = set().union(*(m.variants for m in minis.values()))
    if chosen is not None and set(chosen) - known:
        parser.error(f"unknown variants {sorted(set(chosen) - known)}; choose from {sorted(known)}")
    args.out.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    for kind, mini in minis.items():
        mini.base_steps = args.base_steps or mini.base_steps
        mini.batch_size = args.batch_size or mini.batch_size
        write_data(kind, mini, args.out, args)
    bases = _run_all([(train_base, kind, mini, args.out, args) for kind, mini in minis.items()], args.jobs)
    results = {}
    for (kind, mini), curve in zip(minis.items(), bases):
        original = min(r["validation_loss"] for r in curve)  # the original is the best model by held-out loss
        results[kind] = {"original_loss": original, "base_training": curve, "variants": {}}
        print(f"[{kind}] original: held-out loss {original:.4f} ({time.perf_counter() - tic:.0f} s)", flush=True)
    names = [(kind, name) for kind, mini in minis.items() for name in mini.variants if chosen is None or name in chosen]
    done = _run_all([(train_variant, kind, name, minis[kind], args.out, args) for kind, name in names], args.jobs)
    for (kind, name), v in zip(names, done):
        label = minis[kind].variants[name][0].format(local="sliding window" if kind == "lm" else "truncation")
        v["curve"] = [{**r, "gap": gap(r["validation_loss"], results[kind]["original_loss"])} for r in v["curve"]]
        results[kind]["variants"][name] = {"label": label, **v}
        print(f"[{kind}] {label} ({v['seconds']:.0f} s): "
              + ", ".join(f"{r['step']}: {r['gap']:+.1%}" for r in v["curve"]), flush=True)
    for kind, res in results.items():
        data, original = args.out / kind / "data", args.out / kind / "base" / "best"
        models = {"original": original, **{name: args.out / kind / "variants" / name / "model"
                                           for name in res["variants"]}}
        if kind == "dit":
            losses = {name: loss_by_noise_level(path, data, device) for name, path in models.items()}
            res["by_noise_level"] = {name: {str(t): gap(row[t], losses["original"][t]) for t in NOISE_LEVELS}
                                     for name, row in losses.items()}
        elif kind == "lm":
            res["recall"] = {("window" if name == "local" else name): recall_bits(path, data, device)
                             for name, path in models.items()}
    summary = summarise(results, minis, args)
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "seconds": time.perf_counter() - tic, "args": vars(args)}
    (args.out / "fidelity.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    (args.out / "fidelity_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (args.out / "fidelity.md").write_text(table(results, summary, args))
    print(table(results, summary, args))
    try:
        plot(results, args.out / "fidelity.png")
    except ImportError:
        print("(no plot: matplotlib is not installed)")


if __name__ == "__main__":
    main()
