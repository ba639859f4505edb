"""Grounding by an open-vocabulary detector (recaption/detector.py, issue 20).

The detector is a tiny random-weight OWL-ViT built from its config with a CLIP tokenizer
trained here (tests/tiny_detector.py), saved with
``save_pretrained`` and loaded by path through the backend's own loading code; the
expected scores come from the bare transformers model, query by query and image by image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_detector import save_tiny_detector

import pairforge
from pairforge.config import ConfigError, GroundingConfig, parse_config
from pairforge.pipeline.preflight import check_model_sources
from pairforge.recaption.checked import load_grounding

SAMPLE = Path(pairforge.__file__).parent / "sample"
WORDS = ["a photo of a dog", "a photo of a cat", "a photo of a bench", "a photo of a bus",
         "a photo of a pizza", "a photo of a fire hydrant", "a photo of a table"]


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> Path:
    return save_tiny_detector(tmp_path_factory.mktemp("owl") / "owlvit", WORDS)


def _images(n: int) -> list[Image.Image]:
    rng = np.random.default_rng(3)
    sizes = [(40, 30), (32, 32), (24, 48), (50, 50)]
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
            for w, h in sizes[:n]]


def _bare_scores(folder: Path, image: Image.Image, queries: list[str]) -> list[float]:
    """Each query alone against one image with the bare model: best box sigmoid."""
    import torch
    from transformers import OwlViTForObjectDetection, OwlViTProcessor

    processor = OwlViTProcessor.from_pretrained(folder)
    model = OwlViTForObjectDetection.from_pretrained(folder).eval()
    out = []
    for query in queries:
        inputs = processor(text=[[query]], images=[image], return_tensors="pt")
        with torch.inference_mode():
            logits = model(**inputs).logits
        out.append(float(torch.sigmoid(logits)[0, :, 0].max()))
    return out


def _grounding(folder: Path, min_score: float = 0.5, **detector):  # noqa: ANN202
    cfg = GroundingConfig(backend="detector",
                          detector={"model": str(folder), "min_score": min_score, **detector})
    return load_grounding(cfg, "cpu", clip=lambda: pytest.fail("the detector loads no CLIP"))


def test_the_captions_object_nouns_are_the_queries_and_score_like_the_bare_model(detector):
    grounding = _grounding(detector)
    image = _images(1)[0]
    caption = "Two people and a dog next to a fire hydrant, a cat and another dog."
    # people are the attribute filter's business; each noun once, in caption order
    nouns = grounding.lexicon.nouns(caption)
    assert nouns == ["dog", "fire hydrant", "cat"]
    scores = grounding.scores([image], [nouns], [None])[0]
    bare = _bare_scores(detector, image, [f"a photo of a {n}" for n in nouns])
    assert scores == pytest.approx(bare, abs=1e-5)
    assert len(set(np.round(scores, 6))) == 3  # the queries differ, so do their scores


def test_the_threshold_decides_which_nouns_are_unsupported(detector):
    image = _images(1)[0]
    caption = "A dog and a cat on a bench near a bus."
    scores = _grounding(detector).scores([image], [["dog", "cat", "bench", "bus"]], [None])[0]
    middle = float(np.median(scores))
    below = [n for n, s in zip(["dog", "cat", "bench", "bus"], scores, strict=True)
             if s < middle]
    assert len(below) == 2
    assert _grounding(detector, middle).unsupported([image], [caption]) == [below]
    assert _grounding(detector, 0.0).unsupported([image], [caption]) == [[]]
    assert _grounding(detector, 1.0).unsupported([image], [caption]) == [
        ["dog", "cat", "bench", "bus"]]
    # the query template is the config's
    other = _grounding(detector, 0.0, query="{noun}").scores([image], [["dog"]], [None])[0]
    assert other == pytest.approx(_bare_scores(detector, image, ["dog"]), abs=1e-5)
    assert other != pytest.approx(scores[:1], abs=1e-4)


def test_a_batch_scores_like_single_images_and_skips_images_without_nouns(detector):
    grounding = _grounding(detector)
    images = _images(4)
    nouns = [["dog", "cat", "bench"], [], ["pizza"], ["bus", "table"]]
    calls: list[tuple[int, int]] = []  # (images, padded queries) per forward call
    hook = grounding.model.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(tuple(out.logits.shape[::2])),
        with_kwargs=True)
    try:
        batched = grounding.scores(images, nouns, [None] * 4)
    finally:
        hook.remove()
    assert calls == [(3, 3)]  # one call; the image without nouns was not sent
    assert batched[1] == []
    for image, names, scores in zip(images, nouns, batched, strict=True):
        single = grounding.scores([image], [names], [None])[0]
        assert scores == pytest.approx(single, abs=1e-5)
    # a batch where no caption names an object runs nothing
    assert grounding.scores(images[:2], [[], []], [None, None]) == [[], []]
    assert grounding.unsupported(images[:2], [None, "The scene is calm."]) == [[], []]


def _detector_problems(model: str) -> list[str]:
    cfg = parse_config({"input": {"path": "unused"}, "process": {"recaption": {
        "enabled": True, "model": str(SAMPLE / "captioner"),
        "grounding": {"backend": "detector", "detector": {"model": model}}}}})
    with pytest.raises(ConfigError) as err:
        check_model_sources(cfg)
    return [line.strip() for line in str(err.value).splitlines()[1:]]


def test_preflight_names_a_missing_or_invalid_detector_and_loads_no_clip(detector, tmp_path):
    key = "process.recaption.grounding.detector.model"
    assert _detector_problems(str(tmp_path / "absent")) == [
        f"{key}: {tmp_path / 'absent'} is not a folder (and is not a hub id)"]
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((detector / "config.json").read_text())
    assert _detector_problems(str(partial)) == [
        f"{key}: {partial} has no model.safetensors or model.safetensors.index.json or "
        "pytorch_model.bin or pytorch_model.bin.index.json",
        f"{key}: {partial} has no processor_config.json or preprocessor_config.json"]
    # a captioner is a model folder, not a detector
    assert _detector_problems(str(SAMPLE / "captioner")) == [
        f"{key}: {SAMPLE / 'captioner'} is a blip model, not an open-vocabulary detector "
        "this backend reads (owlvit or owlv2: e.g. google/owlv2-base-patch16-ensemble)"]
    # the detector folder passes, and the clip section's model is not asked for (a tag
    # that does not exist would be named if it were)
    check_model_sources(parse_config({"input": {"path": "unused"}, "process": {
        "clip": {"pretrained": "no-such-tag"},
        "recaption": {"enabled": True, "model": str(SAMPLE / "captioner"),
                      "grounding": {"backend": "detector",
                                    "detector": {"model": str(detector)}}}}}))


SCENE_NOUNS = "circle\nsquare\ntriangle\ncross, crosses\n"


def _scenes(n: int) -> list[Image.Image]:
    import csv

    with open(SAMPLE / "captions.csv", newline="") as f:
        names = [r["filename"] for r in csv.DictReader(f)][9000:9000 + n]  # held-out scenes
    return [Image.open(SAMPLE / "images" / name).convert("RGB") for name in names]


def _checked(tmp_path: Path, detector: Path, min_score: float):  # noqa: ANN202
    from pairforge.recaption.checked import CheckedCaptioner

    nouns = tmp_path / "scene_nouns.txt"
    nouns.write_text(SCENE_NOUNS)
    cfg = parse_config({"input": {"path": "unused"}, "process": {"recaption": {
        "enabled": True, "model": str(SAMPLE / "captioner"), "max_new_tokens": 24,
        "grounding": {"backend": "detector", "extra_nouns": [str(nouns)],
                      "detector": {"model": str(detector), "min_score": min_score}}}}})
    return CheckedCaptioner(cfg.process.recaption, cfg.process.clip, "cpu")


def test_the_step_keeps_regenerates_and_abstains_as_with_clip(tmp_path, detector):
    """The recaption step's checks (recaption/checked.py) with the detector: the same flags
    and abstentions as the clip backend gives (test_recaption.py)."""
    images = _scenes(3)
    kept = _checked(tmp_path, detector, 0.0).caption_images(images)
    assert all(c.recaption and not c.flags for c in kept), kept
    assert all(any(s in c.recaption for s in ("circle", "square", "triangle", "cross"))
               for c in kept)
    refused = _checked(tmp_path, detector, 1.0)
    refused.clip = None  # the detector backend never asks for the clip model
    for caption, entry in zip(kept, refused.caption_images(images), strict=True):
        shapes = refused.grounding.lexicon.nouns(caption.recaption)
        assert entry.recaption is None
        assert [f for f in entry.flags if f.startswith("regenerated:")] == [
            f"regenerated:ungrounded:{s}" for s in shapes]
        assert any(f.startswith("abstained:ungrounded:") for f in entry.flags)


def test_the_cache_and_the_settings_name_the_detector_only_when_it_runs(detector):
    from pairforge.pipeline.settings import stage_settings
    from pairforge.recaption.cache import cache_identity

    def cfg(grounding: dict):  # noqa: ANN202
        return parse_config({"input": {"path": "unused"}, "process": {"recaption": {
            "enabled": True, "model": str(SAMPLE / "captioner"), "grounding": grounding}}})

    clip = cfg({})
    assert cache_identity(clip)["grounding"] == {"min_score": 0.2,
                                                 "clip": "ViT-B-32/laion2b_s34b_b79k"}
    assert not [k for k in stage_settings(clip, "process") if "detector" in k or
                k.endswith("grounding.backend")]  # shards made before the detector match
    owl = cfg({"backend": "detector", "detector": {"model": str(detector)}})
    identity = cache_identity(owl)["grounding"]
    assert identity["detector"] == str(detector) and identity["min_score"] == 0.1
    assert identity["model_config"] is not None
    values = stage_settings(owl, "process")
    assert values["process.recaption.grounding.backend"] == "detector"
    assert "process.recaption.grounding.detector.model#files" in values
