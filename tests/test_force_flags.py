"""The rerun flags say what they do (issue 51, item 4): ``--force`` redoes every shard of
the stages it runs, complete or not, whatever settings they were made under;
``--redo-changed`` redoes only the complete shards made under other settings (what
``--force`` used to mean); without either, a rerun under other settings stops before any
work and names the flag. Reruns still never lie: a shard is skipped only when complete
under the same settings, and a redone raw shard takes its training shard with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import COCO_IMAGES
from typer.testing import CliRunner

from pairforge.cli import _options, app
from pairforge.config import parse_config
from pairforge.pipeline.entry import RunOptions
from pairforge.pipeline.settings import (
    SCORES_DIGEST_KEY,
    SettingsChanged,
    check_settings,
    settings_digest,
    settings_record,
    stage_settings,
)


def _cfg(out: Path, **process) -> object:
    return parse_config({"input": {"path": "in.csv"}, "output": {"path": str(out)},
                         "process": process})


def _write_stats(out: Path, folder: str, shard_id: int, values: dict) -> None:
    (out / folder).mkdir(parents=True, exist_ok=True)
    stats = {"shard": shard_id, "status": {"ok": 1}, "settings": settings_record(values)}
    (out / folder / f"{shard_id:05d}_stats.json").write_text(json.dumps(stats))


def _finished_build(out: Path, cfg: object, shards: int = 3) -> None:
    """Raw and training shards all complete under ``cfg``'s settings, with cached CLIP
    scores and embeddings, as a finished build leaves them."""
    raw = settings_record(stage_settings(cfg, "download"))
    process = {**stage_settings(cfg, "process"), "raw.settings": raw["digest"]}
    (out / "clip").mkdir(parents=True)
    (out / "embeddings").mkdir()
    for shard_id in range(shards):
        _write_stats(out, "raw", shard_id, raw["values"])
        _write_stats(out, "shards", shard_id, process)
        table = pa.table({"key": [f"{shard_id:05d}0000"], "clip_score": [0.3]})
        table = table.replace_schema_metadata({SCORES_DIGEST_KEY: settings_digest(process)})
        pq.write_table(table, out / "clip" / f"{shard_id:05d}.parquet")
        (out / "embeddings" / f"{shard_id:05d}.npy").write_bytes(b"vectors")
        (out / "embeddings" / f"{shard_id:05d}_keys.json").write_text("[]")


def _complete(out: Path, folder: str) -> list[str]:
    return sorted(p.name for p in (out / folder).glob("*_stats.json"))


def test_without_a_flag_a_finished_build_is_skipped_whole(tmp_path):
    cfg = _cfg(tmp_path)
    _finished_build(tmp_path, cfg)
    check_settings(cfg, ("download", "process"), RunOptions())
    assert len(_complete(tmp_path, "raw")) == 3 and len(_complete(tmp_path, "shards")) == 3
    assert len(list((tmp_path / "clip").iterdir())) == 3  # scores made under these settings


def test_force_redoes_every_shard_of_a_finished_build(tmp_path):
    """`build --force` on a build made under the same settings: nothing is complete any
    more, so every stage redoes every shard; the cached CLIP scores go too."""
    cfg = _cfg(tmp_path)
    _finished_build(tmp_path, cfg)
    check_settings(cfg, ("download", "process"), _options(force=True, quiet=True))
    assert _complete(tmp_path, "raw") == [] and _complete(tmp_path, "shards") == []
    assert list((tmp_path / "clip").iterdir()) == []
    assert list((tmp_path / "embeddings").iterdir()) == []
    assert (tmp_path / "raw").is_dir()  # the shards' other files stay until rewritten


def test_process_force_redoes_the_training_shards_only(tmp_path):
    cfg = _cfg(tmp_path)
    _finished_build(tmp_path, cfg)
    check_settings(cfg, ("process",), _options(force=True, quiet=True))
    assert len(_complete(tmp_path, "raw")) == 3
    assert _complete(tmp_path, "shards") == []


def test_download_force_takes_the_training_shards_with_the_raw_ones(tmp_path):
    """A redone raw shard may hold other rows (a URL that failed now answers): the training
    shard made from its old bytes is not complete any more."""
    cfg = _cfg(tmp_path)
    _finished_build(tmp_path, cfg)
    check_settings(cfg, ("download",), _options(force=True, quiet=True))
    assert _complete(tmp_path, "raw") == [] and _complete(tmp_path, "shards") == []


def test_redo_changed_redoes_only_the_shards_made_under_other_settings(tmp_path):
    cfg = _cfg(tmp_path)
    _finished_build(tmp_path, cfg, shards=2)
    changed = _cfg(tmp_path, tasks={"p_drop": 0.5})
    raw = settings_record(stage_settings(cfg, "download"))
    _write_stats(tmp_path, "shards", 2,
                 {**stage_settings(changed, "process"), "raw.settings": raw["digest"]})
    _write_stats(tmp_path, "raw", 2, raw["values"])
    with pytest.raises(SettingsChanged) as err:  # no flag: stop, naming the flags
        check_settings(changed, ("process",), RunOptions())
    assert "--redo-changed" in str(err.value) and "--force" in str(err.value)
    assert "00000, 00001" in str(err.value) and "00002" not in str(err.value)
    check_settings(changed, ("process",), _options(force=False, quiet=True,
                                                   redo_changed=True))
    assert _complete(tmp_path, "shards") == ["00002_stats.json"]  # made under p_drop 0.5
    assert len(_complete(tmp_path, "raw")) == 3


def test_the_flags_map_to_the_run_options():
    assert _options(force=True, quiet=False) == RunOptions(force=True, redo_all=True)
    assert _options(force=False, quiet=False, redo_changed=True) == RunOptions(force=True)
    assert _options(force=False, quiet=True) == RunOptions(show_progress=False)


@pytest.mark.parametrize("verb", ["download", "process", "build"])
def test_every_stage_verb_offers_both_flags(verb):
    help_text = CliRunner().invoke(app, [verb, "-h"], env={"COLUMNS": "100"}).stdout
    assert "--force" in help_text and "--redo-changed" in help_text
    assert "redo every shard" in help_text


def test_force_and_retry_failed_do_not_go_together(tmp_path):
    result = CliRunner().invoke(app, ["download", str(tmp_path / "absent.yaml"), "--force",
                                      "--retry-failed"])
    assert result.exit_code == 2
    assert "--force" in result.output and "--retry-failed" in result.output


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pairforge.cli", *argv], capture_output=True,
                          text=True, timeout=600, env=env)


def test_process_force_on_a_finished_build_redoes_it(tmp_path, ray_env):
    """The issue's case: `pairforge process CONFIG --force` on a finished build used to
    change nothing ("rows 0/0"); now it remakes every training shard, under the settings
    given, and the build still verifies."""
    photos = sorted(COCO_IMAGES.iterdir())[:12]
    lines = ["url,caption"] + [f"{p.as_uri()},a photo of a few things" for p in photos]
    (tmp_path / "in.csv").write_text("\n".join(lines) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "input": {"path": str(tmp_path / "in.csv"), "shard_size": 6},
        "output": {"path": str(tmp_path / "out")}, "ray": {"num_cpus": 2},
        "download": {"threads": 4, "allow_file_scheme": True, "image": {"image_size": 64}},
        "process": {"basic": {"min_image_side": 32}}}))
    built = _cli("build", str(config), "-q", env=ray_env)
    assert built.returncode == 0, built.stderr[-3000:]
    shards = tmp_path / "out" / "shards"
    before = {p.name: p.stat().st_mtime_ns for p in shards.glob("*_stats.json")}
    assert len(before) == 2
    again = _cli("process", str(config), "-q", env=ray_env)
    assert again.returncode == 0 and "2 already complete" in again.stderr
    forced = _cli("process", str(config), "-q", "--force", env=ray_env)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "0 already complete), 12 rows" in forced.stderr
    after = {p.name: p.stat().st_mtime_ns for p in shards.glob("*_stats.json")}
    assert after.keys() == before.keys() and all(after[n] > before[n] for n in before)
    assert _cli("verify", str(tmp_path / "out")).returncode == 0
