"""Random-weight transformers VQ checkpoints built from configs, for tests and benchmarks
(bench/vq.py imports it with tests/ on sys.path).

Machines that build and test pairforge cannot reach a model hub (DESIGN.md section 8), so
tests save tiny models with ``save_pretrained`` and load them back by path through the same
code a hub id takes. ``size="real"`` builds the published architectures (random weights) so
benchmarks measure realistic compute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

Size = Literal["tiny", "real"]
HALF = [0.5, 0.5, 0.5]

# tiny: two levels (downsample 2), 32 base channels (GroupNorm needs multiples of 32)
TINY_VQ: dict[str, dict[str, Any]] = {
    "emu3": dict(codebook_size=64, embed_dim=4, latent_channels=4, base_channels=32,
                 channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[],
                 temporal_downsample_factor=4, hidden_size=64),
    "janus": dict(num_embeddings=64, embed_dim=8, latent_channels=16, base_channels=32,
                  channel_multiplier=[1, 2], num_res_blocks=1, num_patches=16,
                  projection_dim=16, image_token_embed_dim=16),
    "chameleon": dict(num_embeddings=64, embed_dim=8, latent_channels=16, base_channels=32,
                      channel_multiplier=[1, 2], num_res_blocks=1, resolution=32),
}
# real: the published VQ architectures (Emu3-Gen, Janus-Pro, Chameleon-7b) are the defaults
REAL_VQ: dict[str, dict[str, Any]] = {"emu3": {}, "janus": {"num_patches": 24}, "chameleon": {}}
CLASSES = {"emu3": ("Emu3VQVAE", "Emu3VQVAEConfig"),
           "janus": ("JanusVQVAE", "JanusVQVAEConfig"),
           "chameleon": ("ChameleonVQVAE", "ChameleonVQVAEConfig")}


def vq_config(backend: str, size: Size = "tiny", **overrides: Any) -> Any:
    import transformers

    values = {**(TINY_VQ if size == "tiny" else REAL_VQ)[backend], **overrides}
    return getattr(transformers, CLASSES[backend][1])(**values)


def processor(backend: str, size: Size = "tiny") -> Any:
    """The image processor a checkpoint of this size would ship with."""
    import transformers

    if backend == "emu3":
        lo, hi = (16 * 16, 32 * 32) if size == "tiny" else (512 * 512, 1024 * 1024)
        return transformers.Emu3ImageProcessor(min_pixels=lo, max_pixels=hi,
                                               spatial_factor=2 if size == "tiny" else 8,
                                               image_mean=HALF, image_std=HALF)
    if backend == "janus":
        side = 32 if size == "tiny" else 384
        return transformers.JanusImageProcessor(size={"height": side, "width": side},
                                                image_mean=HALF, image_std=HALF)
    side = 32 if size == "tiny" else 512
    return transformers.ChameleonImageProcessor(size={"shortest_edge": side},
                                                crop_size={"height": side, "width": side})


def save_vq(backend: str, out_dir: str | Path, size: Size = "tiny", with_processor: bool = True,
            seed: int = 0, **overrides: Any) -> Path:
    """A standalone VQ checkpoint (``config.json`` + ``model.safetensors``)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[backend][0])(vq_config(backend, size, **overrides))
    out = Path(out_dir)
    model.save_pretrained(out)
    if with_processor:
        processor(backend, size).save_pretrained(out)
    return out


def save_full_model(backend: str, out_dir: str | Path, seed: int = 0) -> tuple[Path, Any]:
    """A tiny *full* model checkpoint (text model + vqmodel), as hub repos ship them.

    Returns (path, model) so tests can compare the VQ weights that were saved.
    """
    import transformers

    torch.manual_seed(seed)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)
    if backend == "emu3":
        config = transformers.Emu3Config(vq_config=TINY_VQ["emu3"],
                                         text_config={**text, "pad_token_id": 0,
                                                      "bos_token_id": 1, "eos_token_id": 2},
                                         vocabulary_map={"<image>": 3})
        model = transformers.Emu3ForConditionalGeneration(config)
    elif backend == "chameleon":
        config = transformers.ChameleonConfig(**text, vq_config=TINY_VQ["chameleon"],
                                              vocabulary_map={"<image>": 3})
        model = transformers.ChameleonForConditionalGeneration(config)
    else:
        raise ValueError(f"no tiny full-model recipe for {backend!r}")
    out = Path(out_dir)
    model.save_pretrained(out)
    processor(backend).save_pretrained(out)
    return out, model
