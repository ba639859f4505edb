"""bench/ablation.py's filtering and mixed-caption arms (issue 50, item 4): their builds'
configs as the product reads them, what the bench counts of a build, and the runs'
scheduling. Nothing here builds or trains (bench/RESULTS.md has the measured runs)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pairforge.config import parse_config
from pairforge.scenes.world import scenes


def configs(ablation, tmp_path: Path) -> dict:
    builds, _ = ablation.plan(quick=False)
    return {name: ablation.build_config(tmp_path, tmp_path / name, tmp_path / "in.csv", spec,
                                        1000, tmp_path / "text")
            for name, spec in builds.items()}


def test_the_filter_arms_are_in_the_full_plan_only(ablation):
    builds, runs = ablation.plan(quick=False)
    assert runs["arms/clip-top30"] == ("clip-top30", "replacement", "mixed")
    assert runs["arms/mixed-80-20"] == ("mixed-80-20", "replacement", "mixed")
    assert builds["clip-top30"] == ablation.Build(0.5, False, 0.3, clip_top=0.3)
    assert builds["mixed-80-20"] == ablation.Build(0.5, True, 0.3, caption="mix",
                                                   recaption_share=0.8)
    quick_builds, quick_runs = ablation.plan(quick=True)
    assert not {"clip-top30", "mixed-80-20"} & set(quick_builds)
    assert not {"arms/clip-top30", "arms/mixed-80-20"} & set(quick_runs)


def test_every_build_config_is_one_the_product_accepts(ablation, tmp_path):
    for name, config in configs(ablation, tmp_path).items():
        parsed = parse_config(config)
        assert parsed.output.path == str(tmp_path / name)


def test_the_clip_arm_filters_the_alt_text_by_the_world_clip(ablation, tmp_path):
    process = parse_config(configs(ablation, tmp_path)["clip-top30"]).process
    assert process.clip.enabled and process.clip.model == "pf-scenes-clip"
    assert (process.clip.mode, process.clip.top_fraction) == ("top_fraction", 0.3)
    assert Path(process.clip.pretrained).is_file()
    assert Path(process.clip.model_config_path).is_file()
    # the alt-text trains, so the clip step judges the training caption
    assert not process.recaption.enabled and process.training_caption() == "original"
    assert not process.recaption_first()


def test_the_mixed_arm_draws_the_recaption_for_80_percent(ablation, tmp_path):
    process = parse_config(configs(ablation, tmp_path)["mixed-80-20"]).process
    assert process.recaption.enabled and process.recaption_first()
    assert (process.tasks.caption, process.tasks.recaption_share) == ("mix", 0.8)
    assert not process.clip.enabled


def test_the_caption_arms_configs_are_unchanged(ablation, tmp_path):
    """The recorded arms' builds get no new key (their config digests stay the same)."""
    built = configs(ablation, tmp_path)
    for name, caption in (("noisy", "original"), ("recaption", "recaption"),
                          ("oracle", "original")):
        assert built[name]["process"]["tasks"] == {"p_drop": 0.3, "caption": caption}
        assert "clip" not in built[name]["process"]
    assert set(built["noisy"]["process"]) == {"basic", "recaption", "tokenize", "tasks"}


def write_shard(folder: Path, rows: list[dict]) -> None:
    (folder / "shards").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "shards" / "00000.parquet")


