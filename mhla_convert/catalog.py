"""What `mhla-convert list` shows, without importing torch or building a config: the families, their aliases and
the built-in tiny models. The family adapters (families/) are what loading uses; tests/test_cli.py checks these
tables against them (`families()`, `models.aliases()`, `models.tiny_models()`), so they cannot drift apart."""

from __future__ import annotations

FAMILIES = {  # family -> (library, the class names it converts)
    "dit": ("diffusers", ("DiTTransformer2DModel",)),
    "flux": ("diffusers", ("FluxTransformer2DModel",)),
    "gemma3": ("transformers", ("Gemma3ForCausalLM",)),
    "hunyuanvideo": ("diffusers", ("HunyuanVideoTransformer3DModel",)),
    "llama": ("transformers", ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                               "MistralForCausalLM")),
    "pixart": ("diffusers", ("PixArtTransformer2DModel",)),
    "qwen-image": ("diffusers", ("QwenImageTransformer2DModel",)),
    "sana": ("diffusers", ("SanaTransformer2DModel",)),
    "wan": ("diffusers", ("WanTransformer3DModel",)),
}

ALIASES = {  # alias -> (family, hub id), by family
    "dit-xl-2-256": ("dit", "facebook/DiT-XL-2-256"),
    "dit-xl-2-512": ("dit", "facebook/DiT-XL-2-512"),
    "flux.1-dev": ("flux", "black-forest-labs/FLUX.1-dev"),
    "gemma-3-270m": ("gemma3", "google/gemma-3-270m"),
    "gemma-3-1b": ("gemma3", "google/gemma-3-1b-pt"),
    "hunyuanvideo": ("hunyuanvideo", "hunyuanvideo-community/HunyuanVideo"),
    "llama-3.2-1b": ("llama", "meta-llama/Llama-3.2-1B"),
    "llama-3.2-3b": ("llama", "meta-llama/Llama-3.2-3B"),
    "llama-3.1-8b": ("llama", "meta-llama/Llama-3.1-8B"),
    "qwen2.5-0.5b": ("llama", "Qwen/Qwen2.5-0.5B"),
    "qwen2.5-1.5b": ("llama", "Qwen/Qwen2.5-1.5B"),
    "qwen2.5-7b": ("llama", "Qwen/Qwen2.5-7B"),
    "qwen3-0.6b": ("llama", "Qwen/Qwen3-0.6B"),
    "qwen3-1.7b": ("llama", "Qwen/Qwen3-1.7B"),
    "qwen3-8b": ("llama", "Qwen/Qwen3-8B"),
    "qwen3-30b-a3b": ("llama", "Qwen/Qwen3-30B-A3B"),
    "mistral-7b": ("llama", "mistralai/Mistral-7B-v0.1"),
    "pixart-alpha-512": ("pixart", "PixArt-alpha/PixArt-XL-2-512x512"),
    "pixart-alpha-1024": ("pixart", "PixArt-alpha/PixArt-XL-2-1024-MS"),
    "pixart-sigma-512": ("pixart", "PixArt-alpha/PixArt-Sigma-XL-2-512-MS"),
    "pixart-sigma-1024": ("pixart", "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"),
    "qwen-image": ("qwen-image", "Qwen/Qwen-Image"),
    "sana-600m": ("sana", "Efficient-Large-Model/Sana_600M_1024px_diffusers"),
    "sana-1600m": ("sana", "Efficient-Large-Model/Sana_1600M_1024px_diffusers"),
    "sana-1600m-512": ("sana", "Efficient-Large-Model/Sana_1600M_512px_diffusers"),
    "wan2.1": ("wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    "wan2.1-1.3b": ("wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    "wan2.1-14b": ("wan", "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    "wan2.1-i2v-14b-480p": ("wan", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"),
    "wan2.1-i2v-14b-720p": ("wan", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"),
    "wan2.2-ti2v-5b": ("wan", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"),
    "wan2.2-t2v-a14b": ("wan", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"),
    "wan2.2-i2v-a14b": ("wan", "Wan-AI/Wan2.2-I2V-A14B-Diffusers"),
}

TINY_MODELS = {  # built-in tiny model (random weights) -> (family, "its class, what sets it apart"), by family
    "tiny-dit": ("dit", "DiTTransformer2DModel, class-conditional images"),
    "tiny-flux": ("flux", "FluxTransformer2DModel, joint and single-stream blocks"),
    "tiny-gemma3": ("gemma3", "Gemma3ForCausalLM, sliding-window and global layers"),
    "tiny-hunyuanvideo": ("hunyuanvideo", "HunyuanVideoTransformer3DModel, text-to-video, padded text"),
    "tiny-llama": ("llama", "LlamaForCausalLM, grouped-query attention"),
    "tiny-qwen2": ("llama", "Qwen2ForCausalLM, q/k/v biases"),
    "tiny-qwen3": ("llama", "Qwen3ForCausalLM, q/k norms"),
    "tiny-qwen3-moe": ("llama", "Qwen3MoeForCausalLM, experts"),
    "tiny-mistral": ("llama", "MistralForCausalLM, sliding window"),
    "tiny-pixart": ("pixart", "PixArtTransformer2DModel, text-to-image"),
    "tiny-qwen-image": ("qwen-image", "QwenImageTransformer2DModel, dual-stream blocks, padded text"),
    "tiny-sana": ("sana", "SanaTransformer2DModel, text-to-image"),
    "tiny-wan": ("wan", "WanTransformer3DModel, text-to-video"),
    "tiny-wan-i2v": ("wan", "WanTransformer3DModel, image-to-video"),
    "tiny-wan2.2-ti2v": ("wan", "WanTransformer3DModel, Wan2.2 TI2V's 48 latent channels"),
}
