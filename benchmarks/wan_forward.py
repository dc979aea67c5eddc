"""Whole-transformer forward latency: a Wan2.1-1.3B-shaped `WanTransformer3DModel` (real config,
random weights) at 81x480x800 (31,500 tokens; --resolution 720p: 81x720x1280, 75,600 tokens), with --model
wan2.2-ti2v a Wan2.2-TI2V-5B-shaped one (48 latent channels of the Wan2.2 VAE, 4x16x16) at its 720p, 121x704x1280
(31x22x40 = 27,280 tokens), with --model sana a
SANA-1600M-shaped `SanaTransformer2DModel` (class defaults) at 1024 px and 4096 px, with --model dit a
DiT-XL/2-shaped `DiTTransformer2DModel` at 512 px (32x32 = 1,024 tokens), or with --model flux a FLUX.1-dev-shaped
`FluxTransformer2DModel` at 1024² and 2048² (64x64 and 128x128 packed tokens, 512 text tokens: joint text-image
MHLA), or with --model hunyuanvideo a HunyuanVideo-shaped
`HunyuanVideoTransformer3DModel` at 720p x 129 frames (33x45x80 = 118,800 video tokens, 256 text tokens; joint MHLA
as FLUX's), or with --model qwen-image a Qwen-Image-shaped `QwenImageTransformer2DModel` at
1328² (83x83 packed tokens, 512 text tokens; joint MHLA as FLUX's); original vs converted to
MHLA with the library's own `convert` (all layers, and for Wan the 2/3 hybrid that keeps softmax at 0, 3, …, 27).

    python benchmarks/wan_forward.py [--model wan|wan2.2-ti2v|sana|dit|flux|hunyuanvideo|qwen-image|wan-layer]
        [--backend auto|torch|triton]
        [--compile [--regional]]
        [--mode default|reduce-overhead] [--kernels N] [--resolution 480p|720p] [--repeats N]

--model wan-layer times one Wan self-attention module at 31,500 tokens piece by piece
(projections, q/k RMSNorm + RoPE, the attention op): where a layer's time goes.
bf16, batch 1, no grad; median of CUDA-event timings of whole forwards after warm-up. Each timing is also printed
to stderr as it is taken, so a run cut short still shows what it measured.

--compile also times every model under `torch.compile(model, fullgraph=True, dynamic=False)`: inductor's
default mode, what diffusers' and PyTorch's guides tell a diffusers user to write
(`pipe.transformer.compile(fullgraph=True)`). `--mode reduce-overhead` replays each compiled forward as CUDA
graphs: it matters where a forward is bound by the host's launches (SANA at 1024 px), and gains little on
forwards of tens of milliseconds and more. "max-autotune" spends minutes autotuning GEMMs cuBLAS already runs
well. Each shape compiles once, statically, in the warm-up (never timed); the table then shows every
variant eager and compiled, its speed-up over the original in the same mode, and compiled over eager.

--regional compiles each repeated block instead (`model.compile_repeated_blocks(fullgraph=True)`: diffusers'
regional compilation, which its guides give for large transformers; the compiled blocks are the model's own, so each
model is timed eager first). FLUX needs it: its forward reads the token grid from `img_ids` on the host, which a
whole-model fullgraph trace cannot.

--repeats N times N forwards after 2 warm-ups (default 7; fewer for forwards of many seconds, HunyuanVideo's).

--kernels N then profiles 3 forwards of every variant in each mode (torch.profiler) and prints its N kernels with
the most GPU time per forward, and its total kernel time: where a whole model's time goes, and how much of it the
attention takes. With --regional, the compiled variants only.

--tiny runs narrow 2-3-layer versions of every model but wan-layer on the CPU in float32 (perf_counter timings;
--compile traces with the "aot_eager" backend, no code generation; --kernels lists CPU ops): a smoke run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import date

import torch

from mhla_convert import convert

WAN_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6,
)
WAN22_TI2V_CONFIG = {**WAN_CONFIG, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48, "ffn_dim": 14336}
WAN22_TI2V_LATENTS = (31, 44, 80)  # 121x704x1280 through the Wan2.2 VAE (4x16x16), before the 1x2x2 patches
WAN_BLOCKS = (7, 3, 5)  # M = 105 over the 21x30x50 grid (and Wan2.2-TI2V's 31x22x40: blocks of 5x8x8 tokens)
# FLUX.1-dev's transformer config (black-forest-labs/FLUX.1-dev, transformer/config.json)
FLUX_CONFIG = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))
# --tiny: narrow, shallow models and small grids of the same kinds
TINY_FLUX = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8,
                 num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=12, guidance_embeds=True,
                 axes_dims_rope=(2, 2, 4))
TINY_HUNYUANVIDEO = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                         num_single_layers=2, num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=12,
                         rope_axes_dim=(2, 2, 4))
TINY_QWEN_IMAGE = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
                       num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
TINY_WAN = dict(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
                freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)
TINY_SANA = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                 num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
                 caption_channels=12, sample_size=16, patch_size=1)


@dataclass
class Setup:
    backend: str = "auto"
    compile: bool = False
    mode: str = "default"
    tiny: bool = False
    kernels: int = 0
    regional: bool = False
    repeats: int = 7
    resolution: str = "480p"
    ti2v: bool = False  # the Wan2.2-TI2V-5B shape

    @property
    def wan_config(self) -> dict:
        config = WAN22_TI2V_CONFIG if self.ti2v else WAN_CONFIG
        channels = {k: config[k] for k in ("in_channels", "out_channels")}
        return {**config, **({**TINY_WAN, **channels} if self.tiny else {})}

    @property
    def device(self) -> str:
        return "cpu" if self.tiny else "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.tiny else torch.bfloat16

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype)


def _time(fn, setup: Setup, warmup=2, reps=None) -> float:
    reps = reps or setup.repeats
    if setup.tiny:
        warmup, reps = 1, 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if setup.tiny:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _compiled(model, setup: Setup):
    """`model` under torch.compile as a diffusers user compiles a transformer (see the module docstring): a
    wrapper, so the eager model stays as it is; with --regional the model itself, its repeated blocks compiled."""
    how = {"backend": "aot_eager"} if setup.tiny else {"mode": setup.mode}
    if setup.regional:
        model.compile_repeated_blocks(fullgraph=True, dynamic=False, **how)
        return model
    return torch.compile(model, fullgraph=True, dynamic=False, **how)


def _compiled_call(model, call, setup: Setup):
    """call(model) under torch.compile, compiled on its first call (the warm-up, after the eager timings)."""
    compiled = []

    def fn():
        if not compiled:
            compiled.append(_compiled(model, setup))
        return call(compiled[0])

    return fn


def _measure(models: dict, call, setup: Setup, alternate=False) -> list[tuple[str, float, float | str | None]]:
    """(name, eager ms, compiled ms) of call(model) for every model; compiled is None without --compile and
    the error's first line where compiling failed. The first call of each compiled model (its warm-up)
    compiles it.

    `alternate`: the median over rounds that time every variant in turn: a host-bound model's time (SANA at
    1024 px) drifts with the host between calls, by more than the difference being measured, so each round
    times the variants back to back and the drift falls on all of them alike."""
    fns = {(name, "eager"): (lambda m=m: call(m)) for name, m in models.items()}
    if setup.compile:
        fns.update({(name, "compiled"): _compiled_call(m, call, setup) for name, m in models.items()})
    times, errors = {key: [] for key in fns}, {}
    with torch.no_grad():
        for _ in range(5 if alternate and not setup.tiny else 1):
            for key, fn in fns.items():
                if key in errors:
                    continue
                try:
                    times[key].append(_time(fn, setup))
                    print(f"  {key[0]}, {key[1]}: {times[key][-1]:.3f} ms", file=sys.stderr, flush=True)
                except Exception as e:  # noqa: BLE001 - a compile error goes in the table; eager ones raise
                    if key[1] == "eager":
                        raise
                    traceback.print_exc()
                    first = (str(e).strip().splitlines() or [""])[0].replace("|", "/")
                    errors[key] = f"{type(e).__name__}: {first}"
    if setup.kernels:  # (--regional: the eager models are compiled by now, so only the compiled are profiled)
        skip = {key for key in fns if key in errors or (setup.regional and key[1] == "eager")}
        profiled = {key: fn for key, fn in fns.items() if key not in skip}
        print(_kernel_profile(profiled, setup), flush=True)
    if setup.regional:  # the models' blocks eager again, for a later size's eager timings
        for module in (sub for model in models.values() for sub in model.modules()):
            module._compiled_call_impl = None  # (what nn.Module.compile sets)
    median = {key: statistics.median(t) for key, t in times.items() if t}
    return [(name, median[name, "eager"], errors.get((name, "compiled"), median.get((name, "compiled"))))
            for name in models]


def _kernel_profile(fns: dict, setup: Setup, forwards: int = 3) -> str:
    """Markdown: for every (variant, mode) of `fns`, its total kernel time per forward and its `setup.kernels`
    kernels with the most of it (with --tiny, CPU ops and CPU time), from torch.profiler over `forwards` forwards."""
    from torch.profiler import ProfilerActivity, profile

    gpu = not setup.tiny
    time_of = "self_device_time_total" if gpu else "self_cpu_time_total"

    def ms(event) -> float:
        return getattr(event, time_of) / forwards / 1e3

    lines = []
    with torch.no_grad():
        for (name, mode), fn in fns.items():
            with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
                for _ in range(forwards):
                    fn()
                if gpu:
                    torch.cuda.synchronize()
            on_gpu = torch.autograd.DeviceType.CUDA
            events = [e for e in prof.key_averages() if (e.device_type == on_gpu) == gpu]
            lines += [f"\n{name}, {mode}: {sum(map(ms, events)):.3f} ms of kernel time per forward",
                      "| kernel | calls per forward | ms per forward |", "|---|---|---|"]
            lines += [f"| {e.key[:100]} | {e.count / forwards:g} | {ms(e):.3f} |"
                      for e in sorted(events, key=ms, reverse=True)[: setup.kernels]]
    return "\n".join(lines)


def _converted(model, setup: Setup, **plan):
    tic = time.perf_counter()
    out = copy.deepcopy(model)
    convert(out, backend=setup.backend, **plan)
    print(f"  converted a copy in {time.perf_counter() - tic:.1f} s", file=sys.stderr, flush=True)
    return out


def _wan(setup: Setup, num_layers=30):
    from diffusers import WanTransformer3DModel

    config = {**setup.wan_config, **({} if setup.tiny else {"num_layers": num_layers})}
    with torch.device(setup.device):
        return WanTransformer3DModel(**config).to(setup.dtype).eval()


def bench_wan(setup: Setup):
    model = _wan(setup)
    layers, cfg = model.config.num_layers, model.config
    if setup.tiny:
        title = f"tiny Wan{'2.2-TI2V, 48 channels' if setup.ti2v else ''}, 3x4x4 tokens"
        x, blocks = setup.randn(1, cfg.in_channels, 3, 8, 8), (3, 2, 2)
    elif setup.ti2v:
        title = "Wan2.2-TI2V-5B-shaped, 121x704x1280 -> 31x22x40 = 27,280 tokens"
        x, blocks = setup.randn(1, cfg.in_channels, *WAN22_TI2V_LATENTS), WAN_BLOCKS
    elif setup.resolution == "720p":
        title = "Wan2.1-1.3B-shaped, 81x720x1280 -> 21x45x80 = 75,600 tokens"
        x, blocks = setup.randn(1, 16, 21, 90, 160), WAN_BLOCKS
    else:
        title = "Wan2.1-1.3B-shaped, 81x480x800 -> 21x30x50 = 31,500 tokens"
        x, blocks = setup.randn(1, 16, 21, 60, 100), WAN_BLOCKS
    text = setup.randn(1, 8 if setup.tiny else 512, cfg.text_dim)
    t = torch.tensor([500], device=setup.device)
    m = blocks[0] * blocks[1] * blocks[2]
    hybrid, kept = [i for i in range(layers) if i % 3], [i for i in range(layers) if not i % 3]
    kept_text = f"0,3,...,{kept[-1]}" if len(kept) > 2 else ",".join(map(str, kept))
    variants = {
        "original (SDPA)": model,
        f"all {layers} self-attentions -> MHLA ({setup.backend}), M={m}, own block exact":
            _converted(model, setup, blocks=blocks),
        f"all {layers} -> MHLA, no exact region": _converted(model, setup, blocks=blocks, exact_radius=None),
        f"{len(hybrid)} of {layers} -> MHLA ({setup.backend}), softmax at {kept_text}":
            _converted(model, setup, blocks=blocks, layers=hybrid),
    }
    return title, [_measure(variants, lambda m: m(x, t, text, return_dict=False), setup)]


def bench_wan_layer(setup: Setup):
    from triton.testing import do_bench

    from mhla_convert import mhla_layers
    from mhla_convert.ops import mhla_attention
    from mhla_convert.ops.rotary import InterleavedRotary

    backend = setup.backend
    model = _wan(setup, num_layers=1)
    rotary = model.rope(torch.randn(1, 16, 21, 60, 100, device="cuda", dtype=torch.bfloat16))
    attn = model.blocks[0].attn1
    mhla_model = _converted(model, setup, blocks=WAN_BLOCKS)
    layer = mhla_layers(mhla_model)[0][1]
    layer.token_grid.grid = grid = (21, 30, 50)
    h = torch.randn(1, 31500, 1536, device="cuda", dtype=torch.bfloat16)
    q, k, v = attn.to_q(h), attn.to_k(h), attn.to_v(h)
    rot = InterleavedRotary(*rotary)
    q4, k4, v4 = (t.unflatten(2, (12, -1)) for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q4, k4, v4))
    qk_norms = ((q, attn.norm_q), (k, attn.norm_k))
    pieces = {
        "original module (SDPA)": lambda: attn(h, None, None, rotary),
        f"MHLA module ({backend})": lambda: layer(h, rotary_emb=rotary),
        "q, k, v, out projections": lambda: (attn.to_q(h), attn.to_k(h), attn.to_v(h), attn.to_out[0](h)),
        "RMSNorm + RoPE of q and k, torch (the host's ops)":
            lambda: [rot.norm_rotate(t, n, 128, "torch") for t, n in qk_norms],
        "RMSNorm + RoPE of q and k, fused (ops.rotary)":
            lambda: [rot.norm_rotate(t, n, 128, backend) for t, n in qk_norms],
        f"MHLA op ({backend})":
            lambda: mhla_attention(q4, k4, v4, layer.mixing, grid=grid, blocks=WAN_BLOCKS, backend=backend),
        "SDPA op": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
    }
    with torch.no_grad():
        rows = [(name, do_bench(fn, warmup=25, rep=200, return_mode="median"), None) for name, fn in pieces.items()]
    return "one Wan2.1-1.3B self-attention module, 31,500 tokens (ms; speed-up column: vs the first row)", [rows]


def bench_sana(setup: Setup):
    from diffusers import SanaTransformer2DModel

    with torch.device(setup.device):
        model = SanaTransformer2DModel(**(TINY_SANA if setup.tiny else {})).to(setup.dtype).eval()
    cfg = model.config
    text = setup.randn(1, 8 if setup.tiny else 300, cfg.caption_channels)
    t = torch.tensor([500], device=setup.device)
    # (px, latent side, blocks): M = 16 and 64 (tiny: 4 and 16)
    sizes = ((1024, 8, (2, 2)), (4096, 16, (4, 4))) if setup.tiny else ((1024, 32, (4, 4)), (4096, 128, (8, 8)))
    groups = []
    for px, side, blocks in sizes:
        x = setup.randn(1, cfg.in_channels, side, side)
        mhla = _converted(model, setup, blocks=blocks)
        groups.append(_measure({f"{px} px original (SANA linear attention), {side}x{side} tokens": model,
                                f"{px} px MHLA ({setup.backend}), M={blocks[0] * blocks[1]}": mhla},
                               lambda m: m(x, text, t, return_dict=False), setup, alternate=True))
        del mhla
        torch._dynamo.reset()  # the next size compiles afresh
    return "tiny SANA" if setup.tiny else "SANA-1600M-shaped (class defaults)", groups


def flux_case(setup: Setup):
    """A FLUX.1-dev-shaped transformer (its real config) with 512 prompt tokens: (model, at(side) → call(model) of
    its forward at side x side packed tokens, text tokens)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    with torch.device(setup.device):
        model = FluxTransformer2DModel(**(TINY_FLUX if setup.tiny else FLUX_CONFIG)).to(setup.dtype).eval()
    cfg, text = model.config, 8 if setup.tiny else 512
    prompt, pooled = setup.randn(1, text, cfg.joint_attention_dim), setup.randn(1, cfg.pooled_projection_dim)
    t, guidance = setup.randn(1).abs().clamp(max=1), torch.full((1,), 3.5, device=setup.device, dtype=setup.dtype)
    txt_ids = torch.zeros(text, 3, device=setup.device, dtype=setup.dtype)

    def at(side: int):
        x = setup.randn(1, side * side, cfg.in_channels)
        img_ids = FluxPipeline._prepare_latent_image_ids(1, side, side, setup.device, setup.dtype)
        return lambda m: m(x, prompt, pooled, t, img_ids, txt_ids, guidance, return_dict=False)

    return model, at, text


