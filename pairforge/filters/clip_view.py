"""The picture open_clip's preprocessing makes of an image before it becomes a tensor (its
resize and centre crop), as an ``images.ImageView``: stage 3 prepares it once per row in a
CPU task ahead of the CLIP actors (issue 48's one decode per row).

The view is built from the model's config alone, as open_clip builds its preprocessing
(model config, then the pretrained tag's settings, then the tower's image size), so the
decoding task loads no weights. The actor checks it against the preprocessing it loaded
(``ClipScorer``) and prepares its own pictures when they differ, so a model open_clip
configures otherwise (an ``hf-hub:`` id) costs a second resize, never a different score.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict
from typing import Any

from PIL import Image

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


class OpenClipPicture:
    """``prepare`` of a CLIP view: picklable by its settings, built once per process."""

    def __init__(self, clip: ClipConfig) -> None:
        self.settings = (clip.model, clip.pretrained, clip.model_config_path)

    @property
    def transform(self) -> Any:
        return pil_transform(*self.settings)

    def __call__(self, image: Image.Image) -> Image.Image:
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
