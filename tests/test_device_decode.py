"""``process.decode.device`` (issue 48, item 2): JPEGs decoded and resized by torchvision
on the first model step's device. The code is the same on ``cpu`` and ``cuda`` (only the
device string differs), so it is checked here on the CPU against the Pillow path: the
decode is the same to the bit, the resized views within one level; what the device does
not take (PNG, a damaged JPEG, a header past the pixel cap) goes to Pillow with its status;
and the setting is checked at start and fingerprinted, since the pixels move."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from pairforge import images
from pairforge.config import ConfigError, parse_config
from pairforge.device_decode import on_device
from pairforge.filters.clip import ClipStep
from pairforge.filters.clip_view import clip_view
from pairforge.images import RGB, decode_views, square_view, view_images
from pairforge.pipeline.placement import check_decode_device
from pairforge.pipeline.settings import stage_settings
from pairforge.tokenizers.step import TokenizeStep


def _encoded(kind: str, seed: int, size: tuple[int, int] = (200, 150)) -> bytes:
    rng = np.random.default_rng(seed)
    picture = Image.fromarray((rng.random((37, 53, 3)) * 255).astype(np.uint8)).resize(size)
    buffer = io.BytesIO()
    picture.save(buffer, kind, **({"quality": 90} if kind == "JPEG" else {}))
    return buffer.getvalue()


def _rows(data: list[bytes]) -> pa.Table:
    return pa.table({"status": ["ok"] * len(data), "error": pa.array([None] * len(data),
                                                                      pa.string()),
                     "image": pa.array(data, pa.large_binary())})


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    import golden

    clip = golden.tiny_clip(tmp_path_factory.mktemp("clip"), name="pf-device-decode-clip")
    cfg = parse_config({"input": {"path": "x"}, "process": {"clip": {"enabled": True, **clip}}})
    (clip_picture,) = clip_view(cfg.process.clip)
    return (RGB, square_view(32), clip_picture)


def _arrays(table: pa.Table, view) -> list[np.ndarray]:  # noqa: ANN001
    return [np.asarray(p, dtype=int) for p in view_images(table, view)]


def test_jpegs_on_the_device_match_pillow(views):
    rows = _rows([_encoded("JPEG", seed) for seed in range(4)])
    images.DECODES["rows"] = 0
    by_pillow, by_device = decode_views(rows, views), decode_views(rows, views, on_device("cpu"))
    assert images.DECODES["rows"] == 8  # each row once per path
    for view in views:
        for a, b in zip(_arrays(by_pillow, view), _arrays(by_device, view), strict=True):
            assert a.shape == b.shape
            if view is RGB:
                assert np.array_equal(a, b)  # the same libjpeg-turbo decode
            else:  # torch's antialiased bicubic against Pillow's
                assert np.abs(a - b).max() <= 1 and np.abs(a - b).mean() < 0.25
    assert by_device["status"].to_pylist() == ["ok"] * 4


def test_what_the_device_does_not_take_goes_to_pillow(views):
    png, good = _encoded("PNG", 1), _encoded("JPEG", 2)
    damaged = good[: len(good) // 3]
    huge = io.BytesIO()
    Image.new("L", (8192, 8193)).save(huge, "JPEG")  # past images.MAX_RAW_PIXELS
    rows = _rows([png, good, damaged, huge.getvalue()])
    by_pillow, by_device = decode_views(rows, views), decode_views(rows, views, on_device("cpu"))
    assert by_device["status"].to_pylist() == ["ok", "ok", "decode_error", "decode_error"]
    assert by_device["status"].to_pylist() == by_pillow["status"].to_pylist()
    assert "past stage 3's cap" in by_device["error"].to_pylist()[3]
    for view in views:  # the PNG through Pillow in both: the same bytes
        assert np.array_equal(_arrays(by_pillow, view)[0], _arrays(by_device, view)[0])


def test_cuda_is_checked_at_start_and_fingerprinted():
    with pytest.raises(ValueError, match="set decode.where: actor"):
        parse_config({"input": {"path": "x"}, "process": {"decode": {"device": "cuda"}}})
    base = {"input": {"path": "x"}, "process": {
        "clip": {"enabled": True}, "decode": {"where": "actor", "device": "cuda"}}}
    with pytest.raises(ConfigError, match=r"clip, asks process.clip.num_gpus 0"):
        check_decode_device([ClipStep, TokenizeStep], parse_config(base))
    base["process"]["clip"]["num_gpus"] = 1
    cuda = parse_config(base)
    check_decode_device([ClipStep, TokenizeStep], cuda)
    assert stage_settings(cuda, "process")["process.decode.device"] == "cuda"
    plain = parse_config({"input": {"path": "x"}, "process": {"decode": {"where": "actor"}}})
    settings = stage_settings(plain, "process")  # where moves work only; cpu is as before
    assert not [key for key in settings if key.startswith("process.decode")]


def test_the_device_decodes_in_calls_bounded_by_the_headers_pixels(monkeypatch, views):
    """A batch of large JPEGs is not decoded on the device at once: calls of at most
    MAX_RAW_PIXELS pixels in all, read from the headers before any decoding; an image past
    the cap alone is left to Pillow (which ends it decode_error)."""
    from pairforge import device_decode

    monkeypatch.setattr(device_decode, "MAX_RAW_PIXELS", 70_000)  # two 200x150 JPEGs
    data = [_encoded("JPEG", seed) for seed in range(5)] + [_encoded("JPEG", 9, (300, 300))]
    rows = _rows(data)
    groups = list(device_decode._calls(rows["image"], np.arange(len(data))))
    assert [sorted(g) for g in groups] == [[0, 1], [2, 3], [4]]  # 90,000 px: row 5 left out
    by_device = decode_views(rows, views, on_device("cpu"))
    assert by_device["status"].to_pylist() == ["ok"] * 6  # Pillow's cap is images.py's
    for view in views:
        assert all(a.shape == b.shape for a, b in zip(
            _arrays(decode_views(rows, views), view), _arrays(by_device, view), strict=True))
