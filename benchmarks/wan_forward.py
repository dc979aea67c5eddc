"""Whole-transformer forward latency: a Wan2.1-1.3B-shaped `WanTransformer3DModel` (real config,
random weights) at 81x480x800 (31,500 tokens), or with --model sana a SANA-1600M-shaped
`SanaTransformer2DModel` (class defaults) at 1024 px and 4096 px; original vs converted to MHLA
with the library's own `convert` (all layers, and for Wan the 2/3 hybrid that keeps softmax at
0, 3, …, 27).

    python benchmarks/wan_forward.py [--model wan|sana|wan-layer] [--backend auto|torch|triton]

--model wan-layer times one Wan self-attention module at 31,500 tokens piece by piece
(projections, q/k RMSNorm + RoPE, the attention op): where a layer's time goes.
bf16, batch 1, no grad; median of CUDA-event timings of whole forwards after warm-up.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from datetime import date

import torch

from mhla_convert import convert

WAN_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6,
)
WAN_BLOCKS = (7, 3, 5)  # M = 105 over the 21x30x50 grid


def _time(fn, warmup=2, reps=7) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _alternated(fns: dict, rounds=5) -> dict:
    """Median of `_time` over `rounds` rounds that run every fn in turn: a host-bound model's time (SANA at
    1024 px) drifts with the host between calls, by more than the difference being measured, so each round
    times the variants back to back and the drift falls on all of them alike."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_time(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def _converted(model, backend, **plan):
    out = copy.deepcopy(model)
    convert(out, backend=backend, **plan)
    return out


def _wan(num_layers=30):
    from diffusers import WanTransformer3DModel

    with torch.device("cuda"):
        return WanTransformer3DModel(**{**WAN_CONFIG, "num_layers": num_layers}).to(torch.bfloat16).eval()


def bench_wan(backend):
    model = _wan()
    x = torch.randn(1, 16, 21, 60, 100, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")
    variants = {
        "original (SDPA)": model,
        f"all 30 self-attentions -> MHLA ({backend}), M=105": _converted(model, backend, blocks=WAN_BLOCKS),
        f"20 of 30 -> MHLA ({backend}), softmax at 0,3,...,27": _converted(
            model, backend, blocks=WAN_BLOCKS, layers=[i for i in range(30) if i % 3]),
    }
    with torch.no_grad():
        rows = [(name, _time(lambda: m(x, t, text, return_dict=False))) for name, m in variants.items()]
    return "Wan2.1-1.3B-shaped, 81x480x800 -> 21x30x50 = 31,500 tokens", rows


def bench_wan_layer(backend):
    from triton.testing import do_bench

    from mhla_convert import mhla_layers
    from mhla_convert.ops import mhla_attention
    from mhla_convert.ops.rotary import InterleavedRotary

    model = _wan(num_layers=1)
    rotary = model.rope(torch.randn(1, 16, 21, 60, 100, device="cuda", dtype=torch.bfloat16))
    attn = model.blocks[0].attn1
    mhla_model = _converted(model, backend, blocks=WAN_BLOCKS)
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
        rows = [(name, do_bench(fn, warmup=25, rep=200, return_mode="median")) for name, fn in pieces.items()]
    return "one Wan2.1-1.3B self-attention module, 31,500 tokens (ms; speed-up column: vs the first row)", rows


def bench_sana(backend):
    from diffusers import SanaTransformer2DModel

    with torch.device("cuda"):
        model = SanaTransformer2DModel().to(torch.bfloat16).eval()
    cfg = model.config
    text = torch.randn(1, 300, cfg.caption_channels, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")
    rows = []
    with torch.no_grad():
        for px, side, blocks in ((1024, 32, (4, 4)), (4096, 128, (8, 8))):  # M = 16 and 64
            x = torch.randn(1, cfg.in_channels, side, side, device="cuda", dtype=torch.bfloat16)
            mhla = _converted(model, backend, blocks=blocks)
            rows += _alternated({f"{px} px original (SANA linear attention), {side}x{side} tokens":
                                 lambda: model(x, text, t, return_dict=False),
                                 f"{px} px MHLA ({backend}), M={blocks[0] * blocks[1]}":
                                 lambda m=mhla: m(x, text, t, return_dict=False)}).items()
            del mhla
    return "SANA-1600M-shaped (class defaults)", rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wan", choices=("wan", "sana", "wan-layer"))
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    args = ap.parse_args()
    title, rows = {"wan": bench_wan, "sana": bench_sana, "wan-layer": bench_wan_layer}[args.model](args.backend)
    print(f"\n{date.today()} {torch.cuda.get_device_name()} bf16 batch 1 — {title}")
    base = rows[0][1]
    for name, ms in rows:
        if name.endswith("tokens"):
            base = ms
        print(f"| {name} | {ms:.3f} ms | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
