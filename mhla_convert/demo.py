"""`make demo`: the main job end to end on an embedded default — tiny Wan2.1, offline, seconds.

First the converter: convert 2/3 of the self-attention layers, check one converted layer against
the explicit O(N²) MHLA on its own q/k/v, save, reload, check the output is bitwise the same.
Then the whole pipeline: convert → attention transfer → fine-tune → save → reload → sample.
"""

from __future__ import annotations

import tempfile

import torch

from .convert import convert
from .families import adapter_for_model
from .io import from_pretrained, save_pretrained
from .layer import mhla_layers
from .models import tiny_model
from .ops import mhla_attention_reference

MODEL, RATIO, GRID = "tiny-wan", 0.67, (8, 7, 9)  # frames x height x width patches; no axis divides into 7x3x5


def layer_reference_error(model, inputs, grid) -> float:
    """Max |first converted layer's output − explicit O(N²) MHLA on that layer's own q/k/v and `grid`|.

    Proves end to end that the grid captured from the model's forward, the block layout and the
    fast path agree with the definition."""
    _, layer = mhla_layers(model)[0]
    seen = {}
    hook = layer.register_forward_hook(lambda module, args, out: seen.update(args=args, out=out))
    with torch.no_grad():
        model(**inputs)
        hook.remove()
        x, rope = seen["args"][0], (seen["args"][3] if len(seen["args"]) > 3 else None)
        q, k, v = layer.project(x, None if rope is None else layer.rotary(*rope))
        cfg = layer.config
        ref = mhla_attention_reference(
            q, k, v, layer.mixing, grid=grid, blocks=cfg.blocks, feature_map=layer.phi, scale=cfg.scale,
            eps=cfg.eps, exact_radius=cfg.exact_radius,
        )
        return (layer.output(ref) - seen["out"]).abs().max().item()


def run_demo() -> None:
    model = tiny_model(MODEL)
    adapter = adapter_for_model(model)
    inputs = adapter.example_inputs(model, GRID)
    print(
        f"{MODEL}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"input {tuple(inputs['hidden_states'].shape)} -> token grid {GRID}"
    )
    report = convert(model, ratio=RATIO)
    print(report)
    error = layer_reference_error(model, inputs, GRID)
    print(f"first MHLA layer vs explicit O(N^2) reference: max |diff| = {error:.2e}")
    with torch.no_grad():
        before = model(**inputs).sample
    with tempfile.TemporaryDirectory() as tmp:
        path = save_pretrained(model, f"{tmp}/{MODEL}-mhla")
        reloaded = from_pretrained(path)
        with torch.no_grad():
            after = reloaded(**inputs).sample
    same = torch.equal(before, after)
    print(f"saved, reloaded: outputs {'bitwise identical' if same else 'DIFFER'} ({tuple(after.shape)})")
    if not same or error > 1e-4:
        raise SystemExit("demo check failed")
    print()
    from .train.demo import run_pipeline_demo

    run_pipeline_demo()
