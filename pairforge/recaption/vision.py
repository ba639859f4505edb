"""A captioning model's own image vectors, for the recaption cache's embedding tier.

Two images whose captions may be shared are images the captioner sees alike, so the
closest measure is the captioner's own vision encoder, not another model's. The vector is
what the language model reads where the class offers it (``get_image_features``: LLaVA,
Idefics3/SmolVLM, PaliGemma, Qwen2-VL: after the projector), else its vision tower's
output (BLIP's ``vision_model``, GIT's ``image_encoder``). Tokens and image crops are
averaged into one L2-normalised vector per image: the decoder reads every token, and a
pooled CLS summary (BLIP's ``pooler_output``) can carry little of the image.

The lookup runs the tower, and a miss then captions the image, which would run it again:
the tower's outputs for the images just embedded are kept (``TowerMemo``) and ``generate``
reads them, so a miss costs a caption, not a tower pass more (measured in
bench/RESULTS.md, "Captioning as a system").
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from PIL import Image

TOWERS = ("vision_model", "vision_tower", "image_encoder", "visual")


def find_tower(model: Any) -> Any:
    """The outermost vision tower module, or None."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TOWERS:
            return module
    return None


def find_encoder(model: Any) -> Callable[..., Any] | None:
    """The model's image-feature function, or None when it exposes none."""
    if callable(getattr(model, "get_image_features", None)):
        return model.get_image_features
    return find_tower(model)


class TowerMemo:
    """The vision tower's outputs for the images last embedded, per image, so that
    ``generate`` on the same pixels (a lookup that missed) reads them instead of running
    the tower again: a miss then costs the caption alone, not tower + caption.

    Installed as the tower's ``forward``. A call is answered from the memo only when every
    row's key is there; the key digests the row of each batch-sized tensor argument and
    the other arguments' values, so other pixels, masks or options always recompute.
    """

    def __init__(self, tower: Any) -> None:
        self.forward = tower.forward
        self.rows: dict[bytes, Any] = {}
        self.recording = False
        tower.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        keys = self._keys(args, kwargs)
        if keys is not None and not self.recording and all(k in self.rows for k in keys):
            return _stack([self.rows[k] for k in keys])
        output = self.forward(*args, **kwargs)
        if keys is not None and self.recording:
            self.rows.update((k, part) for k, part in zip(keys, _split(output, len(keys)),
                                                          strict=True) if part is not None)
        return output

    @staticmethod
    def _keys(args: tuple, kwargs: dict) -> list[bytes] | None:
        import torch

        values = list(args) + [kwargs[k] for k in sorted(kwargs)]
        tensors = [v for v in values if torch.is_tensor(v)]
        if not tensors:
            return None
        batch = tensors[0].shape[0]
        # None and False are the defaults of the options callers pass (BLIP's generate
        # passes interpolate_pos_encoding=False, the embedding call leaves it out)
        rest = repr([(k, v) for k, v in sorted(kwargs.items()) if not torch.is_tensor(v)
                     and (k == "return_dict" or v not in (None, False))]
                    + [v for v in args if not torch.is_tensor(v)])
        if any(t.dim() == 0 or t.shape[0] != batch for t in tensors):
            return None
        keys = []
        for row in range(batch):
            digest = hashlib.blake2b(rest.encode(), digest_size=16)
            for t in tensors:
                digest.update(str((t.dtype, tuple(t.shape[1:]))).encode())
                digest.update(t[row].detach().contiguous().cpu().numpy().tobytes())
            keys.append(digest.digest())
        return keys


def _split(output: Any, rows: int) -> list[Any]:
    """One model output per image (each tensor field sliced on its batch dimension)."""
    import torch

    if torch.is_tensor(output):
        return list(output.split(1)) if output.shape[0] == rows else [None] * rows
    fields = {k: v for k, v in output.items() if v is not None}
    if not all(torch.is_tensor(v) and v.shape[0] == rows for v in fields.values()):
        return [None] * rows  # hidden-state tuples etc.: not kept
    return [type(output)(**{k: v[i:i + 1] for k, v in fields.items()}) for i in range(rows)]


def _stack(parts: list[Any]) -> Any:
    import torch

    if torch.is_tensor(parts[0]):
        return torch.cat(parts)
    return type(parts[0])(**{k: torch.cat([p[k] for p in parts]) for k in parts[0]})


def _parameters(encoder: Callable[..., Any]) -> set[str]:
    # a module's class forward: the instance's may be a TowerMemo
    function = type(encoder).forward if hasattr(encoder, "forward") else encoder
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
        tower = find_tower(model)
        self.memo = TowerMemo(tower) if tower is not None else None

    def _encode(self, images: list[Image.Image]) -> Any:
        inputs = self.image_processor(images=images, return_tensors="pt")
        kwargs = {k: v.to(self.device) for k, v in inputs.items() if k in self.accepts}
        if kwargs["pixel_values"].is_floating_point():
            kwargs["pixel_values"] = kwargs["pixel_values"].to(self.dtype)
        return _rows(self.encoder(**kwargs)).float()

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        """One L2-normalised float32 row per image, in order."""
        import torch

        with torch.inference_mode(), self._recording():
            rows = self._encode(images) if images else torch.zeros(0, 1)
            if len(rows) != len(images):  # crops: each image is several rows
                rows = torch.stack([self._encode([im]).mean(0) for im in images])
            rows = torch.nn.functional.normalize(rows, dim=-1)
        return rows.cpu().numpy().astype(np.float32)

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        """The tower's outputs for these images replace the memo's (one batch kept)."""
        if self.memo is None:
            yield
            return
        self.memo.rows.clear()
        self.memo.recording = True
        try:
            yield
        finally:
            self.memo.recording = False
