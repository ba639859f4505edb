"""The shipped scene-world CLIP (pairforge/sample/clip, scenes/clip.py) and its watermark
head (scenes/watermark.py), loaded through the real paths: the clip step's ClipScorer and
the classifier step's clip-head loader. A few held-out scenes, seconds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pairforge.config import ClassifierConfig, ClipConfig
from pairforge.scenes.clip_eval import EVAL_START, corruptions, roc_auc
from pairforge.scenes.clip_files import CHECKPOINT, SIDE, register
from pairforge.scenes.watermark import DROP_ABOVE, HEAD, stamp
from pairforge.scenes.world import render, scenes

FOLDER = Path(__file__).resolve().parents[1] / "pairforge" / "sample" / "clip"
N = 24


@pytest.fixture(scope="module")
def scorer():
    from pairforge.filters.clip import ClipScorer

    return ClipScorer(ClipConfig(enabled=True, batch_size=8, **register(FOLDER)))


@pytest.fixture(scope="module")
def held():
    return scenes(N, "heldout", start=EVAL_START)


def test_the_shipped_clip_is_small_and_reported():
    assert (FOLDER / CHECKPOINT).stat().st_size < 5 * 1024**2
    report = json.loads((FOLDER / "scenes_report.json").read_text())
    assert report["auc_other_scene"] >= 0.95  # the target, as measured when trained


def test_exact_captions_rank_above_other_scenes_and_junk(scorer, held):
    image = scorer.embed_images([render(s, SIDE) for s in held])
    kinds = corruptions(held)
    score = {kind: (image * scorer.embed_texts(texts)).sum(axis=1)
             for kind, texts in kinds.items()}
    assert (score["exact"] > score["other_scene"]).mean() >= 0.9
    assert (score["exact"] > score["junk"]).mean() >= 0.9
    assert roc_auc(score["exact"], score["other_scene"]) >= 0.9


def test_the_watermark_head_finds_the_stamp(scorer, held):
    from pairforge.filters.classify import load_head

    head = load_head(ClassifierConfig(name="watermark", backend="clip-head",
                                      path=str(FOLDER / HEAD), head_activation="relu",
                                      output="sigmoid"))
    clean = [render(s, SIDE) for s in held]
    marked = [stamp(picture, seed=i) for i, picture in enumerate(clean)]
    assert head.input_dim == scorer.embed_images(clean[:1]).shape[1]
    clean_scores = head(scorer.embed_images(clean))
    marked_scores = head(scorer.embed_images(marked))
    assert roc_auc(marked_scores, clean_scores) >= 0.95
    assert (marked_scores > DROP_ABOVE).mean() >= 0.6 and (clean_scores > DROP_ABOVE).mean() <= 0.1


def test_the_stamp_is_seeded_and_visible():
    picture = render(scenes(1, "train")[0], SIDE)
    assert np.array_equal(np.asarray(stamp(picture, 3)), np.asarray(stamp(picture, 3)))
    assert np.abs(np.asarray(stamp(picture, 3), dtype=int) - np.asarray(picture)).mean() > 5
