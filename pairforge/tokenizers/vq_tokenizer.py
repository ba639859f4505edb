"""Our trained VQ-VAE behind the common :class:`ImageTokenizer` interface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from pairforge.batching import FixedForward
from pairforge.images import resize_center_crop
from pairforge.tokenizers import vqvae
from pairforge.tokenizers.base import (
    ImageTokenizer,
    fingerprint_digest,
    state_dict_sha256,
    to_uint8_image,
)


def preprocessing_description(resolution: int) -> dict[str, Any]:
    """What :func:`resize_center_crop` + scaling do, for the fingerprint."""
    return {"resize": "shorter side to resolution, bicubic", "crop": "center square",
            "resolution": resolution, "rescale": "x / 127.5 - 1 (pixels in [-1, 1])"}


class PairforgeVQTokenizer(ImageTokenizer):
    """Encode with a checkpoint written by ``pairforge tokenizers train-vq``."""

    backend = "pairforge-vq"

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 64,
                 dtype: torch.dtype = torch.float32, compile: bool = False) -> None:
        self.path = str(path)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.forward = FixedForward(batch_size, "tokenize")  # halves on out-of-memory
        self.model = vqvae.load(path, self.device)
        self.dtype = dtype  # below float32: the encoder and codebook distances autocast
        self.encoder = torch.compile(self.model.encode) if compile else self.model.encode
        self._fingerprint = self._make_fingerprint()

    @property
    def codebook_size(self) -> int:
        return self.model.config.codebook_size

    @property
    def downsample(self) -> int:
        return self.model.config.downsample

    @property
    def resolution(self) -> int:
        return self.model.config.resolution

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self._fingerprint)

    def preprocess(self, images: list[Image.Image]) -> torch.Tensor:
        """(B, 3, R, R) float in [-1, 1]."""
        side = self.resolution
        arrays = np.stack([np.asarray(resize_center_crop(im, side)) for im in images])
        return torch.from_numpy(arrays).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)

    @torch.inference_mode()
    def encode(self, images: list[Image.Image]) -> list[np.ndarray]:
        grids: list[np.ndarray] = []  # an empty batch falls through to []
        for start in range(0, len(images), self.batch_size):
            pixels = self.preprocess(images[start:start + self.batch_size]).to(self.device)
            # one shape for every forward, so a code never depends on the batch's cut
            with torch.autocast(self.device.type, self.dtype,
                                enabled=self.dtype != torch.float32):
                codes = self.forward(self.encoder, pixels)
            grids.extend(codes.to(torch.int32).cpu().numpy())
        return grids

    @torch.inference_mode()
    def decode(self, grids: list[np.ndarray]) -> list[Image.Image]:
        images: list[Image.Image] = []
        for start in range(0, len(grids), self.batch_size):
            chunk = np.stack(grids[start:start + self.batch_size]).astype(np.int64)
            pixels = self.model.decode(torch.from_numpy(chunk).to(self.device))
            images.extend(to_uint8_image((p + 1) / 2) for p in pixels)
        return images

    def _make_fingerprint(self) -> dict[str, Any]:
        fingerprint = {
            "backend": self.backend,
            "model": self.path,
            "weights_sha256": state_dict_sha256(self.model),
            "codebook_size": self.codebook_size,
            "downsample": self.downsample,
            "resolution": self.resolution,
            "preprocessing": preprocessing_description(self.resolution),
        }
        if self.dtype != torch.float32:  # other codes; float32's fingerprints stay as they were
            fingerprint["dtype"] = str(self.dtype).removeprefix("torch.")
        fingerprint["digest"] = fingerprint_digest(fingerprint)
        return fingerprint