def bench_flux(setup: Setup):
    """FLUX.1-dev-shaped at 1024² and 2048² (64x64 and 128x128 packed tokens) with 512 prompt tokens: the original
    against every joint attention converted (8x8 image blocks, the family's exact region, the text read exactly)."""
    model, at, text = flux_case(setup)
    # (px, token side, blocks): M = 64 (tiny: 4 and 16)
    sizes = ((1024, 8, (2, 2)), (2048, 16, (4, 4))) if setup.tiny else ((1024, 64, (8, 8)), (2048, 128, (8, 8)))
    groups = []
    for px, side, blocks in sizes:
        mhla = _converted(model, setup, blocks=blocks)
        groups.append(_measure({f"{px}² original, {side}x{side} + {text} text tokens": model,
                                f"{px}² joint MHLA, M={blocks[0] * blocks[1]}": mhla}, at(side), setup))
        del mhla
        torch._dynamo.reset()  # the next size compiles afresh
    return "tiny FLUX" if setup.tiny else "FLUX.1-dev-shaped (real config)", groups


def hunyuanvideo_case(setup: Setup):
    """A HunyuanVideo-shaped transformer (the class defaults are its config) and its forward at 720p x 129 frames
    (33x90x160 latents, 33x45x80 video tokens) with 256 prompt tokens: (model, call(model), video blocks for MHLA,
    video tokens, text tokens)."""
    from diffusers import HunyuanVideoTransformer3DModel

    with torch.device(setup.device):
        model = HunyuanVideoTransformer3DModel(**(TINY_HUNYUANVIDEO if setup.tiny else {})).to(setup.dtype).eval()
    cfg, text = model.config, 8 if setup.tiny else 256
    (frames, h, w), blocks = ((3, 8, 8), (3, 2, 2)) if setup.tiny else ((33, 90, 160), (11, 5, 5))
    x = setup.randn(1, cfg.in_channels, frames, h, w)
    prompt, pooled = setup.randn(1, text, cfg.text_embed_dim), setup.randn(1, cfg.pooled_projection_dim)
    mask = torch.ones(1, text, device=setup.device, dtype=torch.long)
    t, guidance = (torch.full((1,), v, device=setup.device, dtype=setup.dtype) for v in (500.0, 6000.0))
    return (model, lambda m: m(x, t, prompt, mask, pooled, guidance, return_dict=False), blocks,
            frames * (h // 2) * (w // 2), text)


def bench_hunyuanvideo(setup: Setup):
    """The original against every joint attention converted (11x5x5 video blocks, the family's exact region, the
    text read exactly), at `hunyuanvideo_case`'s shape."""
    model, call, blocks, tokens, text = hunyuanvideo_case(setup)
    variants = {f"original, {tokens:,} video + {text} text tokens": model,
                f"joint MHLA, M={blocks[0] * blocks[1] * blocks[2]}": _converted(model, setup, blocks=blocks)}
    groups = [_measure(variants, call, setup)]
    return "tiny HunyuanVideo" if setup.tiny else "HunyuanVideo-shaped (class defaults), 720p x 129 frames", groups


def qwen_image_case(setup: Setup):
    """A Qwen-Image-shaped transformer (the class defaults are its config) and its forward at 1328² (83x83 packed
    tokens) with 512 prompt tokens: (model, call(model), image blocks for MHLA, image tokens, text tokens)."""
    from diffusers import QwenImageTransformer2DModel

    with torch.device(setup.device):
        model = QwenImageTransformer2DModel(**(TINY_QWEN_IMAGE if setup.tiny else {})).to(setup.dtype).eval()
    cfg, text = model.config, 8 if setup.tiny else 512
    side, blocks = (8, (2, 2)) if setup.tiny else (83, (8, 8))
    x, prompt = setup.randn(1, side * side, cfg.in_channels), setup.randn(1, text, cfg.joint_attention_dim)
    t, shapes = setup.randn(1).abs().clamp(max=1), [[(1, side, side)]]
    return model, lambda m: m(x, prompt, None, t, shapes, return_dict=False), blocks, side * side, text


def bench_qwen_image(setup: Setup):
    """The original against every joint attention converted (8x8 image blocks, the family's exact region, the text
    read exactly), at `qwen_image_case`'s shape."""
    model, call, blocks, tokens, text = qwen_image_case(setup)
    side = round(tokens**0.5)
    variants = {f"original, {side}x{side} + {text} text tokens": model,
                f"joint MHLA, M={blocks[0] * blocks[1]}": _converted(model, setup, blocks=blocks)}
    groups = [_measure(variants, call, setup)]
    return "tiny Qwen-Image" if setup.tiny else "Qwen-Image-shaped (class defaults), 1328²", groups


def bench_dit(setup: Setup):
    from diffusers import DiTTransformer2DModel

    # DiT-XL/2 (28 layers, 16 heads of 72) on 512 px images: 64x64 latents, patch 2
    config = dict(num_attention_heads=16, attention_head_dim=72, num_layers=28, sample_size=64, in_channels=4,
                  out_channels=8, patch_size=2)
    if setup.tiny:
        config.update(num_attention_heads=2, attention_head_dim=8, num_layers=2, sample_size=8)
    with torch.device(setup.device):
        model = DiTTransformer2DModel(**config).to(setup.dtype).eval()
    side = config["sample_size"]
    x = setup.randn(1, 4, side, side)
    t, labels = torch.tensor([500], device=setup.device), torch.tensor([3], device=setup.device)
    blocks = (2, 2) if setup.tiny else (4, 4)
    tokens = (side // 2) ** 2
    variants = {f"original (SDPA), {tokens:,} tokens": model,
                f"MHLA ({setup.backend}), M={blocks[0] * blocks[1]}": _converted(model, setup, blocks=blocks)}
    groups = [_measure(variants, lambda m: m(x, timestep=t, class_labels=labels, return_dict=False), setup,
                       alternate=True)]
    return "tiny DiT" if setup.tiny else "DiT-XL/2-shaped, 512 px", groups


def report(title: str, groups: list, setup: Setup) -> str:
    """The Markdown rows of `groups` (lists of (name, eager ms, compiled ms or None)); speed-ups are against
    each group's first row, in the same mode."""
    device = "cpu" if setup.tiny else torch.cuda.get_device_name()
    dtype = "fp32" if setup.tiny else "bf16"
    lines = [f"\n{date.today()} {device} {dtype} batch 1 — {title}"]
    if setup.compile:
        mode = "" if setup.mode == "default" else f", mode={setup.mode!r}"
        how = "compile_repeated_blocks" if setup.regional else "torch.compile"
        lines[0] += f" — eager and {how}(fullgraph=True{mode})"
        lines += ["| variant | eager | speed-up | compiled | speed-up | compiled vs eager |", "|---" * 6 + "|"]
    for group in groups:
        _, base, base_compiled = group[0]
        for name, ms, compiled in group:
            line = f"| {name} | {ms:.3f} ms | {base / ms:.2f}x |"
            if isinstance(compiled, str):
                line += f" failed: {compiled} | - | - |"
            elif setup.compile:
                speedup = "-" if isinstance(base_compiled, str) else f"{base_compiled / compiled:.2f}x"
                line += f" {compiled:.3f} ms | {speedup} | {ms / compiled:.2f}x |"
            lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wan", choices=("wan", "wan2.2-ti2v", "sana", "dit", "flux", "hunyuanvideo",
                                                          "qwen-image", "wan-layer"))
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--compile", action="store_true", help="also time every model under torch.compile")
    ap.add_argument("--mode", default="default", choices=("default", "reduce-overhead"),
                    help="torch.compile's mode (with --compile)")
    ap.add_argument("--regional", action="store_true",
                    help="with --compile: compile each repeated block (diffusers' compile_repeated_blocks)")
    ap.add_argument("--repeats", type=int, default=7, metavar="N", help="timed forwards per variant (default 7)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also profile each variant and print its N kernels with the most time per forward")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke run (wan, sana, dit)")
    ap.add_argument("--resolution", default="480p", choices=("480p", "720p"),
                    help="--model wan: 81 frames at 480x800 (31,500 tokens) or 720x1280 (75,600 tokens)")
    args = ap.parse_args(argv)
    if args.mode != "default" and (not args.compile or args.tiny):
        ap.error("--mode needs --compile, on the GPU (--tiny compiles with the aot_eager backend)")
    if args.model == "wan-layer" and (args.compile or args.tiny or args.kernels):
        ap.error("--model wan-layer times one module's pieces on the GPU, without --compile, --kernels or --tiny")
    if args.resolution != "480p" and args.model == "wan2.2-ti2v":
        ap.error("--resolution is for --model wan (Wan2.1-1.3B); wan2.2-ti2v runs at its 720p, 121x704x1280")
    if args.regional and (not args.compile or args.model in ("sana", "dit", "wan-layer")):
        ap.error("--regional needs --compile and a model of repeated blocks timed in one round: wan, wan2.2-ti2v, "
                 "flux, hunyuanvideo or qwen-image")
    if args.repeats < 1:
        ap.error(f"--repeats must be a count ≥ 1; got {args.repeats}")
    if args.kernels < 0:
        ap.error(f"--kernels must be a count ≥ 0; got {args.kernels}")
    if not args.tiny and not torch.cuda.is_available():
        ap.error("the benchmark needs a CUDA GPU; --tiny runs tiny models on the CPU")
    setup = Setup(backend=args.backend, compile=args.compile, mode=args.mode, tiny=args.tiny, kernels=args.kernels,
                  resolution=args.resolution, ti2v=args.model == "wan2.2-ti2v", regional=args.regional,
                  repeats=args.repeats)
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: threads only add overhead, and contention on a shared CPU
    try:
        bench = {"wan": bench_wan, "wan2.2-ti2v": bench_wan, "sana": bench_sana, "dit": bench_dit,
                 "flux": bench_flux, "hunyuanvideo": bench_hunyuanvideo, "qwen-image": bench_qwen_image,
                 "wan-layer": bench_wan_layer}[args.model]
        title, groups = bench(setup)
    finally:
        torch.set_num_threads(threads)
    text = report(title, groups, setup)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
