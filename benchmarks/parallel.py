"""Beyond one GPU: context-parallel forwards of a Wan2.1-1.3B-shaped model at 720p x 81 frames, and one FSDP2
fine-tuning step of a converted Wan2.1-14B-shaped model.

- Wan forward on 1, 2 and 4 GPUs (`--gpus`): the original with diffusers' context parallelism (its ulysses and ring
  attention, `enable_parallelism(config=ContextParallelConfig(...))`) against the all-MHLA conversion with each form
  of `ops.context_parallel` (ulysses_degree: the ulysses form; ring_degree: the summaries exchange), bf16, batch 1;
  median ms of CUDA-event-timed forwards after warm-up, speed-up over one GPU, and the bytes each rank sends per
  self-attention layer (from the shapes: what each form's collectives carry).
- FSDP2 on 4 GPUs: the Wan2.1-14B-shaped transformer converted to MHLA, and the original (or a 2/3 hybrid) beside it
  (`--fsdp-variants`), `fully_shard` per block (bf16 compute, float32 reduction and master weights), gradient
  checkpointing, one AdamW step at 480p x 81 frames: peak memory per GPU and step time.

Writes `docs/bench/parallel.json`: {"wan_720p_mhla_ms": {"1": t, "2": t, "4": t}, "wan_720p_original_ms": {...},
"fsdp_wan14b": {"ok": true, "gpus": 4, "peak_gib": x, "step_s": y}} (the faster form per GPU count), plus each
form's times and bytes and the other models' FSDP2 steps (`fsdp_wan14b_original`, `fsdp_wan14b_hybrid`). `--quick`
runs the same code on the CPU over gloo at tiny shapes (a smoke run).

    python benchmarks/parallel.py                       # 1, 2 and 4 GPUs of one machine
    python benchmarks/parallel.py --quick --out /tmp/parallel.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6)
WAN_14B = {**WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
LATENTS_720P = (16, 21, 90, 160)  # 81 frames at 720 x 1280 -> 21 x 45 x 80 = 75,600 tokens
LATENTS_480P = (16, 21, 60, 104)  # 81 frames at 480 x 832 -> 21 x 30 x 52 = 32,760 tokens
TEXT_TOKENS = 512
FORMS = {"ulysses": "ulysses_degree", "ring": "ring_degree"}  # MHLA: ring_degree runs the summaries exchange


def quick_shapes() -> dict:
    from mhla_convert.models import tiny_models

    tiny = tiny_models()["tiny-wan"][1]
    return dict(wan=tiny, big=tiny, latents=(4, 3, 8, 12), train_latents=(4, 3, 8, 8), text=(8, tiny["text_dim"]))


def full_shapes() -> dict:
    return dict(wan=WAN_1_3B, big=WAN_14B, latents=LATENTS_720P, train_latents=LATENTS_480P,
                text=(TEXT_TOKENS, WAN_1_3B["text_dim"]))


def _setup(rank: int, world: int, path: str, quick: bool) -> torch.device:
    if quick:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        # diffusers places rank % torch.accelerator.device_count(), 0 without an accelerator: one CPU "device"
        torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo" if quick else "nccl", init_method=f"file://{path}", rank=rank, world_size=world)
    device = torch.device("cpu") if quick else torch.device("cuda", rank)
    if not quick:
        torch.cuda.set_device(device)
    return device


def _time(fn, device, warmup: int, reps: int) -> float:
    """Median ms of `fn()` (CUDA events on GPUs, wall clock on the CPU), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def exchanged_bytes(config: dict, latents, world: int, *, variant: str, form: str, blocks=(7, 3, 5)) -> int:
    """Bytes one rank sends per self-attention layer at batch 1 in bf16 (float32 summaries): ulysses, 4 all-to-alls
    (q, k, v, output) of its shard minus its own part; diffusers' ring, its shard's k and v to every other rank
    (all-gather rotation); the summaries exchange, a ring all-reduce of B·H·M·D·(D+1) floats (2·(W−1)/W of it) and
    the halo of Wan's own-block exact region (the rest of the block rows its tokens cut, at most two)."""
    if world == 1:
        return 0
    heads, dim = config["num_attention_heads"], config["attention_head_dim"]
    grid = [n // p for n, p in zip(latents[1:], config["patch_size"])]
    shard = math.prod(grid) // world
    if form == "ulysses":
        return 4 * shard * heads * dim * 2 * (world - 1) // world
    if variant == "original":
        return 2 * shard * heads * dim * 2 * (world - 1)
    m = math.prod(min(g, b) for g, b in zip(grid, blocks))
    block_row = -(-grid[0] // min(grid[0], blocks[0])) * math.prod(grid[1:])
    return 2 * (world - 1) * heads * m * dim * (dim + 1) * 4 // world + 2 * block_row * heads * 2 * dim * 2


def _wan_job(rank, world, path, quick, out):
    """One world size: the original and the conversion, each with every form (one GPU: plain), timed."""
    from diffusers import ContextParallelConfig, WanTransformer3DModel

    from mhla_convert import convert
    from mhla_convert.placement import place_model

    device = _setup(rank, world, path, quick)
    shapes = quick_shapes() if quick else full_shapes()
    dtype = torch.float32 if quick else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, *shapes["latents"], generator=g).to(device, dtype),
                  timestep=torch.tensor([500], device=device),
                  encoder_hidden_states=torch.randn(1, *shapes["text"], generator=g).to(device, dtype),
                  return_dict=False)
    warmup, reps = (1, 2) if quick else (2, 5)
    results = {}
    for variant in ("original", "mhla"):
        for form in FORMS if world > 1 else ("none",):
            if quick and variant == "original" and form == "ring":
                continue  # diffusers' ring attention needs a backend that returns the log-sum-exp: none on the CPU
            torch.manual_seed(0)
            with torch.device(device):  # (its float32 modules kept so, as diffusers' loader keeps them)
                model = place_model(WanTransformer3DModel.from_config(shapes["wan"]), dtype, device).eval()
            if variant == "mhla":
                convert(model, progress=False)
            if variant == "original" and form == "ring":
                model.set_attention_backend("_native_cudnn")  # a ring-capable backend (the native one is not)
            if world > 1:
                model.enable_parallelism(config=ContextParallelConfig(**{FORMS[form]: world}))
            with torch.no_grad():
                ms = _time(lambda: model(**inputs), device, warmup, reps)
            results[f"{variant}/{form}"] = {
                "ms": ms, "bytes_per_layer": exchanged_bytes(shapes["wan"], shapes["latents"], world, variant=variant,
                                                             form=form)}
            model = None  # (freed before the next one is built)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    _leave(quick)


