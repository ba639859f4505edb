"""The scene world's shipped models: the judge reads VQ reconstructions, the captioner
captions held-out scenes (captions no training split holds) with exact attributes."""

from __future__ import annotations

from pathlib import Path

import pytest

import pairforge
from pairforge.scenes.judge import score
from pairforge.scenes.world import render, scenes

SAMPLE = Path(pairforge.__file__).parent / "sample"


@pytest.fixture(scope="module")
def held():
    return scenes(300, "heldout")


def test_judge_reads_vq_reconstructions_of_heldout_scenes(held):
    from pairforge.tokenizers.vq_tokenizer import PairforgeVQTokenizer

    vq = PairforgeVQTokenizer(SAMPLE / "vq32")
    recons = vq.decode(vq.encode([render(s, vq.resolution) for s in held]))
    result = score([s.attributes() for s in held], recons)
    assert result["all"] >= 0.90, result
    # the analytic templates alone do not read the VQ's rounded shapes: why the net exists
    assert score([s.attributes() for s in held[:100]], recons[:100], shape="template")["shape"] \
        < result["shape"]


def test_shipped_captioner_captions_heldout_scenes_exactly(held):
    from pairforge.scenes.captioner import SIDE, accuracy, caption_images

    captions = caption_images(SAMPLE / "captioner", [render(s, SIDE) for s in held[:200]])
    assert accuracy(captions, held[:200]) >= 0.95
