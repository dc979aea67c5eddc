"""Whole-transformer forward latency: a Wan2.1-1.3B-shaped `WanTransformer3DModel` (real config,
random weights) at 81x480x800 (31,500 tokens), or with --model sana a SANA-1600M-shaped
`SanaTransformer2DModel` (class defaults) at 1024 px and 4096 px; original vs self-attention
swapped for MHLA (all layers, and for Wan the 2/3 hybrid that keeps softmax at 0, 3, …, 27).

    python benchmarks/wan_forward.py [--model wan|sana] [--backend auto|torch|triton]

The swap is a small attention processor that projects q/k/v with the module's own weights and
calls `mhla_attention` (the converter is the library's way; this keeps the benchmark standalone).
bf16, batch 1, no grad; median of CUDA-event timings of whole forwards after warm-up.
"""

from __future__ import annotations

import argparse
import statistics
from datetime import date

import torch

from mhla_convert.mixing import locality_mixing
from mhla_convert.ops import mhla_attention

WAN_CONFIG = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6,
)


def _rope(x, cos, sin):
    """Wan's interleaved RoPE, as in diffusers' WanAttnProcessor."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class _Grid:
    """The post-patch token grid of the current forward, captured by a model pre-hook."""

    def __init__(self, model, patch):
        self.value = None
        model.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.patch = patch

    def _hook(self, module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        self.value = tuple(s // p for s, p in zip(x.shape[2:], self.patch))


class WanMHLAProcessor:
    def __init__(self, grid: _Grid, blocks, backend):
        self.grid, self.blocks, self.backend = grid, blocks, backend
        self.mixing = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _rope(q, *rotary_emb), _rope(k, *rotary_emb)
        if self.mixing is None:
            self.mixing = locality_mixing(self.blocks).to(q.device)
        out = mhla_attention(q, k, v, self.mixing, grid=self.grid.value, blocks=self.blocks, backend=self.backend)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


class SanaMHLAProcessor:
    """SANA's own linear attention (ReLU, no scale, eps 1e-15) with M blocks instead of one."""

    def __init__(self, grid: _Grid, blocks_for, backend):
        self.grid, self.blocks_for, self.backend = grid, blocks_for, backend
        self.mixing = {}

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        blocks = self.blocks_for(self.grid.value)
        if blocks not in self.mixing:
            self.mixing[blocks] = locality_mixing(blocks).to(q.device)
        out = mhla_attention(q, k, v, self.mixing[blocks], grid=self.grid.value, blocks=blocks, scale=1.0, eps=1e-15,
                             backend=self.backend)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


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


def bench_wan(backend):
    from diffusers import WanTransformer3DModel

    with torch.device("cuda"):
        model = WanTransformer3DModel(**WAN_CONFIG).to(torch.bfloat16).eval()
    grid = _Grid(model, WAN_CONFIG["patch_size"])
    x = torch.randn(1, 16, 21, 60, 100, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")
    run = lambda: model(x, t, text, return_dict=False)  # noqa: E731
    originals = {i: b.attn1.processor for i, b in enumerate(model.blocks)}
    mhla = WanMHLAProcessor(grid, (7, 3, 5), backend)
    rows = []
    with torch.no_grad():
        rows.append(("original (SDPA)", _time(run)))
        for i, b in enumerate(model.blocks):
            b.attn1.set_processor(mhla)
        rows.append((f"all 30 self-attentions -> MHLA ({backend}), M=105", _time(run)))
        for i, b in enumerate(model.blocks):
            b.attn1.set_processor(originals[i] if i % 3 == 0 else mhla)
        rows.append((f"20 of 30 -> MHLA ({backend}), softmax at 0,3,...,27", _time(run)))
    return "Wan2.1-1.3B-shaped, 81x480x800 -> 21x30x50 = 31,500 tokens", rows


def bench_sana(backend):
    from diffusers import SanaTransformer2DModel

    with torch.device("cuda"):
        model = SanaTransformer2DModel().to(torch.bfloat16).eval()
    cfg = model.config
    grid = _Grid(model, (cfg.patch_size, cfg.patch_size))
    blocks_for = lambda g: (4, 4) if g[0] <= 32 else (8, 8)  # noqa: E731  M=16 at 1024 px, 64 at 4096 px
    mhla = SanaMHLAProcessor(grid, blocks_for, backend)
    originals = {i: b.attn1.processor for i, b in enumerate(model.transformer_blocks)}
    text = torch.randn(1, 300, cfg.caption_channels, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")
    rows = []
    with torch.no_grad():
        for px, side in ((1024, 32), (4096, 128)):
            x = torch.randn(1, cfg.in_channels, side, side, device="cuda", dtype=torch.bfloat16)
            run = lambda: model(x, text, t, return_dict=False)  # noqa: E731
            for i, b in enumerate(model.transformer_blocks):
                b.attn1.set_processor(originals[i])
            rows.append((f"{px} px original (SANA linear attention), {side}x{side} tokens", _time(run)))
            for b in model.transformer_blocks:
                b.attn1.set_processor(mhla)
            rows.append((f"{px} px MHLA ({backend}), M={16 if side == 32 else 64}", _time(run)))
    return "SANA-1600M-shaped (class defaults)", rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wan", choices=("wan", "sana"))
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--fwd-configs", default=None, help="forward launch settings (kernel_breakdown.py --best)")
    ap.add_argument("--old-launch", action="store_true", help="the previous launch path: no plan cache, Triton's launcher")
    args = ap.parse_args()
    import _fwd_configs

    _fwd_configs.load(args.fwd_configs)
    if args.old_launch:
        import _old_launch

        _old_launch.enable()
        print("--old-launch: FWD_CONFIGS = {}, no plan/launch caches", flush=True)
    title, rows = (bench_wan if args.model == "wan" else bench_sana)(args.backend)
    print(f"\n{date.today()} {torch.cuda.get_device_name()} bf16 batch 1 — {title}")
    base = rows[0][1]
    for name, ms in rows:
        if name.endswith("tokens"):
            base = ms
        print(f"| {name} | {ms:.1f} ms | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