def _fsdp_job(rank, world, path, quick, out, variant):
    """One AdamW step of the 14B-shaped model under FSDP2, converted (`variant` "mhla"), two thirds converted
    ("hybrid", softmax kept in every third layer) or as it is ("original"): peak memory and step time."""
    from diffusers import WanTransformer3DModel
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mhla_convert import convert
    from mhla_convert.families import adapter_for_model

    device = _setup(rank, world, path, quick)
    shapes = quick_shapes() if quick else full_shapes()
    with torch.device("meta"):  # sharded before any weight exists, then materialised shard by shard
        model = WanTransformer3DModel.from_config(shapes["big"])
    if variant != "original":
        convert(model, ratio=1.0 if variant == "mhla" else 2 / 3, progress=False)
    model.enable_gradient_checkpointing()
    adapter_for_model(model).prepare_checkpointing(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32 if quick else torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    config = model.config  # (to_empty leaves buffers uninitialised: the rotary tables are computed again)
    tables = type(model.rope)(config.attention_head_dim, config.patch_size, config.rope_max_seq_len)
    with torch.no_grad():
        for name, p in model.named_parameters():  # random weights: only time and memory are measured
            p.normal_(0, 0.02) if p.dim() > 1 and "mixing" not in name else p.fill_(1.0 if "norm" in name else 0.1)
        for name, buffer in tables.named_buffers():
            model.rope.get_buffer(name).copy_(buffer)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(rank)
    latents = torch.randn(1, *shapes["train_latents"], generator=g).to(device)
    text = torch.randn(1, *shapes["text"], generator=g).to(device)

    def step():
        out = model(latents, timestep=torch.tensor([500], device=device), encoder_hidden_states=text,
                    return_dict=False)[0]
        torch.nn.functional.mse_loss(out.float(), latents).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = _time(step, device, 1, 1 if quick else 3) / 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        Path(out).write_text(json.dumps({"ok": True, "gpus": world, "peak_gib": max(peaks), "step_s": seconds}))
    _leave(quick)


def _leave(quick: bool) -> None:
    """The end of a worker: its process group destroyed. On the CPU (gloo, --quick) the worker then exits at once:
    the interpreter's own teardown there now and then aborts on a C++ thread left running, after the work is done."""
    dist.destroy_process_group()
    if quick:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _run(job, world: int, quick: bool, *extra) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.spawn(job, args=(world, str(Path(tmp) / "rendezvous"), quick, str(out), *extra), nprocs=world, join=True)
        return json.loads(out.read_text())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="1,2,4", help="world sizes of the Wan forward (default 1,2,4; 0: skip)")
    parser.add_argument("--fsdp-gpus", type=int, default=4, help="GPUs of the FSDP step (default 4; 0: skip)")
    parser.add_argument("--fsdp-variants", default="mhla,original",
                        help="models of the FSDP step: mhla (the conversion), hybrid (two thirds converted), "
                             "original (default mhla,original)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: gloo, tiny shapes, world sizes 1 and 2")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "parallel.json"))
    args = parser.parse_args(argv)
    unknown = set(args.fsdp_variants.split(",")) - {"mhla", "hybrid", "original"}
    if unknown:
        raise SystemExit(f"--fsdp-variants takes mhla, hybrid and original; got {sorted(unknown)}")
    worlds = [1, 2] if args.quick else [int(w) for w in args.gpus.split(",") if int(w)]
    fsdp_gpus = 2 if args.quick and args.fsdp_gpus else args.fsdp_gpus
    if not args.quick and max(worlds + [fsdp_gpus]) > torch.cuda.device_count():
        raise SystemExit(f"needs {max(worlds + [fsdp_gpus])} GPUs, found {torch.cuda.device_count()}; "
                         "lower --gpus / --fsdp-gpus, or --quick for a CPU smoke run")
    result = {"wan_720p_mhla_ms": {}, "wan_720p_original_ms": {}, "wan_720p_by_form": {}}
    for world in worlds:
        rows = _run(_wan_job, world, args.quick)
        result["wan_720p_by_form"][str(world)] = rows
        for variant in ("mhla", "original"):
            times = [r["ms"] for key, r in rows.items() if key.startswith(variant + "/")]
            result[f"wan_720p_{variant}_ms"][str(world)] = min(times)
        print(f"{world} GPU(s): " + ", ".join(f"{k} {r['ms']:.1f} ms ({r['bytes_per_layer'] / 2**20:.1f} MiB/layer)"
                                              for k, r in rows.items()), flush=True)
    for variant in ("mhla", "original"):
        times = result[f"wan_720p_{variant}_ms"]
        if "1" in times:
            result[f"wan_720p_{variant}_speedup"] = {w: times["1"] / t for w, t in times.items()}
    for variant in args.fsdp_variants.split(",") if fsdp_gpus else []:
        key = "fsdp_wan14b" + ("" if variant == "mhla" else f"_{variant}")
        result[key] = _run(_fsdp_job, fsdp_gpus, args.quick, variant)
        print(f"FSDP2 step, {variant}: {result[key]}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
