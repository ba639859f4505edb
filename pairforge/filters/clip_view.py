"""The picture open_clip's preprocessing makes of an image before it becomes a tensor (its
resize and centre crop), as an ``images.ImageView``: stage 3 prepares it once per row in a
CPU task ahead of the CLIP actors (issue 48's one decode per row).

The view is built from the model's config alone, as open_clip builds its preprocessing
(model config, then the pretrained tag's settings, then the tower's image size), so the
decoding task loads no weights. The actor checks it against the preprocessing it loaded
(``ClipScorer``) and prepares its own pictures when they differ, so a model open_clip
configures otherwise (an ``hf-hub:`` id) costs a second resize, never a different score.

The decoding tasks run that picture as plain Pillow calls (:func:`pillow_steps`: torchvision's
``Resize`` and ``CenterCrop`` on a Pillow image, and open_clip's mode conversion, written out
as torchvision computes them; the same pixels, tested against the transform itself): the
transform is built where the view is made, and the tasks import neither open_clip nor torch
(~4 s of CPU and ~300 MiB in every task worker that decoded for CLIP, which is every CPU
worker of stage 3). A transform with any other step is run as it is.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict
from typing import Any

from PIL import Image, ImageOps

from pairforge.config import ClipConfig
from pairforge.images import ImageView


def split_preprocess(preprocess: Any) -> tuple[Any, Any]:
    """open_clip's preprocessing (a torchvision ``Compose``) cut where the picture becomes a
    tensor: (what works on the Pillow image, the rest)."""
    from torchvision.transforms import Compose

    steps = list(preprocess.transforms)
    cut = next((i for i, t in enumerate(steps) if "ToTensor" in type(t).__name__), len(steps))
    return Compose(steps[:cut]), Compose(steps[cut:])


@functools.lru_cache(maxsize=8)
def pil_transform(model: str, pretrained: str | None, config_path: str | None) -> Any:
    """The Pillow part of ``model``'s inference preprocessing, from its config (None when
    open_clip has no config for it, e.g. ``hf-hub:`` ids)."""
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict

    if config_path:
        open_clip.add_model_config(config_path)
    model_cfg = open_clip.get_model_config(model)
    if model_cfg is None:
        return None
    settings = merge_preprocess_dict(asdict(PreprocessCfg()), model_cfg.get("preprocess_cfg", {}))
    if pretrained and not os.path.exists(pretrained):
        settings = merge_preprocess_dict(settings,
                                         open_clip.get_pretrained_cfg(model, pretrained) or {})
    settings["size"] = model_cfg.get("vision_cfg", {}).get("image_size", settings["size"])
    return split_preprocess(image_transform_v2(PreprocessCfg(**settings), is_train=False))[0]


# torchvision's ``pil_modes_mapping``: the Pillow filter of each InterpolationMode value
PIL_FILTERS = {"nearest": Image.Resampling.NEAREST, "nearest-exact": Image.Resampling.NEAREST,
               "bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
               "box": Image.Resampling.BOX, "hamming": Image.Resampling.HAMMING,
               "lanczos": Image.Resampling.LANCZOS}

Step = tuple[Any, ...]


def pillow_steps(transform: Any) -> tuple[Step, ...] | None:
    """``transform`` (open_clip's Pillow part) as plain data for :func:`run_pillow_steps`;
    None when a step is not one of torchvision's ``Resize`` or ``CenterCrop`` or
    open_clip's ``MaybeConvertMode``."""
    steps: list[Step] = []
    for step in getattr(transform, "transforms", ()):
        kind = (type(step).__module__, type(step).__name__)
        if kind == ("torchvision.transforms.transforms", "Resize"):
            mode = getattr(step.interpolation, "value", None)
            if mode not in PIL_FILTERS:
                return None
            size = (step.size,) if isinstance(step.size, int) else tuple(step.size)
            steps.append(("resize", size, step.max_size, mode))
        elif kind == ("torchvision.transforms.transforms", "CenterCrop"):
            steps.append(("crop", tuple(step.size)))
        elif kind == ("open_clip.transform", "MaybeConvertMode"):
            steps.append(("convert", step.mode))
        else:
            return None
    return tuple(steps) or None


def run_pillow_steps(steps: tuple[Step, ...], image: Image.Image) -> Image.Image:
    for step in steps:
        if step[0] == "resize":
            height, width = _resized(image.height, image.width, step[1], step[2])
            if (height, width) != (image.height, image.width):
                image = image.resize((width, height), PIL_FILTERS[step[3]])
        elif step[0] == "crop":
            image = _center_crop(image, *step[1])
        else:
            image = image.convert(step[1])
    return image


def _resized(height: int, width: int, size: tuple[int, ...], max_size: int | None
             ) -> tuple[int, int]:
    """torchvision's ``_compute_resized_output_size`` (transforms v1)."""
    if len(size) == 2:
        return size[0], size[1]
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size[0], int(size[0] * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _center_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """torchvision's ``center_crop`` on a Pillow image (black padding where it is smaller)."""
    if width > image.width or height > image.height:
        dx, dy = max(0, width - image.width), max(0, height - image.height)
        image = ImageOps.expand(image, (dx // 2, dy // 2, (dx + 1) // 2, (dy + 1) // 2), fill=0)
        if (image.width, image.height) == (width, height):
            return image
    top = int(round((image.height - height) / 2.0))
    left = int(round((image.width - width) / 2.0))
    return image.crop((left, top, left + width, top + height))


class OpenClipPicture:
    """``prepare`` of a CLIP view: picklable by its settings and its Pillow steps (made
    where the view is made), so a decoding task needs neither open_clip nor torch."""

    def __init__(self, clip: ClipConfig) -> None:
        self.settings = (clip.model, clip.pretrained, clip.model_config_path)
        self.steps = pillow_steps(self.transform)

    @property
    def transform(self) -> Any:
        return pil_transform(*self.settings)

    def __call__(self, image: Image.Image) -> Image.Image:
        if self.steps is not None:
            return run_pillow_steps(self.steps, image)
        return self.transform(image)

    def on_tensor(self, image: Any) -> Any:
        """The same on a CHW uint8 tensor on its device (``device_decode.py``), when every
        transform is one torchvision runs on tensors (resize, crop; open_clip's mode
        conversion passes tensors through); None otherwise."""
        from open_clip.transform import MaybeConvertMode
        from torchvision.transforms import CenterCrop, Resize

        steps = getattr(self.transform, "transforms", None)
        if not steps or not all(isinstance(t, Resize | CenterCrop | MaybeConvertMode)
                                for t in steps):
            return None
        return self.transform(image)


def clip_view(clip: ClipConfig) -> tuple[ImageView, ...]:
    """The clip section's model's view (none when its config is not open_clip's own)."""
    picture = OpenClipPicture(clip)
    if picture.transform is None:
        return ()
    return (ImageView(f"open_clip:{picture.transform!r}", picture),)
