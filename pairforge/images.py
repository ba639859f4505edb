"""Image helpers shared by the model steps (ground floor: no pipeline, no model code)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from PIL import Image

from pairforge.config import ModelPoolConfig

if TYPE_CHECKING:
    import torch


def decode_rgb(data: bytes | memoryview) -> Image.Image:
    """An encoded image (a raw shard's bytes) as an RGB Pillow image."""
    return Image.open(io.BytesIO(data)).convert("RGB")


def model_device(pool: ModelPoolConfig) -> str:
    """``cuda`` when the pool asks Ray for GPUs and one is visible, else ``cpu``."""
    import torch

    return "cuda" if pool.num_gpus and torch.cuda.is_available() else "cpu"


def model_dtype(name: str, device: str) -> torch.dtype:  # noqa: F821 - torch is lazy
    """A model section's ``dtype`` setting as a torch dtype (auto: bf16 on GPU, else fp32)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
