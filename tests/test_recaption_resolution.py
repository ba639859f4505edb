"""The captioner's input resolution (process.recaption.input_resolution): the cost dial."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from pairforge.config import RecaptionConfig
from pairforge.recaption.backends import OpenAICaptioner, TransformersCaptioner
from pairforge.recaption.cache import cache_identity
from pairforge.scenes.world import render, scenes

CAPTIONER = str(Path(__file__).resolve().parents[1] / "pairforge" / "sample" / "captioner")


def test_the_captioner_sees_the_configured_side_and_its_native_one_by_default() -> None:
    images = [render(s, 32) for s in scenes(3, "heldout")]
    native = TransformersCaptioner(RecaptionConfig(model=CAPTIONER, max_new_tokens=24))
    same = TransformersCaptioner(RecaptionConfig(model=CAPTIONER, max_new_tokens=24,
                                                 input_resolution=32))
    small = TransformersCaptioner(RecaptionConfig(model=CAPTIONER, max_new_tokens=24,
                                                  input_resolution=16))
    assert native._inputs(images, "")["pixel_values"].shape[-2:] == (32, 32)
    assert small._inputs(images, "")["pixel_values"].shape[-2:] == (16, 16)
    # BLIP's position embeddings are interpolated to 2x2 patches instead of 4x4
    assert small.generate_kwargs == {"interpolate_pos_encoding": True}
    assert same.generate(images, "") == native.generate(images, "")
    assert len(small.generate(images, "")) == 3


def test_a_processor_without_a_known_size_is_refused() -> None:
    class Sizeless:
        size = {"pixels": 100}

    from pairforge.recaption.backends import resolution_kwargs

    with pytest.raises(ValueError, match="input_resolution"):
        resolution_kwargs(Sizeless(), None, 64)


def test_a_served_captioner_gets_the_image_downscaled() -> None:
    captioner = OpenAICaptioner(RecaptionConfig(backend="openai", model="m", input_resolution=64))
    body = captioner._body(Image.new("RGB", (400, 200)), "describe")
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert sent.size == (64, 32)


def test_the_resolution_is_part_of_the_cache_identity_only_when_set(tmp_path: Path) -> None:
    from pairforge.config import parse_config

    def identity(**recaption) -> dict:  # noqa: ANN003
        return cache_identity(parse_config({"input": {"path": "x"}, "process": {
            "recaption": {"enabled": True, "model": CAPTIONER, **recaption}}}))

    assert "input_resolution" not in identity()
    assert identity(input_resolution=16)["input_resolution"] == 16
