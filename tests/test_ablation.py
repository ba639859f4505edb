"""bench/ablation.py's pieces that need no build: the served alt-text and the summaries."""

from __future__ import annotations

import csv

import pytest

from pairforge.download.alt_text import read_alt_text
from pairforge.scenes.world import parse_caption, scenes


@pytest.mark.parametrize("junk", [0.0, 0.1])
def test_input_table_corrupts_training_rows_only(ablation, tmp_path, junk):
    train, held = scenes(400), scenes(100, "heldout")
    path = ablation.write_input(tmp_path, "http://127.0.0.1:9", train, held, share=0.5,
                                junk=junk)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 500
    assert all(r["url"].startswith("http://127.0.0.1:9/img/") for r in rows)
    exact = [parse_caption(r["caption"]) == s.attributes()
             for r, s in zip(rows[:400], train, strict=True)]
    assert sum(exact) == 200  # exactly half the training alt-text is right
    assert all(r["caption"] == s.sentence for r, s in zip(rows[400:], held, strict=True))
    assert all(r["caption"].endswith(".") for r in rows if parse_caption(r["caption"]))
    unusable = [read_alt_text(r["caption"].encode()).issue is not None for r in rows]
    assert sum(unusable) == round(junk * 400)  # web junk, in the training rows only
    assert not any(unusable[400:])


def test_summaries_are_means_and_spreads(ablation):
    a = {"adherence": 0.2, "per": {"colour": 0.5}, "name": "x"}
    b = {"adherence": 0.4, "per": {"colour": 0.7}, "name": "x"}
    s = ablation.summarise([a, b])
    assert s["adherence"] == pytest.approx(0.3) and s["per"]["colour"] == pytest.approx(0.6)
    assert s["std"]["adherence"] == pytest.approx(0.1414, abs=1e-4)
    assert s["name"] == "x" and s["seeds"] == 2


def test_quick_plan_shares_one_build_per_caption_source(ablation):
    builds, runs = ablation.plan(quick=True)
    assert set(builds) == {"noisy", "recaption", "oracle"}
    assert runs["recipe/replacement"] == runs["arms/recaption"]  # one run, reported twice
    full_builds, full_runs = ablation.plan(quick=False)
    assert {"share0.25", "share0.75", "recaption-p0.1"} <= set(full_builds)
    assert "recipe/staged" in full_runs


def test_skipped_arms_take_their_builds_with_them(ablation):
    builds, runs = ablation.without(*ablation.plan(quick=False),
                                    {"recipe/replacement-p0.1", "recipe/baseline-p0.1"})
    assert "recaption-p0.1" not in builds and "recipe/replacement-p0.1" not in runs
    assert {"noisy", "recaption", "oracle", "share0.25", "share0.75", "clip-top30",
            "mixed-80-20"} == set(builds)
    assert len(runs) == 10  # 5 caption arms, 2 recipe at p_drop 0.3, staged, 2 corruption


def test_profiles_fill_only_unset_settings(ablation):
    import argparse

    quick = ablation.with_profile(argparse.Namespace(
        quick=True, seeds=None, train=None, heldout=None, prompts=None, steps=1000,
        d_model=None, layers=None))
    assert (quick.seeds, quick.train, quick.steps, quick.d_model) == (1, 3000, 1000, 96)
    full = ablation.with_profile(argparse.Namespace(
        quick=False, seeds=None, train=None, heldout=None, prompts=None, steps=None,
        d_model=None, layers=None))
    assert (full.seeds, full.train, full.heldout, full.steps, full.layers) == \
        (3, 10000, 1000, 3000, 3)
