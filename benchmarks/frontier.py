"""Speed–quality frontier: what each conversion ratio costs in held-out quality and buys in speed.

For each ratio 0.25 / 0.5 / 0.75 / 1.0 (1.0: every layer), two halves, each reusing another benchmark:

- **quality** (`fidelity.py`): its two miniatures (a byte-level Llama on the `transformers` package's source, a
  class-conditional DiT on scikit-learn's digits), each original trained from scratch, then converted with
  `strategy: auto` (the most sensitive layers stay softmax; at 1.0 it picks every layer) and trained with
  fidelity's recipes and budget: attention transfer, then fine-tuning. The held-out gap, (loss − original's loss) /
  original's loss, at step 0, after transfer and at the end, as fidelity scores it. A ratio converts
  round(ratio · layers) layers (Python rounds halves to even: 0.75 of 6 is 4).
- **speed** of the matching real shape, original and converted timed in the same process, bf16, batch 1, with
  `strategy: spread` (every layer costs the same, so which layers does not change the time):
  - `wan` (`wan_forward.py`): a Wan2.1-1.3B-shaped `WanTransformer3DModel`'s whole forward at 480p and 720p,
    81 frames (31,500 and 75,600 tokens), eager, median of CUDA-event timings after a warm-up;
  - `lm` (`lm_generate.py`): a Llama-3.2-1B-shaped model at prompts of 8,192 and 32,768 tokens: the prompt's
    forward (prefill) and the decoding step on transformers' static-cache path,
    `generate(cache_implementation="static")`'s compiled forward (`torch.compile(mode="reduce-overhead")` on a
    `StaticCache`; see lm_generate.py), ms per step over 255 new tokens;
  - the families' parts, by name (not in `--parts speed`): `flux`, `qwen-image` and `hunyuanvideo`, which pair
    with the joint miniature (`--kinds joint`), and `wan2.2`, which pairs with the DiT: the whole forward, eager, as
    `wan`, of a FLUX.1-dev-shaped `FluxTransformer2DModel` at 1024² and 2048² with 512 prompt tokens, a
    Qwen-Image-shaped one at 1328² (512), a HunyuanVideo-shaped one at 720p × 129 frames (256; one warm-up and one
    timed forward per ratio: the original's takes about 30 s) and a Wan2.2-TI2V-5B-shaped one at its 720p.

    python benchmarks/frontier.py --jobs 8 --out out/frontier             # all of it, GPU: about 10 minutes
    python benchmarks/frontier.py --parts quality --jobs 8 --out out/frontier   # about 4-5 minutes
    python benchmarks/frontier.py --parts speed --out out/frontier              # about 6 minutes
    python benchmarks/frontier.py --quick --out /tmp/frontier             # CPU smoke run, about a minute
    python benchmarks/frontier.py --parts quality --kinds joint --width 64 --layers 3 --batch-size 32 \
        --base-steps 2000 --jobs 2 --out out/joint                        # the joint families' gaps, CPU-sized
    python benchmarks/frontier.py --parts flux,qwen-image,hunyuanvideo,wan2.2 --out out/joint  # their speed, GPU

`--kinds`, `--width`, `--layers` and `--batch-size` choose and size the miniatures as in fidelity.py. A ratio that
converts as many layers as a smaller one (0.5 and 0.75 of 3) is trained once and reported at both.

Expected times on one H200: quality about 4-5 minutes with `--jobs 8` (the two originals side by side, about
1.5 minutes, then the 8 hybrids at once, 2.5-3 minutes; an --out that already holds the originals of a fidelity.py
or frontier.py run reuses them); `wan` about 1.5 minutes (two models at a time in memory, 5 variants × 2
resolutions); `lm` about 5 minutes, nearly all of it compiling (10 shapes, 20-40 s each, the first converted one
60-80 s on a cold compile cache). `--parts` runs a part alone (`speed` is `wan,lm`); later runs into the same --out
replace the parts they run and keep the others, and results are written after every measurement, so a run cut
short keeps what it measured.

Writes to --out: frontier.json (every number and curve, per part the date, GPU, dtype, versions and exact
command), frontier.md (one table: a row per ratio) and frontier.png (held-out gap against the speed-up of the
matching shape, a line per miniature and shape, points labelled by ratio; needs matplotlib). `--quick`: fidelity's
quick miniatures at 4 layers and its tiny budget, tiny Wan and Llama models on the CPU in float32 (prompts 64 and
128) — a smoke run.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import sys
import time
import traceback
from datetime import date
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # the scripts reused below, here and in fidelity's --jobs processes
import fidelity  # noqa: E402
import lm_generate  # noqa: E402
import wan_forward  # noqa: E402

RATIOS = (0.25, 0.5, 0.75, 1.0)
PARTS = ("quality", "wan", "lm", "flux", "qwen-image", "hunyuanvideo", "wan2.2")
SPEED_PARTS = ("wan", "lm")  # `--parts speed`; the families' parts by name (the joint ones pair with --kinds joint)
# the miniature each speed part pairs with
QUALITY_OF = {"wan": "dit", "lm": "lm", "flux": "joint", "qwen-image": "joint", "hunyuanvideo": "joint",
              "wan2.2": "dit"}
# the parts that time a whole diffusion forward by shape: (column name, the model timed)
FORWARD_PARTS = {"wan": ("Wan", "Wan2.1-1.3B-shaped"), "flux": ("FLUX", "FLUX.1-dev-shaped"),
                 "qwen-image": ("Qwen-Image", "Qwen-Image-shaped"), "hunyuanvideo": ("HunyuanVideo",
                                                                                    "HunyuanVideo-shaped"),
                 "wan2.2": ("Wan2.2", "Wan2.2-TI2V-5B-shaped")}
# wan_forward.py --resolution's latents of 81 frames (channels 16, patch 1x2x2); --quick: tiny grids of two sizes
WAN_LATENTS = {"480p": (21, 60, 100), "720p": (21, 90, 160)}
TINY_WAN_LATENTS = {"480p": (3, 8, 8), "720p": (3, 8, 12)}
WAN_REPS = (1, 5)  # warm-up forwards, timed forwards (median)


def _ver(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- quality: fidelity's miniatures, hybrids chosen by strategy auto ------------------------------------------


def variant_name(ratio: float) -> str:
    return f"auto-{round(100 * ratio)}"


def quality_miniatures(args) -> dict:
    """fidelity's miniatures of --kinds (--width, --layers, --batch-size as fidelity's) with the frontier's variants
    (--quick: 4 layers, so that every ratio converts a different number of them, scored and fitted on one
    calibration batch instead of 4)."""
    minis = {kind: mini for kind, mini in fidelity.miniatures(args.quick, args.lm_heads, args.width,
                                                              args.layers).items() if kind in args.kinds}
    section = {"strategy": "auto", **({"calibration_batches": 1} if args.quick else {})}
    for mini in minis.values():
        if args.quick:
            layers = {"llama": {"num_hidden_layers": 4}, "flux": {"num_layers": 1, "num_single_layers": 3}}
            mini.config.update(layers.get(mini.family, {"num_layers": 4}))
        mini.batch_size = args.batch_size or mini.batch_size
        mini.variants = {variant_name(r): (f"{r:.0%} auto", {"ratio": r, **section}, True, {}) for r in RATIOS}
    return minis


def num_layers(mini) -> int:
    if mini.family == "flux":  # dual-stream and single-stream blocks, one attention each
        return mini.config["num_layers"] + mini.config["num_single_layers"]
    return mini.config["num_hidden_layers" if mini.family == "llama" else "num_layers"]


def quality(args, save) -> dict:
    """{kind: {original_loss, layers, ratios: {ratio: gaps, converted layers, curve}}}."""
    minis = quality_miniatures(args)
    tic = time.perf_counter()
    for kind, mini in minis.items():
        mini.base_steps = args.base_steps or mini.base_steps
        fidelity.write_data(kind, mini, args.out, args)
    bases = fidelity._run_all([(fidelity.train_base, kind, mini, args.out, args)
                               for kind, mini in minis.items()], args.jobs)
    result = {}
    for (kind, mini), curve in zip(minis.items(), bases):
        original = min(r["validation_loss"] for r in curve)  # the original is its best model by held-out loss
        result[kind] = {"original_loss": original, "layers": num_layers(mini), "base_training": curve, "ratios": {}}
        print(f"[quality {kind}] original: held-out loss {original:.4f} ({time.perf_counter() - tic:.0f} s)",
              flush=True)
    # a ratio that converts as many layers as a smaller one converts the same ones (auto ranks them once): trained once
    converts = {(kind, ratio): round(ratio * num_layers(minis[kind])) for kind in minis for ratio in RATIOS}
    first = {}
    for (kind, ratio), n in converts.items():
        first.setdefault((kind, n), (kind, ratio))
    trained = dict(zip(first.values(), fidelity._run_all([(fidelity.train_variant, kind, variant_name(ratio),
                                                           minis[kind], args.out, args)
                                                          for kind, ratio in first.values()], args.jobs)))
    for (kind, ratio), n in converts.items():
        v = trained[first[kind, n]]
        curve = [{**r, "gap": fidelity.gap(r["validation_loss"], result[kind]["original_loss"])} for r in v["curve"]]
        result[kind]["ratios"][str(ratio)] = {
            "converted_layers": v["converted_layers"], "sensitivity": v["sensitivity"],
            "step0": fidelity.point(curve, 0),
            "transfer": fidelity.point(curve, args.transfer_steps, "attention_transfer"),
            "final": curve[-1]["gap"], "best": min(r["gap"] for r in curve),
            "conversion": v["conversion"], "seconds": v["seconds"], "curve": curve,
        }
        print(f"[quality {kind}] ratio {ratio} ({len(v['converted_layers'])} of {num_layers(minis[kind])} layers, "
              f"{v['seconds']:.0f} s): " + ", ".join(f"{r['step']}: {r['gap']:+.1%}" for r in curve), flush=True)
    save(result)
    return result


# --- speed: the Wan forward and Llama generation of wan_forward.py and lm_generate.py ---------------------------


def _ratio_speeds(setup, model, blocks, forwards: dict, result: dict, save, label: str, reps=WAN_REPS) -> dict:
    """Eager times of forwards[shape](variant) for `model` (result[shape]["original"]) and its conversion at each
    ratio (result[shape]["ratios"][ratio], with the speed-up), strategy spread, one converted copy in memory at a
    time, `reps` = (warm-up forwards, timed forwards); a failure is recorded and the run goes on."""
    from mhla_convert import mhla_layers

    for ratio in (0.0, *RATIOS):
        try:
            variant = model if not ratio else wan_forward._converted(model, setup, blocks=blocks, ratio=ratio,
                                                                     strategy="spread")
            made = None
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            traceback.print_exc()
            variant, made = None, _error(e)
        for shape, forward in forwards.items():
            row = {"converted_layers": 0 if variant is None else len(mhla_layers(variant))}
            try:
                if made:
                    raise RuntimeError(made)
                with torch.no_grad():
                    row["ms"] = wan_forward._time(lambda: forward(variant), setup, *reps)
            except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
                traceback.print_exc()
                row["error"] = _error(e)
            if not ratio:
                result[shape]["original"], result[shape]["original_ms"] = row, row.get("ms")
            else:
                base = result[shape]["original_ms"]
                row["speedup"] = base / row["ms"] if base and row.get("ms") else None
                result[shape]["ratios"][str(ratio)] = row
            print(f"[{label} {shape}] ratio {ratio}: " + (f"{row['ms']:.1f} ms" if "ms" in row else row["error"]),
                  flush=True)
            save(result)
        if variant is not model:
            del variant
            _free()
    return result


def wan_speed(args, save, ti2v: bool = False) -> dict:
    """{resolution: {tokens, original_ms, ratios: {ratio: {layers, ms, speedup}}}}, eager forwards of the Wan2.1-1.3B
    shape at 480p and 720p, or (`ti2v`) of the Wan2.2-TI2V-5B shape at its 720p."""
    setup = wan_forward.Setup(tiny=args.quick, ti2v=ti2v)
    model = wan_forward._wan(setup)
    cfg = model.config
    blocks = (3, 2, 2) if args.quick else wan_forward.WAN_BLOCKS
    text = setup.randn(1, 8 if args.quick else 512, cfg.text_dim)
    t = torch.tensor([500], device=setup.device)
    if ti2v:
        latents = {"720p": (3, 8, 8) if args.quick else wan_forward.WAN22_TI2V_LATENTS}
    else:
        latents = TINY_WAN_LATENTS if args.quick else WAN_LATENTS
    inputs = {res: setup.randn(1, cfg.in_channels, *shape) for res, shape in latents.items()}
    p = cfg.patch_size
    result = {res: {"latents": list(shape), "tokens": shape[0] // p[0] * (shape[1] // p[1]) * (shape[2] // p[2]),
                    "layers": cfg.num_layers, "blocks": list(blocks), "ratios": {}} for res, shape in latents.items()}
    forwards = {res: (lambda m, x=x: m(x, t, text, return_dict=False)) for res, x in inputs.items()}
    return _ratio_speeds(setup, model, blocks, forwards, result, save, "wan2.2" if ti2v else "wan")


def wan22_speed(args, save) -> dict:
    """`wan_speed` of a Wan2.2-TI2V-5B-shaped transformer (30 blocks) at its 720p, 121x704x1280 (27,280 tokens)."""
    return wan_speed(args, save, ti2v=True)


def flux_speed(args, save) -> dict:
    """{size: {tokens, original_ms, ratios: …}} as `wan_speed`'s, for a FLUX.1-dev-shaped transformer (19 dual- and
    38 single-stream blocks, each one joint attention) at 1024² and 2048² with 512 prompt tokens."""
    setup = wan_forward.Setup(tiny=args.quick)
    model, at, text = wan_forward.flux_case(setup)
    cfg = model.config
    sides, blocks = ({"1024²": 8, "2048²": 16}, (2, 2)) if args.quick else ({"1024²": 64, "2048²": 128}, (8, 8))
    result = {size: {"tokens": side * side, "text_tokens": text, "layers": cfg.num_layers + cfg.num_single_layers,
                     "blocks": list(blocks), "ratios": {}} for size, side in sides.items()}
    forwards = {size: at(side) for size, side in sides.items()}
    return _ratio_speeds(setup, model, blocks, forwards, result, save, "flux")


def _one_shape_speed(args, save, part: str, case, shape: str, layers, reps=WAN_REPS) -> dict:
    """{shape: {tokens, text_tokens, original_ms, ratios: …}} as `wan_speed`'s, for one of wan_forward.py's
    `*_case` models (model, call, blocks, tokens, text tokens) at its one shape; `layers(config)`: its attentions."""
    setup = wan_forward.Setup(tiny=args.quick)
    model, call, blocks, tokens, text = case(setup)
    result = {shape: {"tokens": tokens, "text_tokens": text, "layers": layers(model.config), "blocks": list(blocks),
                      "ratios": {}}}
    return _ratio_speeds(setup, model, blocks, {shape: call}, result, save, part, reps)


def qwen_image_speed(args, save) -> dict:
    """A Qwen-Image-shaped transformer (60 dual-stream blocks, each one joint attention) at 1328²."""
    return _one_shape_speed(args, save, "qwen-image", wan_forward.qwen_image_case, "1328²", lambda c: c.num_layers)


def hunyuanvideo_speed(args, save) -> dict:
    """A HunyuanVideo-shaped transformer (20 dual- and 40 single-stream blocks) at 720p x 129 frames; one warm-up and
    one timed forward per ratio (the original's takes about 30 s)."""
    return _one_shape_speed(args, save, "hunyuanvideo", wan_forward.hunyuanvideo_case, "720p×129",
                            lambda c: c.num_layers + c.num_single_layers, reps=WAN_REPS if args.quick else (1, 1))


def lm_speed(args, save) -> dict:
    """{model, prompts: {prompt: {original: lm_generate row, ratios: {ratio: row + speed-ups}}}}."""
    from mhla_convert import convert

    cuda = not args.quick
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    how = argparse.Namespace(new_tokens=args.new_tokens or (8 if args.quick else 256), tiny=args.quick,
                             compile="none" if args.quick else "reduce-overhead")
    prompts = (64, 128) if args.quick else (8192, 32768)
    config = {**lm_generate.CONFIGS["llama"][1], **(lm_generate.TINY["llama"] if args.quick else {})}
    result = {"model": lm_generate.CONFIGS["llama"][0], "layers": config["num_hidden_layers"], "batch": 1,
              "new_tokens": how.new_tokens,
              "compile": how.compile, "prompts": {str(p): {"ratios": {}} for p in prompts}}
    for ratio in (0.0, *RATIOS):
        try:
            model = lm_generate.build("llama", args.quick, device, dtype)
            layers = convert(model, ratio=ratio, strategy="spread").converted if ratio else []
            made = None
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            traceback.print_exc()
            model, layers, made = None, [], _error(e)
        for prompt in prompts:
            row = {"converted_layers": layers}
            try:
                if made:
                    raise RuntimeError(made)
                row.update(lm_generate.measure(model, how, prompt, 1, device))
            except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
                traceback.print_exc()
                row["error"] = _error(e)
            lm_generate._free(cuda)
            shape = result["prompts"][str(prompt)]
            if not ratio:
                shape["original"] = row
            else:
                base = shape.get("original", {})
                for key, name in (("prefill_ms", "prefill_speedup"), ("decode_ms_per_step", "decode_speedup")):
                    row[name] = base[key] / row[key] if base.get(key) and row.get(key) else None
                shape["ratios"][str(ratio)] = row
            print(f"[lm prompt {prompt}] ratio {ratio}: " + (
                f"prefill {row['prefill_ms']:.1f} ms, decode {row['decode_ms_per_step']:.3f} ms/step "
                f"(warm-up {row['warmup_s']:.0f} s)" if "error" not in row else row["error"]), flush=True)
            save(result)
        del model
        lm_generate._free(cuda)
    return result


# --- the frontier: one row per ratio ---------------------------------------------------------------------------


def _prompt_label(prompt: int) -> str:
    return f"{prompt // 1024}k" if prompt % 1024 == 0 else str(prompt)


KIND_NAMES = {"dit": "DiT", "lm": "LM", "joint": "Joint"}
LATER_NAMES = [name for part, (name, _) in FORWARD_PARTS.items() if part != "wan"]  # (the layers column's order)


def columns(data: dict) -> list[tuple[str, str, str]]:
    """(column, part, key) of the table's numbers, in order: those of the parts run (without any, the default
    ones')."""
    ran = {part for part in PARTS if data.get(part)} or {"quality", *SPEED_PARTS}
    paired = [QUALITY_OF[part] for part in PARTS[1:] if part in ran]  # (the miniatures the speed parts pair with)
    kinds = list(data.get("quality") or sorted(set(paired), key=list(KIND_NAMES).index))
    cols = [(f"{KIND_NAMES[kind]} gap", "quality", kind) for kind in kinds]
    for part in PARTS[1:]:
        if part == "lm" and "lm" in ran:
            prompts = list((data.get("lm") or {}).get("prompts") or (8192, 32768))
            cols += [(f"LM {step} {_prompt_label(int(p))}", "lm", f"{step}:{p}") for step in ("decode", "prefill")
                     for p in prompts]
        elif part in FORWARD_PARTS and part in ran:
            shapes = data.get(part) or (WAN_LATENTS if part == "wan" else {})
            cols += [(f"{FORWARD_PARTS[part][0]} {shape}", part, shape) for shape in shapes]
    return cols


def frontier_rows(data: dict) -> list[dict]:
    """Per ratio: every column's number (gaps: the final ones; speed-ups) or None, and the layers converted."""
    rows = []
    for ratio in RATIOS:
        key = str(ratio)
        row, layers = {"ratio": ratio}, {}
        for kind, res in (data.get("quality") or {}).items():
            v = res["ratios"].get(key)
            row[f"quality:{kind}"] = v and v["final"]
            row[f"quality:{kind}:step0"] = v and v["step0"]
            row[f"quality:{kind}:transfer"] = v and v["transfer"]
            if v:
                layers[KIND_NAMES[kind]] = f"{len(v['converted_layers'])}/{res['layers']}"
        for part, (name, _) in FORWARD_PARTS.items():
            for res, shape in (data.get(part) or {}).items():
                v = shape["ratios"].get(key, {})
                row[f"{part}:{res}"] = v.get("speedup")
                if "converted_layers" in v and name not in layers:
                    layers[name] = f"{v['converted_layers']}/{shape['layers']}"
        for prompt, shape in ((data.get("lm") or {}).get("prompts") or {}).items():
            v = shape["ratios"].get(key, {})
            row[f"lm:decode:{prompt}"], row[f"lm:prefill:{prompt}"] = v.get("decode_speedup"), v.get("prefill_speedup")
            if "converted_layers" in v and "Llama" not in layers:
                layers["Llama"] = f"{len(v['converted_layers'])}/{data['lm']['layers']}"
        row["layers"] = {name: layers[name] for name in ("DiT", "LM", "Joint", "Wan", "Llama", *LATER_NAMES)
                         if name in layers}
        rows.append(row)
    return rows


def _cell(value, part: str) -> str:
    if value is None:
        return "—"
    return f"{value:+.1%}" if part == "quality" else f"{value:.2f}x"


def table(data: dict) -> str:
    rows, cols = frontier_rows(data), columns(data)
    lines = ["| ratio | layers converted | " + " | ".join(name for name, _, _ in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for row in rows:
        layers = ", ".join(f"{name} {n}" for name, n in row["layers"].items()) or "—"
        lines.append(f"| {row['ratio']} | {layers} | "
                     + " | ".join(_cell(row.get(f"{part}:{key}"), part) for _, part, key in cols) + " |")
    notes = []
    q = data.get("quality")
    if q:
        budget = data["runs"]["quality"]["budget"]
        notes.append(f"Gaps: held-out loss of the miniature converted with strategy auto, after {budget['transfer']} "
                     f"attention-transfer and {budget['finetune']} fine-tuning steps, over the original's (originals: "
                     + ", ".join(f"{kind} {res['original_loss']:.4f}" for kind, res in q.items()) + "). "
                     "At step 0 / after transfer: "
                     + "; ".join(f"{kind} " + ", ".join(
                         f"{row['ratio']:g}: {_cell(row.get(f'quality:{kind}:step0'), 'quality')} / "
                         f"{_cell(row.get(f'quality:{kind}:transfer'), 'quality')}" for row in rows) for kind in q)
                     + ".")
    for part, (name, model) in FORWARD_PARTS.items():
        if data.get(part):
            notes.append(f"{name}: {model} whole forward, eager, original ms / converted ms (strategy spread); "
                         "originals " + ", ".join(f"{shape} ({_tokens(s)}) {_ms(s.get('original_ms'))}"
                                     for shape, s in data[part].items()) + ".")
    lm = data.get("lm")
    if lm:
        originals = [(p, s.get("original", {})) for p, s in lm["prompts"].items()]
        notes.append(f"LM: {lm['model']}-shaped, batch 1, strategy spread: decode step on the compiled static cache "
                     f"({lm['compile']}, {lm['new_tokens'] - 1} steps) and prefill, original ms / converted ms; "
                     "originals " + ", ".join(f"{_prompt_label(int(p))} decode {_ms(o.get('decode_ms_per_step'), 3)}"
                                              f"/step, prefill {_ms(o.get('prefill_ms'))}" for p, o in originals) + ".")
    for part, env in data.get("runs", {}).items():
        notes.append(f"{part}: {env['date']}, {env['gpu']}, {env['dtype']}, torch {env['torch']}, transformers "
                     f"{env['transformers']}, diffusers {env['diffusers']}; `{env['command']}`"
                     + (f"; FAILED: {env['error']}" if env.get("error") else ""))
    failed = [f"{part} ratio {v}: {e}" for part, v, e in errors(data)]
    if failed:
        notes.append("Failed: " + "; ".join(failed))
    return "\n".join(["# Speed–quality frontier", "", *lines, "", *(f"- {n}" for n in notes)]) + "\n"


def _tokens(shape: dict) -> str:
    text = shape.get("text_tokens")
    return f"{shape['tokens']:,} latent + {text} text tokens" if text else f"{shape['tokens']:,} tokens"


def _ms(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f} ms"


def errors(data: dict) -> list[tuple[str, str, str]]:
    out = []
    for part in FORWARD_PARTS:
        for res, shape in (data.get(part) or {}).items():
            rows = {"original": shape.get("original", {}), **shape["ratios"]}
            out += [(f"{part} {res}", r, v["error"]) for r, v in rows.items() if "error" in v]
    for prompt, shape in ((data.get("lm") or {}).get("prompts") or {}).items():
        rows = {"original": shape.get("original", {}), **shape["ratios"]}
        out += [(f"lm {prompt}", r, v["error"]) for r, v in rows.items() if "error" in v]
    return out


def plot(data: dict, path: Path) -> bool:
    """Draw the frontier to `path`; False (nothing drawn) without both a gap and a speed-up."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = frontier_rows(data)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    drawn = False
    for name, part, key in columns(data):
        if part == "quality":
            continue
        kind = QUALITY_OF[part]
        points = [(row[f"{part}:{key}"], 100 * row[f"quality:{kind}"], row["ratio"]) for row in rows
                  if row.get(f"{part}:{key}") is not None and row.get(f"quality:{kind}") is not None]
        if not points:
            continue
        xs, ys, _ = zip(*points)
        drawn = True
        shape = name.replace("LM ", "Llama ")
        ax.plot(xs, ys, marker="o", ls="--" if part == "lm" else "-", label=f"{kind} gap vs {shape} speed-up")
        for x, y, label in points:
            ax.annotate(f"{label:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(  # (2x, 3x, 5x; 0.2x, ...: not every tick)
        lambda v, _: f"{v:g}x" if f"{v:.0e}"[0] in "235" else ""))
    ax.set(xlabel="speed-up of the matching shape (original time / converted time)",
           ylabel="held-out loss gap to the original (%)",
           title="Speed–quality frontier: ratio of layers converted (labels)")
    ax.axhline(0, color="k", lw=0.5)
    ax.axvline(1, color="k", lw=0.5)
    if drawn:
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


# --- the run ---------------------------------------------------------------------------------------------------


def environment(args, part: str) -> dict:
    gpu = torch.cuda.is_available() and (part == "quality" or not args.quick)  # (the trainer takes a GPU if any)
    if part == "quality":
        dtype = "bfloat16 autocast" if args.precision == "bf16" else "float32"
    else:
        dtype = "float32" if args.quick else "bfloat16"
    return {"date": str(date.today()), "gpu": torch.cuda.get_device_name() if gpu else "cpu", "dtype": dtype,
            "torch": torch.__version__, "transformers": _ver("transformers"), "diffusers": _ver("diffusers"),
            "python": platform.python_version(), "quick": args.quick,
            "command": shlex.join(["python", "benchmarks/frontier.py", *args.argv])}


class Results:
    """--out/frontier.json, .md (and .png at the end), rewritten after every measurement. A part run now replaces
    the same part of an earlier run into the same --out (one of the same --quick); the other parts stay."""

    def __init__(self, args):
        self.out, self.path = args.out, args.out / "frontier.json"
        old = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data = old if old.get("quick") == args.quick and old.get("ratios") == list(RATIOS) else {}
        self.data.update(ratios=list(RATIOS), quick=args.quick)
        self.data.setdefault("runs", {})

    def start(self, part: str, env: dict) -> None:
        self.data["runs"][part] = env
        self.data[part] = None
        self._tic = time.perf_counter()

    def save(self, part: str, result) -> None:
        self.data[part] = result
        self.data["runs"][part]["seconds"] = time.perf_counter() - self._tic
        self.data["frontier"] = frontier_rows(self.data)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "frontier.md").write_text(table(self.data))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="quality,speed",
                        help=f"comma-separated: {', '.join(PARTS)}, speed (= wan,lm); the speed parts need a GPU "
                             "unless --quick")
    parser.add_argument("--new-tokens", type=int, help="LM: new tokens per generation (default 256; --quick 8)")
    fidelity.add_training_arguments(parser)
    args = fidelity.settle_training(parser.parse_args(argv))
    args.argv = sys.argv[1:] if argv is None else list(argv)
    asked = {p.strip() for p in args.parts.split(",") if p.strip()}
    parts = [p for p in PARTS if p in asked or (p in SPEED_PARTS and "speed" in asked)]
    if not parts or asked - {*PARTS, "speed"}:
        parser.error(f"--parts: expected a comma-separated list of {', '.join(PARTS)}, speed; got {args.parts!r}")
    if set(parts) - {"quality"} and not args.quick and not torch.cuda.is_available():
        parser.error("the speed parts need a CUDA GPU; --quick runs tiny models on the CPU (or --parts quality)")
    if args.new_tokens is not None and args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the prompt's forward gives the first)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(args)
    tic, failed = time.perf_counter(), []
    for part in parts:
        env = environment(args, part)
        if part == "quality":
            env["budget"] = {"transfer": args.transfer_steps, "finetune": args.finetune_steps,
                             "transfer_lr": args.transfer_lr, "finetune_lr": args.finetune_lr,
                             "eval_every": args.eval_every, "base_steps": args.base_steps, "jobs": args.jobs,
                             "copy_rows": args.copy_rows}
        print(f"== {part} ({time.perf_counter() - tic:.0f} s): " + " ".join(f"{k}={v}" for k, v in env.items()),
              flush=True)
        results.start(part, env)
        threads = torch.get_num_threads()
        if args.quick and part != "quality":
            torch.set_num_threads(1)  # tiny ops: threads only add overhead, and contention on a shared CPU
        try:
            run = {"quality": quality, "wan": wan_speed, "lm": lm_speed, "flux": flux_speed,
                   "qwen-image": qwen_image_speed, "hunyuanvideo": hunyuanvideo_speed, "wan2.2": wan22_speed}[part]
            run(args, lambda result, part=part: results.save(part, result))
        except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
            traceback.print_exc()
            failed.append(part)
            results.data["runs"][part]["error"] = _error(e)
            results.save(part, results.data[part])
        finally:
            torch.set_num_threads(threads)
            _free()
    text = table(results.data)
    print(text, flush=True)
    try:
        if not plot(results.data, args.out / "frontier.png"):
            print("(no plot: it needs the quality part and a speed part in --out)")
    except ImportError:
        print("(no plot: matplotlib is not installed)")
    print(f"done in {time.perf_counter() - tic:.0f} s; results in {args.out}", flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (see the tracebacks above)")
    return results.data


if __name__ == "__main__":
    main()
