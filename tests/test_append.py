"""Append: input files added to a finished build become new shards (download/input_plan.py);
the earlier shards' files are not touched (mtimes and bytes), the new rows are deduplicated
against the earlier ones, and a changed earlier file stops the run before any work."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import COCO_IMAGES
from loopback_server import LoopbackServer

from pairforge.config import ConfigError, parse_config
from pairforge.download.input_plan import PLAN_FILE
from pairforge.download.inputs import InputFile, plan_input

PHOTOS = sorted(p.name for p in COCO_IMAGES.glob("*.jpg"))


def _write(folder: Path, name: str, server: LoopbackServer, photos: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("url,caption\n" + "".join(
        f"{server.url('/img/' + p)},a photo of {p}\n" for p in photos))


def _build(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cfg = {"input": {"path": str(tmp_path / "in" / "*.csv"), "shard_size": 4},
           "output": {"path": str(tmp_path / "out")},
           "ray": {"num_cpus": 2, "object_store_memory": 200 * 1024**2},
           "download": {"threads": 4, "allow_addresses": ["127.0.0.1/32"],
                        "image": {"image_size": 32}},
           "process": {"basic": {"min_image_side": 8}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "pairforge.cli", "build",
                           str(tmp_path / "c.yaml"), "-q"], capture_output=True, text=True,
                          timeout=600, env=env)


def _files(out: Path) -> dict[str, tuple[int, str]]:
    """The shard files (raw and training): NNNNN.tar, .parquet, _stats.json."""
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns,
                                      hashlib.sha256(p.read_bytes()).hexdigest())
            for folder in ("raw", "shards") for p in sorted((out / folder).glob("[0-9]*"))}


def test_two_new_files_become_new_shards_and_touch_no_earlier_one(tmp_path, ray_env):
    with LoopbackServer(COCO_IMAGES) as server:
        _write(tmp_path / "in", "b.csv", server, PHOTOS[0:6])  # shards 0 (4 rows), 1 (2)
        _write(tmp_path / "in", "c.csv", server, PHOTOS[6:9])  # ... 1 (2 more), 2 (1)
        first = _build(tmp_path, ray_env)
        assert first.returncode == 0, first.stderr[-3000:]
        out = tmp_path / "out"
        before = _files(out)
        assert sorted(p.name for p in (out / "raw").glob("*.tar")) == [
            "00000.tar", "00001.tar", "00002.tar"]
        # two new files, one sorting before the earlier ones; one row repeats an
        # earlier image
        _write(tmp_path / "in", "a.csv", server, PHOTOS[9:12])
        _write(tmp_path / "in", "d.csv", server, [PHOTOS[13], PHOTOS[0]])
        second = _build(tmp_path, ray_env)
        assert second.returncode == 0, second.stderr[-3000:]
    after = _files(out)
    for name, seen in before.items():
        assert after[name] == seen, name  # not rewritten, not even touched
    new = sorted(set(after) - set(before))
    assert new == [f"{folder}/0000{i}{suffix}" for folder in ("raw", "shards")
                   for i in (3, 4) for suffix in (".parquet", ".tar", "_stats.json")]
    plan = json.loads((out / PLAN_FILE).read_text())
    assert [g["first_shard"] for g in plan["groups"]] == [0, 3]
    # (csv inputs are planned as their splits under OUT/inputs/, named after them)
    assert [Path(f["path"]).name.split(".")[0] for f in plan["groups"][1]["files"]] == \
        ["a", "d"]
    # the new shards hold the new files' rows in input order: a.csv, then d.csv
    rows = pq.read_table([str(out / "raw" / f"0000{i}.parquet") for i in (3, 4)]).to_pylist()
    assert [r["url"].rsplit("/", 1)[1] for r in rows] == [*PHOTOS[9:12], PHOTOS[13], PHOTOS[0]]
    assert [r["key"] for r in rows] == ["000030000", "000030001", "000030002", "000030003",
                                        "000040000"]
    # the repeat of an earlier image is a duplicate of the earlier row, which stays
    final = pq.read_table(out / "shards" / "00004.parquet").to_pylist()
    assert final[0]["status"] == "duplicate_exact"
    duplicates = pq.read_table(out / "dedup" / "duplicates.parquet").to_pylist()
    assert [(d["key"], d["kept_key"]) for d in duplicates] == [("000040000", "000000000")]
    # stage 2 read only the two new raw shards, against the first run's 9 survivors
    dedup = json.loads((out / "dedup" / "dedup_stats.json").read_text())
    assert dedup["last_run"] == {"mode": "append", "raw_files_read": 2,
                                 "rewritten_raw_files": 0, "index_rows_read": 9}
    assert (dedup["ok_rows"], dedup["kept"], dedup["duplicate_exact"]) == (14, 13, 1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["funnel"]["input_rows"] == 14
    assert manifest["funnel"]["final"] == {"ok": 13, "duplicate_exact": 1}
    assert [s["name"] for s in manifest["shards"]] == [f"0000{i}.tar" for i in range(5)]


def test_a_changed_or_missing_earlier_file_stops_the_run(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.csv").write_text("url,caption\nhttp://127.0.0.1:9/x.jpg,a cat\n")
    cfg = parse_config({"input": {"path": str(folder / "*.csv"), "shard_size": 4},
                        "output": {"path": str(tmp_path / "out")}})
    shards = plan_input(cfg.input, cfg.output, lambda jobs: [1] * len(jobs))
    assert [s.shard_id for s in shards] == [0]
    # before any shard is complete the plan binds nothing: the input plans afresh
    (folder / "b.csv").write_text("url,caption\nhttp://127.0.0.1:9/z.jpg,a cow\n")
    assert [s.num_rows for s in
            plan_input(cfg.input, cfg.output, lambda jobs: [1] * len(jobs))] == [2]
    (folder / "b.csv").unlink()
    assert [s.num_rows for s in
            plan_input(cfg.input, cfg.output, lambda jobs: [1] * len(jobs))] == [1]
    (tmp_path / "out" / "raw").mkdir()
    (tmp_path / "out" / "raw" / "00000_stats.json").write_text("{}")  # shard 0 is complete
    (folder / "a.csv").write_text("url,caption\nhttp://127.0.0.1:9/x.jpg,a cat\n"
                                  "http://127.0.0.1:9/y.jpg,a dog\n")
    with pytest.raises(ConfigError, match=r"a\.csv.* changed since this build planned it"):
        plan_input(cfg.input, cfg.output, lambda jobs: [2] * len(jobs))
    (folder / "a.csv").unlink()
    (folder / "c.csv").write_text("url,caption\nhttp://127.0.0.1:9/x.jpg,a cat\n")
    with pytest.raises(ConfigError, match=r"a\.csv.* no longer in input.path"):
        plan_input(cfg.input, cfg.output, lambda jobs: [1] * len(jobs))


def test_another_shard_size_plans_afresh(tmp_path):
    from pairforge.download.input_plan import planned_shards
    from pairforge.download.inputs import shards_of
    from pairforge.shards.storage import OutputDir

    out = OutputDir(str(tmp_path))
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "00000_stats.json").write_text("{}")  # a shard is complete
    files = [InputFile("a", 10, False), InputFile("b", 3, False)]
    assert [s.shard_id for s in planned_shards(out, files, 4, shards_of)] == [0, 1, 2, 3]
    grown = [*files, InputFile("c", 5, False)]
    assert [s.shard_id for s in planned_shards(out, grown, 4, shards_of)] == \
        [0, 1, 2, 3, 4, 5]
    assert [s.shard_id for s in planned_shards(out, grown, 4, shards_of)] == \
        [0, 1, 2, 3, 4, 5]  # recorded: the same again
    assert [s.shard_id for s in planned_shards(out, grown, 8, shards_of)] == [0, 1, 2]
