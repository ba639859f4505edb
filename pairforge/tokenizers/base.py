"""The one image-tokenizer interface every backend implements (DESIGN.md sections 3, 6, 8).

A tokenizer turns a batch of PIL images into int32 code grids shaped (h, w) -- grids may
differ per image for variable-resolution backends -- and, when the backend has a decoder,
turns grids back into images. Its ``fingerprint`` names the weights *and* the preprocessing,
because the same weights fed differently resized or normalised pixels give other codes.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch
from PIL import Image

from pairforge.tokenizers.fingerprint import fingerprint_digest

__all__ = ["ImageTokenizer", "fingerprint_digest", "group_by_shape", "state_dict_sha256",
           "to_uint8_image"]


class ImageTokenizer(ABC):
    """Encode images to int32 code grids; decode grids back to images."""

    #: short backend name written into fingerprints and manifests
    backend: str = "abstract"

    @abstractmethod
    def encode(self, images: list[Image.Image]) -> list[np.ndarray]:
        """One int32 array shaped (h, w) per image, codes in ``[0, codebook_size)``."""

    def decode(self, grids: list[np.ndarray]) -> list[Image.Image]:
        """One RGB image per grid. Backends without a decoder raise NotImplementedError."""
        raise NotImplementedError(f"the {self.backend} image tokenizer has no decoder")

    @property
    @abstractmethod
    def codebook_size(self) -> int:
        """K: image codes are ``0 .. K-1``."""

    @property
    @abstractmethod
    def downsample(self) -> int:
        """Pixels per code along each side (a 256 px side at 16 gives 16 codes)."""

    @property
    @abstractmethod
    def resolution(self) -> int:
        """Input side in pixels (variable-resolution backends: the side of the pixel cap)."""

    @property
    def variable_resolution(self) -> bool:
        """True when grids keep the aspect ratio, so tokens per image differ."""
        return False

    @property
    def has_decoder(self) -> bool:
        return True

    @property
    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """backend, model id or path, weights hash, preprocessing, and a ``digest`` of them."""

    def grid_shape(self, width: int, height: int) -> tuple[int, int]:
        """The (h, w) grid an image of this size encodes to (fixed-size backends)."""
        side = self.resolution // self.downsample
        return side, side


def state_dict_sha256(module: torch.nn.Module) -> str:
    """sha256 over a module's tensors (sorted names, dtype, shape, bytes).

    Hashing the loaded tensors rather than the checkpoint files gives one answer for the
    same weights whether they came from a standalone VQ checkpoint, from inside a full
    model's shards, or from a re-sharded copy -- the tokens only depend on the tensors.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        # view as bytes: numpy has no bfloat16, and raw bytes are what identify the weights
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def to_uint8_image(pixels: torch.Tensor) -> Image.Image:
    """A (3, H, W) float tensor in [0, 1] to an RGB PIL image."""
    array = (pixels.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(array)


def group_by_shape(shapes: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """Indices per distinct shape, in first-seen order: batches without padding.

    Padding a batch to its largest member changes codes near the border (convolutions) and
    everywhere (attention), so an image's codes would depend on its batch companions.
    Encoding each shape group separately keeps tokens independent of batching.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, shape in enumerate(shapes):
        groups.setdefault(tuple(shape), []).append(index)
    return groups
