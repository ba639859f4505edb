"""The world CLIP's files (pairforge/sample/clip): its open_clip name, where the model
config and the checkpoint lie, and how a clip section of a config names them."""

from __future__ import annotations

from pathlib import Path

SIDE = 32  # the resolution the demo downloads at
MODEL_NAME = "pf-scenes-clip"
CHECKPOINT = "clip.safetensors"
NOUN_PROMPT = "a photo of a {}"  # what grounding (recaption/grounding.py) asks per noun
SHIPPED = Path(__file__).parents[1] / "sample" / "clip"


def register(folder: str | Path = SHIPPED) -> dict[str, str]:
    """The clip section of a config for the model in ``folder``, registered with open_clip
    (the name resolves only after ``add_model_config``, as in the clip step)."""
    import open_clip

    config = Path(folder) / f"{MODEL_NAME}.json"
    open_clip.add_model_config(config)
    return {"model": MODEL_NAME, "pretrained": str(Path(folder) / CHECKPOINT),
            "model_config_path": str(config)}
