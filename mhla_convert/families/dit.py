"""DiT (class-conditional): `BasicTransformerBlock.attn1`, plain SDPA attention; conversion needs
nothing beyond DiffusersAdapter. Training and sampling condition on class labels instead of text.
Note diffusers' DiT unpatchify assumes a square token grid."""

from __future__ import annotations

from typing import Any

import torch

from .base import register
from .diffusers_base import DiffusersAdapter, given

NULL_CLASS = 1000  # DiTPipeline's class for unconditional guidance (ImageNet's 1000 classes + 1)


@register
class DiTAdapter(DiffusersAdapter):
    name = "dit"
    null_class = NULL_CLASS  # DiTPipeline guides with this class label
    model_classes = ("DiTTransformer2DModel",)
    aliases = {"dit-xl-2-256": "facebook/DiT-XL-2-256", "dit-xl-2-512": "facebook/DiT-XL-2-512"}
    pipeline_class = "DiTPipeline"

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        inputs = super().example_inputs(model, grid, batch_size)
        labels = torch.randint(0, model.config.num_embeds_ada_norm, (batch_size,), device=inputs["timestep"].device)
        return {**inputs, "class_labels": labels}

    def tiny_config(self) -> dict[str, Any]:
        """ImageNet's 1000 classes, as DiTPipeline's guidance takes class 1000 for the null class, and a
        concrete out_channels, which DiTPipeline reads: its saved pipeline runs in DiTPipeline as it is."""
        return dict(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=6,
            sample_size=16, patch_size=2, num_embeds_ada_norm=NULL_CLASS,
        )

    def denoise(self, model, noisy, timestep, batch):
        return model(noisy, timestep=timestep, class_labels=batch["class_labels"]).sample

    def text_width(self, model) -> None:
        return None

    def synthetic_conditions(self, model, latents, cond, num_conditions, generator) -> dict[str, torch.Tensor]:
        return {"class_labels": cond % self.num_classes(model)}

    def encode_conditions(self, pipe, transformer, rows, pixels, latents, spec) -> dict[str, torch.Tensor]:
        from ..train.errors import TrainError

        if any(spec.label_column not in r for r in rows):
            raise TrainError(f"DiT needs a class label per image: add \"{spec.label_column}\" to every metadata.jsonl "
                             "line (or set data.label_column)")
        return {"class_labels": torch.tensor([int(r[spec.label_column]) for r in rows])}

    def num_classes(self, model) -> int:
        return model.config.get("num_embeds_ada_norm") or 1000

    def pipeline_tag(self, config) -> str:
        return "unconditional-image-generation"  # the Hub's nearest task to class-conditional generation

    def pipeline_inputs(self, pipe, base, *, class_label=0, guidance_scale=None, **inputs) -> dict[str, Any]:
        """A class label (no prompt, and DiTPipeline takes no size)."""
        if guidance_scale is None and self.num_classes(pipe.transformer) < NULL_CLASS:
            guidance_scale = 1.0  # no guidance: the model has no class NULL_CLASS for it
        transformer = pipe.transformer
        if transformer.config.out_channels is None:  # DiTPipeline reads it to split off a learned sigma
            transformer.register_to_config(out_channels=transformer.out_channels)
        return {"class_labels": [class_label], **given(guidance_scale=guidance_scale)}
