"""Image helpers shared by the model steps (ground floor: no pipeline, no model code)."""

from __future__ import annotations

import io

from PIL import Image

from pairforge.config import ModelPoolConfig


def decode_rgb(data: bytes | memoryview) -> Image.Image:
    """An encoded image (a raw shard's bytes) as an RGB Pillow image."""
    return Image.open(io.BytesIO(data)).convert("RGB")


def model_device(pool: ModelPoolConfig) -> str:
    """``cuda`` when the pool asks Ray for GPUs and one is visible, else ``cpu``."""
    import torch

    return "cuda" if pool.num_gpus and torch.cuda.is_available() else "cpu"