def test_caption_quality_counts_the_kept_training_images_and_their_sources(ablation,
                                                                             tmp_path):
    train = scenes(4)
    url = "http://127.0.0.1:9/img/t{:05d}.png".format
    write_shard(tmp_path, [
        # kept, the alt-text trains and is exact
        {"url": url(0), "status": "ok", "caption": train[0].sentence, "recaption": None,
         "caption_source": "original"},
        # kept, the recaption trains (exact) and the alt-text is junk
        {"url": url(1), "status": "ok", "caption": "IMG_0001.jpg",
         "recaption": train[1].sentence, "caption_source": "recaption"},
        # kept, a wrong alt-text trains
        {"url": url(2), "status": "ok", "caption": train[0].sentence, "recaption": None,
         "caption_source": "original"},
        # dropped by the filter: no training image
        {"url": url(3), "status": "low_clip_score", "caption": train[3].sentence,
         "recaption": None, "caption_source": None},
        # a held-out row: not a training image
        {"url": "http://127.0.0.1:9/img/h00000.png", "status": "ok", "caption": "x",
         "recaption": None, "caption_source": "original"}])
    quality = ablation.caption_quality(tmp_path, train)
    assert quality["rows"] == 5 and quality["ok_train_rows"] == 3
    assert quality["caption_sources"] == {"original": 2, "recaption": 1}
    assert quality["training_caption_exact"] == pytest.approx(2 / 3)


def test_passes_are_image_tokens_trained_over_those_the_train_shards_hold(ablation):
    report = {"budget": {"image_tokens": 96_000,
                         "manifest_train_shards": {"t2i": {"image_tokens": 20_000},
                                                   "i2t": {"image_tokens": 10_000}}}}
    assert ablation.passes(report) == pytest.approx(3.2)


def test_only_keeps_the_named_arms_and_their_builds(ablation):
    builds, runs = ablation.without(*ablation.plan(quick=False), set(),
                                    {"arms/clip-top30", "arms/recaption"})
    assert set(runs) == {"arms/clip-top30", "arms/recaption"}
    assert set(builds) == {"clip-top30", "recaption"}
    builds, runs = ablation.without(*ablation.plan(quick=False), {"arms/recaption"},
                                    {"arms/clip-top30", "arms/recaption"})
    assert set(runs) == {"arms/clip-top30"} and set(builds) == {"clip-top30"}


def test_a_misspelt_arm_stops_the_run_before_any_work(ablation, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ablation.py", "--only", "arms/clip-top3"])
    with pytest.raises(SystemExit) as stopped:
        ablation.main()
    assert stopped.value.code == 2
    assert "no such arm: arms/clip-top3" in capsys.readouterr().err


def test_runs_train_side_by_side_and_are_measured_one_at_a_time(ablation, monkeypatch,
                                                                tmp_path):
    import argparse

    lock = threading.Lock()
    now = {"training": 0, "measuring": 0}
    most = {"training": 0, "measuring": 0, "both": 0}

    def busy(kind: str, step: int) -> None:
        with lock:
            now[kind] += step
            most[kind] = max(most[kind], now[kind])
            most["both"] = max(most["both"], now["training"] + now["measuring"])

    def train_run(work, shards, name, recipe, schedule, seed, args):
        busy("training", 1)
        time.sleep(0.05)
        busy("training", -1)
        report = {"budget": {"image_tokens": 90, "manifest_train_shards": {
            "t2i": {"image_tokens": 30 if name.startswith("clip") else 90}}}}
        return {"run": f"{name}-s{seed}", "report": report}

    def measure(run, args):
        busy("measuring", 1)
        time.sleep(0.05)
        busy("measuring", -1)
        return {"adherence": 0.5, "run": run["run"]}

    monkeypatch.setattr(ablation, "train_run", train_run)
    monkeypatch.setattr(ablation, "measure", measure)
    jobs = [(name, "replacement", "mixed", seed) for name in ("clip-top30", "recaption")
            for seed in (0, 1)]
    built = {"clip-top30": {"path": tmp_path}, "recaption": {"path": tmp_path}}
    measured = ablation.train_and_measure(tmp_path, built, jobs,
                                          argparse.Namespace(parallel=2))
    assert list(measured) == jobs
    assert measured[jobs[1]] == {"adherence": 0.5, "run": "clip-top30-replacement-mixed-s1",
                                 "passes": 3.0}
    assert measured[jobs[2]]["passes"] == 1.0
    assert most["training"] == 2 and most["measuring"] == 1 and most["both"] <= 2
