"""A captioning model's own image vectors, for the recaption cache's embedding tier.

Two images whose captions may be shared are images the captioner sees alike, so the
closest measure is the captioner's own vision encoder, not another model's. The vector is
what the language model reads where the class offers it (``get_image_features``: LLaVA,
Idefics3/SmolVLM, PaliGemma, Qwen2-VL: after the projector), else its vision tower's
output (BLIP's ``vision_model``, GIT's ``image_encoder``). Tokens and image crops are
averaged into one L2-normalised vector per image: the decoder reads every token, and a
pooled CLS summary (BLIP's ``pooler_output``) can carry little of the image.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

TOWERS = ("vision_model", "vision_tower", "image_encoder", "visual")


def find_encoder(model: Any) -> Callable[..., Any] | None:
    """The model's image-feature function, or None when it exposes none."""
    if callable(getattr(model, "get_image_features", None)):
        return model.get_image_features
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TOWERS:
            return module
    return None


def _parameters(encoder: Callable[..., Any]) -> set[str]:
    function = getattr(encoder, "forward", encoder)
    return {name for name, p in inspect.signature(function).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _rows(output: Any) -> Any:
    """(rows, dim): one row per image or crop, tokens averaged."""
    import torch

    if hasattr(output, "last_hidden_state"):  # every token: what the decoder reads
        output = output.last_hidden_state
    if isinstance(output, list | tuple):  # per-image token tensors (Qwen2-VL)
        return torch.stack([o.reshape(-1, o.shape[-1]).mean(0) for o in output])
    return output if output.dim() == 2 else output.flatten(1, -2).mean(1)


class VisionEmbedder:
    """Images -> normalised vectors from one loaded model and its image processor."""

    def __init__(self, model: Any, image_processor: Any, device: str) -> None:
        encoder = find_encoder(model)
        if encoder is None:
            raise ValueError(
                f"{type(model).__name__} exposes no vision encoder (no get_image_features, "
                f"no {'/'.join(TOWERS)}); set recaption.cache.embedding_source: clip")
        self.encoder, self.accepts = encoder, _parameters(encoder)
        self.image_processor, self.device = image_processor, device
        self.dtype = next(model.parameters()).dtype

    def _encode(self, images: list[Image.Image]) -> Any:
        inputs = self.image_processor(images=images, return_tensors="pt")
        kwargs = {k: v.to(self.device) for k, v in inputs.items() if k in self.accepts}
        if kwargs["pixel_values"].is_floating_point():
            kwargs["pixel_values"] = kwargs["pixel_values"].to(self.dtype)
        return _rows(self.encoder(**kwargs)).float()

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        """One L2-normalised float32 row per image, in order."""
        import torch

        with torch.inference_mode():
            rows = self._encode(images) if images else torch.zeros(0, 1)
            if len(rows) != len(images):  # crops: each image is several rows
                rows = torch.stack([self._encode([im]).mean(0) for im in images])
            rows = torch.nn.functional.normalize(rows, dim=-1)
        return rows.cpu().numpy().astype(np.float32)
