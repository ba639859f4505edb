"""The scene world: lazy seeded scenes, exact captions, held-out split, alt-text, judge."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pairforge.scenes import corrupt as alt
from pairforge.scenes.judge import compare, judge, score
from pairforge.scenes.world import (
    Scene,
    Thing,
    caption_split,
    parse_caption,
    random_scene,
    render,
    scene,
    scenes,
)


def kind_counts(corrupted: list[tuple[str, str]]) -> dict[str, int]:
    """Rows per corruption kind (every kind named, 0 when absent)."""
    counts = Counter(kind for _, kind in corrupted)
    return {k: counts.get(k, 0) for k in alt.KINDS}


def test_scenes_are_lazy_and_seeded():
    assert scene(19_999) == scene(19_999)  # no need to draw the 19,999 before it
    assert scene(5, seed=1) != scene(5, seed=0)
    assert scene(5, "train") != scene(5, "captioner")
    assert scenes(3, start=10) == [scene(10), scene(11), scene(12)]
    with pytest.raises(ValueError, match="split"):
        scene(0, "test")  # type: ignore[arg-type]


def test_heldout_captions_never_occur_in_training_splits():
    train = {s.caption for s in scenes(20_000)} | {s.caption for s in scenes(5_000, "captioner")}
    held = {s.caption for s in scenes(2_000, "heldout")}
    assert not train & held
    assert len(held) > 700  # the held-out split is not a handful of repeats
    assert all(caption_split(c) == "heldout" for c in held)


def test_captions_are_plain_english_and_parse_back():
    s = Scene((Thing("circle", "red", "large"), Thing("square", "blue", "small")), "above",
              "white", ((0.5, 0.25), (0.5, 0.75)))
    assert s.caption == "a large red circle above a small blue square on a white background"
    one = Scene((Thing("cross", "green", "small"),), "left", "grey")
    assert one.caption == "a small green cross on the left on a grey background"
    for drawn in scenes(3_000) + scenes(500, "heldout"):
        assert parse_caption(drawn.caption) == drawn.attributes()
    assert parse_caption("IMG_0042.jpg") is None
    assert parse_caption("a red circle") is None
    assert parse_caption("  A large red circle above a small blue square on a white "
                         "background. ") == s.attributes()


def test_both_counts_occur_and_render_is_square():
    drawn = scenes(400)
    assert {len(s.things) for s in drawn} == {1, 2}
    assert render(drawn[0], 48).size == (48, 48)


@pytest.mark.parametrize("side", [32, 64])
def test_judge_reads_ground_truth_renders(side):
    held = scenes(300, "heldout")
    result = score([s.attributes() for s in held], [render(s, side) for s in held])
    assert result["all"] >= 0.98, result


def test_judge_sees_what_is_missing():
    s = scene(3)
    blank = Scene((), "", s.background, ())
    judged = judge(render(blank, 32))
    assert judged.things == () and judged.background == s.background
    verdict = compare(s.attributes(), judged)
    assert not verdict["count"] and not verdict["all"] and verdict["background"]


def test_compare_per_attribute():
    p = Scene((Thing("circle", "red", "large"),), "left", "white")
    j = Scene((Thing("circle", "blue", "large"),), "left", "white")
    v = compare(p, j)
    assert v["shape"] and v["size"] and v["position"] and not v["colour"]
    assert not v["colour+shape"] and not v["all"]
    assert compare(p, p)["all"]


def test_alt_text_shares_are_exact():
    drawn = scenes(20_000)
    noisy = alt.corrupt(drawn, share=0.5, junk=0.02, seed=3)
    assert kind_counts(noisy) == {"exact": 10_000, "attribute": 4_800,
                                      "other_scene": 4_800, "junk": 400}
    for s, (text, kind) in zip(drawn, noisy, strict=True):
        assert (text == s.caption) == (kind == "exact")
        if kind in ("attribute", "other_scene"):
            assert parse_caption(text) is not None  # fluent, plausible and wrong
        if kind == "junk":
            assert parse_caption(text) is None
    assert noisy == alt.corrupt(drawn, share=0.5, junk=0.02, seed=3)
    assert noisy != alt.corrupt(drawn, share=0.5, junk=0.02, seed=4)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.75, 1.0])
def test_alt_text_other_shares(share):
    drawn = scenes(1_000)
    counts = kind_counts(alt.corrupt(drawn, share=share, junk=0.0 if share == 0 else 0.01))
    assert counts["exact"] == 1_000 - round(share * 1_000)
    with pytest.raises(ValueError):
        alt.corrupt(drawn, share=0.1, junk=0.2)


def test_changed_attributes_always_differ():
    rng = random.Random(0)
    for _ in range(2_000):
        s = random_scene(rng).attributes()
        assert alt.change_attributes(s, rng) != s
