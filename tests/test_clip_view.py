"""The CLIP view's Pillow steps (filters/clip_view.py): the pixels of open_clip's own
preprocessing, without open_clip or torch in the process that prepares them."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image

from pairforge.config import ClipConfig
from pairforge.filters.clip_view import (
    OpenClipPicture,
    pillow_steps,
    run_pillow_steps,
    split_preprocess,
)

SIZES = [(1, 1), (3, 500), (500, 3), (32, 32), (33, 31), (224, 224), (640, 480), (31, 1000)]
MODES = ["RGB", "RGBA", "L", "P"]


def _image(size: tuple[int, int], mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    return image.quantize(16) if mode == "P" else image.convert(mode)


def _pillow_part(**settings) -> object:  # noqa: ANN003
    return split_preprocess(image_transform_v2(PreprocessCfg(**settings), is_train=False))[0]


@pytest.mark.parametrize("settings", [
    {"size": 224}, {"size": 32}, {"size": 32, "resize_mode": "squash"},
    {"size": 48, "interpolation": "bilinear"}, {"size": (32, 40), "resize_mode": "squash"}])
def test_the_pillow_steps_make_open_clips_pixels(settings):
    transform = _pillow_part(**settings)
    steps = pillow_steps(transform)
    assert steps is not None
    for i, (size, mode) in enumerate((s, m) for s in SIZES for m in MODES):
        image = _image(size, mode, i)
        expected, found = transform(image), run_pillow_steps(steps, image)
        assert (found.mode, found.size) == (expected.mode, expected.size), (size, mode)
        assert found.tobytes() == expected.tobytes(), (size, mode)


def test_a_crop_larger_than_the_image_is_padded_as_torchvision_pads():
    from torchvision.transforms import CenterCrop, Compose

    transform = Compose([CenterCrop((40, 37))])
    steps = pillow_steps(transform)
    for size in [(10, 10), (37, 5), (3, 60), (40, 37)]:
        image = _image(size, "RGB", 1)
        assert run_pillow_steps(steps, image).tobytes() == transform(image).tobytes()


def test_a_step_it_does_not_know_keeps_the_transform():
    assert pillow_steps(_pillow_part(size=32, resize_mode="longest")) is None
    assert pillow_steps(None) is None


def test_a_decoding_process_prepares_the_view_without_open_clip_or_torch():
    picture = OpenClipPicture(ClipConfig(model="ViT-B-32", pretrained=None))
    assert picture.steps is not None
    image = _image((300, 200), "RGB", 7)
    code = (
        "import pickle, sys\n"
        "from PIL import Image\n"
        "picture, size, pixels = pickle.load(sys.stdin.buffer)\n"
        "sys.stdout.buffer.write(picture(Image.frombytes('RGB', size, pixels)).tobytes())\n"
        "assert not {'torch', 'open_clip', 'torchvision'} & set(sys.modules), sorted(\n"
        "    m for m in sys.modules if m.split('.')[0] in ('torch', 'open_clip'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                          input=pickle.dumps((picture, image.size, image.tobytes())))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout == picture.transform(image).tobytes()
