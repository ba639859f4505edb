"""The VQ image tokenizers that ship with ``transformers``: Emu3, Janus, Chameleon.

Each loads by hub id or local path, from either of two kinds of checkpoint:

* a standalone VQ checkpoint (``config.json`` with model_type ``emu3_vqgan``,
  ``janus_vqgan`` or ``chameleon_vqgan``), loaded with the class's ``from_pretrained``;
* a full model checkpoint (model_type ``emu3``, ``janus``, ``chameleon``, e.g.
  ``Emu3-community/Emu3-Gen-hf``, ``deepseek-community/Janus-Pro-1B``,
  ``facebook/chameleon-7b``), from which only the ``vqmodel`` tensors are read. The VQ
  class's own ``from_pretrained`` cannot do this: pointed at a full checkpoint it finds
  none of its keys and silently keeps random weights.

Preprocessing is the model's own image processor (``preprocessor_config.json`` through
``AutoImageProcessor``); when a checkpoint has none, the documented defaults of each model
are used. Either way the settings are written into the fingerprint.

* Emu3: variable resolution. ``smart_resize`` keeps the aspect ratio, rounds sides to the
  spatial factor and keeps the area within [min_pixels, max_pixels], so tokens per image
  differ. Encode and decode.
* Janus: longest side to 384 (``num_patches * 16``), padded to a square with the mean
  colour. Encode and decode (decode needs the full ``num_patches`` x ``num_patches`` grid).
* Chameleon: shorter side to 512, centre crop, pixels scaled to about [-1, 1]. Encode
  only: ``transformers`` implements only the encoder of Chameleon's VQ-VAE, there is no
  decoder to call.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from pairforge.batching import FixedForward
from pairforge.tokenizers.base import (
    ImageTokenizer,
    fingerprint_digest,
    group_by_shape,
    state_dict_sha256,
    to_uint8_image,
)

# processor settings that change the pixels a model sees (the rest is bookkeeping)
PREPROCESSING_KEYS = (
    "image_processor_type", "do_convert_rgb", "do_resize", "size", "crop_size",
    "do_center_crop", "resample", "min_pixels", "max_pixels", "spatial_factor", "min_size",
    "do_pad", "background_color", "do_rescale", "rescale_factor", "do_normalize",
    "image_mean", "image_std",
)
HALF = [0.5, 0.5, 0.5]


@dataclass(frozen=True)
class BackendInfo:
    vq_class: str  # class name in transformers
    vq_model_type: str  # model_type of a standalone VQ checkpoint
    full_model_type: str  # model_type of a full model that contains a ``vqmodel``
    processor_class: str
    has_decoder: bool


BACKENDS = {
    "emu3": BackendInfo("Emu3VQVAE", "emu3_vqgan", "emu3", "Emu3ImageProcessor", True),
    "janus": BackendInfo("JanusVQVAE", "janus_vqgan", "janus", "JanusImageProcessor", True),
    "chameleon": BackendInfo("ChameleonVQVAE", "chameleon_vqgan", "chameleon",
                             "ChameleonImageProcessor", False),
}


def _hub_file(model: str, filename: str, revision: str | None) -> str | None:
    """Local path of ``filename`` in a folder or hub repo (downloaded once), or None."""
    from transformers.utils import cached_file

    return cached_file(model, filename, revision=revision,
                       _raise_exceptions_for_missing_entries=False)


def _revision_of(path: str | None) -> str | None:
    """The commit a hub-cached file came from (None for plain local folders)."""
    match = re.search(r"snapshots/([0-9a-f]{40})/", path or "")
    return match.group(1) if match else None


def load_vq_model(backend: str, model: str, revision: str | None = None) -> torch.nn.Module:
    """The VQ-VAE of ``backend`` from a standalone VQ or a full-model checkpoint."""
    import transformers

    info = BACKENDS[backend]
    config_path = _hub_file(model, "config.json", revision)
    if config_path is None:
        raise FileNotFoundError(f"{model}: no config.json (not a transformers checkpoint)")
    model_type = json.loads(Path(config_path).read_text()).get("model_type")
    vq_class = getattr(transformers, info.vq_class)
    if model_type == info.vq_model_type:
        vq, loading = vq_class.from_pretrained(model, revision=revision, output_loading_info=True)
        if loading["missing_keys"]:
            raise ValueError(f"{model}: checkpoint lacks {len(loading['missing_keys'])} "
                             f"{info.vq_class} tensors, e.g. {loading['missing_keys'][:3]}")
    elif model_type == info.full_model_type:
        vq = _vq_from_full_checkpoint(vq_class, model, revision)
    else:
        raise ValueError(f"{model}: model_type {model_type!r} is neither {info.vq_model_type!r} "
                         f"nor {info.full_model_type!r}, so it is not a {backend} checkpoint")
    return vq.eval()


def _vq_from_full_checkpoint(vq_class: type, model: str, revision: str | None) -> torch.nn.Module:
    from safetensors import safe_open
    from transformers import AutoConfig

    vq = vq_class(AutoConfig.from_pretrained(model, revision=revision).vq_config)
    state: dict[str, torch.Tensor] = {}
    for shard in _vq_shards(model, revision):
        with safe_open(shard, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if "vqmodel." in key:
                    # "vqmodel.x" (older exports) and "model.vqmodel.x" (transformers 5) alike
                    state[key.split("vqmodel.", 1)[1]] = handle.get_tensor(key)
    if not state:
        raise ValueError(f"{model}: no vqmodel.* tensors in the checkpoint")
    vq.load_state_dict(state, strict=True)
    return vq


def _vq_shards(model: str, revision: str | None) -> list[str]:
    """Only the safetensors shards that hold vqmodel tensors (not a 7B text model's)."""
    index_path = _hub_file(model, "model.safetensors.index.json", revision)
    if index_path is None:
        single = _hub_file(model, "model.safetensors", revision)
        if single is None:
            raise FileNotFoundError(f"{model}: no model.safetensors(.index.json); "
                                    "only safetensors checkpoints are supported")
        return [single]
    weight_map = json.loads(Path(index_path).read_text())["weight_map"]
    names = sorted({f for k, f in weight_map.items() if "vqmodel." in k})
    return [_hub_file(model, name, revision) for name in names]  # type: ignore[misc]


def load_processor(backend: str, model: str, vq: torch.nn.Module,
                   revision: str | None = None) -> tuple[Any, str]:
    """(image processor, where its settings came from)."""
    import transformers

    info = BACKENDS[backend]
    if _hub_file(model, "preprocessor_config.json", revision) is not None:
        processor = transformers.AutoImageProcessor.from_pretrained(model, revision=revision)
        return processor, "preprocessor_config.json"
    return getattr(transformers, info.processor_class)(**_default_processor_kwargs(backend, vq)), \
        f"defaults for {backend}"


def _default_processor_kwargs(backend: str, vq: torch.nn.Module) -> dict[str, Any]:
    """What each model was trained with, for checkpoints saved without a processor."""
    config = vq.config
    if backend == "emu3":
        # Emu3's vision tokenizer: pixels in [-1, 1], area between 512^2 and 1024^2
        return {"image_mean": HALF, "image_std": HALF, "min_pixels": 512 * 512,
                "max_pixels": 1024 * 1024, "spatial_factor": vq.vision_spatial_factor}
    if backend == "janus":
        side = config.num_patches * 2 ** (len(config.channel_multiplier) - 1)
        return {"image_mean": HALF, "image_std": HALF, "size": {"height": side, "width": side}}
    side = config.resolution  # chameleon: its processor's own scaling (x * 0.0078 - 1)
    return {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}


def _override_resolution(backend: str, processor: Any, resolution: int) -> None:
    """Serve another input size than the checkpoint's (benchmarks, small tests)."""
    if backend == "emu3":
        processor.min_pixels = processor.max_pixels = resolution * resolution
        processor.size = {"min_pixels": processor.min_pixels, "max_pixels": processor.max_pixels}
    elif backend == "janus":
        processor.size = {"height": resolution, "width": resolution}
    else:
        processor.size = {"shortest_edge": resolution}
        processor.crop_size = {"height": resolution, "width": resolution}


class HFVQTokenizer(ImageTokenizer):
    """A transformers VQ-VAE with its own preprocessing behind :class:`ImageTokenizer`."""

    def __init__(self, backend: str, model: str, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, batch_size: int = 16,
                 resolution: int | None = None, revision: str | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown transformers VQ backend {backend!r}; "
                             f"one of {list(BACKENDS)}")
        self.backend, self.model_name = backend, model
        self.forward = FixedForward(batch_size, f"tokenize ({backend})")  # halves on OOM
        self.info = BACKENDS[backend]
        self.device, self.dtype = torch.device(device), dtype
        self.vq = load_vq_model(backend, model, revision).to(self.device, dtype)
        self.processor, self.processor_source = load_processor(backend, model, self.vq, revision)
        if resolution is not None:
            _override_resolution(backend, self.processor, resolution)
        self._check_spatial_factor()
        self.revision = revision or _revision_of(_hub_file(model, "config.json", revision))
        self._fingerprint = self._make_fingerprint()

    # ------------------------------------------------------------------ properties
    @property
    def codebook_size(self) -> int:
        config = self.vq.config
        return int(config.codebook_size if self.backend == "emu3" else config.num_embeddings)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.vq.config.channel_multiplier) - 1)

    @property
    def resolution(self) -> int:
        p = self.processor
        if self.backend == "emu3":
            return math.isqrt(p.max_pixels)
        if self.backend == "janus":
            return int(p.size["height"])
        return int(p.crop_size["height"])

    @property
    def variable_resolution(self) -> bool:
        return self.backend == "emu3"

    @property
    def has_decoder(self) -> bool:
        return self.info.has_decoder

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self._fingerprint)

    def grid_shape(self, width: int, height: int) -> tuple[int, int]:
        if self.backend != "emu3":
            return super().grid_shape(width, height)
        from transformers.models.emu3.image_processing_emu3 import smart_resize

        p = self.processor
        h, w = smart_resize(height, width, p.spatial_factor, p.min_pixels, p.max_pixels)
        return h // self.downsample, w // self.downsample

    @property
    def batch_size(self) -> int:
        """Rows per forward: the configured size, halved by each out-of-memory."""
        return self.forward.rows

    @batch_size.setter
    def batch_size(self, rows: int) -> None:
        self.forward.rows = rows

    # ------------------------------------------------------------------ encode / decode
    def preprocess(self, images: list[Image.Image]) -> list[torch.Tensor]:
        """One (3, H, W) tensor per image, unpadded (Emu3 sizes differ per image)."""
        extra = {"do_pad": False} if self.backend == "emu3" else {}
        rgb = [im if im.mode == "RGB" else im.convert("RGB") for im in images]
        pixels = self.processor(rgb, return_tensors=None, **extra)["pixel_values"]
        return [torch.as_tensor(np.asarray(p)) for p in pixels]

    @torch.inference_mode()
    def encode(self, images: list[Image.Image]) -> list[np.ndarray]:
        if not images:  # image processors refuse an empty batch
            return []
        pixels = self.preprocess(images)
        grids: list[np.ndarray | None] = [None] * len(images)
        for indices in self._chunks([tuple(p.shape) for p in pixels]):
            batch = torch.stack([pixels[i] for i in indices]).to(self.device, self.dtype)
            # one shape for every forward, so a code never depends on the batch's cut; an
            # out-of-memory forward runs again at half the rows (batching.FixedForward)
            codes = self.forward(self._encode_batch, batch).cpu().numpy()
            for i, grid in zip(indices, codes, strict=True):
                grids[i] = grid
        return grids  # type: ignore[return-value]

    def _encode_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """(rows, grid height, grid width) int32 codes."""
        b, _, height, width = batch.shape
        if self.backend == "emu3":
            sizes = torch.tensor([[height, width]] * b)
            tokens = torch.stack(self.vq.encode(batch, sizes, return_dict=True).image_tokens)
        else:  # janus/chameleon return the indices flattened over the whole batch
            f = self.downsample
            tokens = self.vq.encode(batch, return_dict=True).image_tokens
            tokens = tokens.view(b, height // f, width // f)
        return tokens.to(torch.int32)

    @torch.inference_mode()
    def decode(self, grids: list[np.ndarray]) -> list[Image.Image]:
        if not self.has_decoder:
            raise NotImplementedError(
                "Chameleon: transformers implements only the encoder of ChameleonVQVAE, "
                "so codes cannot be decoded back to images with this backend")
        images: list[Image.Image | None] = [None] * len(grids)
        for indices in self._chunks([tuple(g.shape) for g in grids]):
            codes = torch.from_numpy(np.stack([grids[i] for i in indices]).astype(np.int64))
            for i, pixels in zip(indices, self._decode_batch(codes.to(self.device)), strict=True):
                images[i] = to_uint8_image(self._unnormalize(pixels.float().cpu()))
        return images  # type: ignore[return-value]

    def _decode_batch(self, codes: torch.Tensor) -> torch.Tensor:
        if self.backend == "emu3":
            return self.vq.decode(codes)
        side = self.vq.config.num_patches
        if codes.shape[1:] != (side, side):
            raise ValueError(f"Janus decodes only {side}x{side} grids (its num_patches), "
                             f"got {tuple(codes.shape[1:])}")
        return self.vq.decode(codes.flatten(1))

    def _unnormalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """Invert ``(x * rescale_factor - mean) / std`` into [0, 1] pixels."""
        p = self.processor
        mean = torch.tensor(p.image_mean if p.do_normalize else [0.0] * 3).view(3, 1, 1)
        std = torch.tensor(p.image_std if p.do_normalize else [1.0] * 3).view(3, 1, 1)
        return (pixels * std + mean) / (p.rescale_factor * 255)

    def _chunks(self, shapes: list[tuple[int, ...]]) -> list[list[int]]:
        """Same-shape groups, cut to batch_size."""
        out = []
        for indices in group_by_shape(shapes).values():
            out += [indices[i:i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        return out

    # ------------------------------------------------------------------ identity
    def _check_spatial_factor(self) -> None:
        factor = getattr(self.processor, "spatial_factor", self.downsample)
        if factor % self.downsample:
            raise ValueError(f"{self.model_name}: processor spatial_factor {factor} is not a "
                             f"multiple of the VQ downsample factor {self.downsample}")

    def _make_fingerprint(self) -> dict[str, Any]:
        settings = self.processor.to_dict()
        preprocessing = {k: settings[k] for k in PREPROCESSING_KEYS if k in settings}
        preprocessing["source"] = self.processor_source
        # plain JSON types (tuples, enums) so the manifest writes and compares it as-is
        preprocessing = json.loads(json.dumps(preprocessing, default=str))
        fingerprint = {
            "backend": self.backend,
            "model": self.model_name,
            "revision": self.revision,
            "vq_class": self.info.vq_class,
            "weights_sha256": state_dict_sha256(self.vq),
            "codebook_size": self.codebook_size,
            "downsample": self.downsample,
            "resolution": self.resolution,
            "variable_resolution": self.variable_resolution,
            "has_decoder": self.has_decoder,
            "preprocessing": preprocessing,
        }
        fingerprint["digest"] = fingerprint_digest(fingerprint)
        return fingerprint
