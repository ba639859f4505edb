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

    @property
    def side(self) -> int | None:
        sizes = [t.size for t in getattr(self.transform, "transforms", ()) if hasattr(t, "size")]
        size = sizes[-1] if sizes else None  # the crop's, else the resize's
        return max(size) if isinstance(size, tuple | list) else size

    def __call__(self, image: Image.Image) -> Image.Image:
        return self.transform(image)


def clip_view(clip: ClipConfig) -> tuple[ImageView, ...]:
    """The clip section's model's view (none when its config is not open_clip's own)."""
    picture = OpenClipPicture(clip)
    if picture.transform is None:
        return ()
    return (ImageView(f"open_clip:{picture.transform!r}", picture),)
